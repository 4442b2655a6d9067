"""GGUF files as llama.cpp's own ``llama-quantize`` writes them, for every quantized type the
loader claims besides Q8_0 (which tests/test_gguf_converter.py gets from the converter).

The files (tests/gguf_fixtures/, made by scripts/gguf_fixtures.py: a tiny random Llama 256
wide, converted by ``convert_hf_to_gguf.py`` and quantized with ``llama-quantize --pure``) are
checked against two oracles from llama.cpp's side: the ``gguf`` package's reference
dequantization of every tensor, and transformers' own GGUF loader, which builds a float32 model
from those dequantized weights; ours must give its prefill logits and greedy tokens when it
dequantizes at load, and agree within the quantized mode's precision when it keeps the file
quantized (the default on a CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from backends.gguf.load import dequantize_tensor
from pipeline.gguf_file import GGUFFile
from pipeline import build
from pipeline.contracts.request import Request

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "gguf_fixtures"
FILES = sorted(FIXTURES.glob("llama-*.gguf"))
KEPT = {"q4_0": 2e-2, "q4_1": 2e-2, "q4_k": 1e-2, "q5_k": 1e-2, "q6_k": 1e-2}
"""Largest prefill logit difference of the kept-quantized default from the float model,
relative to the largest logit: the Q4_0/Q4_1 matrices run on the int4 kernel with bfloat16
activations, and so do Q4_K and Q5_K (Q5_K on two planes); Q6_K is kept in bfloat16; the quantized token table and
head are float16 in every file."""


def test_every_type_llama_quantize_makes_is_here() -> None:
    assert [p.stem.removeprefix("llama-") for p in FILES] == sorted(KEPT)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_tensor_dequantizes_as_the_reference_does(path: Path) -> None:
    f = GGUFFile.open(path)
    kinds = set()
    for name, tensor in f.tensors.items():
        kinds.add(tensor.tensor_type.name)
        ours = dequantize_tensor(tensor, torch.float32)
        want = gguf.quants.dequantize(np.ascontiguousarray(tensor.data), tensor.tensor_type)
        want_t = torch.from_numpy(np.asarray(want, dtype=np.float32).reshape(ours.shape).copy())
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(ours, want_t, rtol=4 * eps,
                                   atol=4 * eps * float(want_t.abs().max()), msg=name)
    assert kinds == {"F32", path.stem.removeprefix("llama-").upper()}


@pytest.fixture(scope="module")
def oracles() -> dict[str, Any]:
    """transformers' float32 model of each file (its GGUF loader dequantizes with ``gguf``)."""
    out = {}
    for path in FILES:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        out[path.stem] = model
    return out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_a_quantized_file_decodes_as_the_float_model_of_its_dequantized_weights(
        oracles: dict[str, Any], path: Path) -> None:
    model = oracles[path.stem]
    ids = [int(i) for i in torch.randint(5, 320, (19,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float()
        want = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                              min_new_tokens=10)[0, len(ids):].tolist()
    scale = float(ref.abs().max())
    for quantized, tolerance in ((False, 1e-4), (None, KEPT[path.stem.removeprefix("llama-")])):
        options = {"num_slots": 1, "max_context": 64, "quantized": quantized}
        with build(path, options=options) as pipe:
            done = pipe.generate(Request(prompt_ids=ids, recording="full", generation_config={
                "max_tokens": 10, "min_tokens": 10, "temperature": 0, "ignore_eos": True}))
        first = next(e for e in done.trace if e.event_type == "prefill.completed")
        for token, value in first.payload["logits"]["top"]:
            assert abs(value - float(ref[int(token)])) <= tolerance * scale, (quantized, token)
        if quantized is False:
            assert list(done.token_ids) == want
