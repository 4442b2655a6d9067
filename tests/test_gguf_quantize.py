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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_kept_quantized_decode_rows_do_not_depend_on_their_company(path: Path,
                                                                   threads: int) -> None:
    # Every kept form (int4 planes, a packed bfloat16 Q6_K copy, the packed float16 head)
    # runs untiled in the batch-invariant mode where it computes rows on their own: a
    # sequence's decode logits must be the same bits alone and beside two others.
    from backends.gguf.backend import hf_config
    from backends.torch.backend import TorchBackend
    from backends.torch.config import ModelSpec
    from backends.torch.model import Transformer
    from pipeline.contracts.model import ModelCall
    from backends.gguf.load import load_weights

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        f = GGUFFile.open(path)
        spec = ModelSpec.from_hf_config(hf_config(f))
        loaded = load_weights(f, spec, quantized=True)
        backend = TorchBackend(Transformer(spec, loaded.weights, own_products=loaded.products,
                                           batch_invariant=True), "x", num_slots=3,
                               max_context=64)
        slots = [backend.allocate() for _ in range(3)]
        for s in slots:
            backend.forward([ModelCall(s, (5 + s, 9, 13), 0, (2,), prompt=True)])
        alone, together = [], []
        for step in range(4):
            alone.append(backend.forward([ModelCall(slots[0], (20 + step,), 3 + step, (0,))])[0])
        backend.truncate(slots[0], 3)
        for step in range(4):
            out = backend.forward([ModelCall(s, (20 + step if s == slots[0] else 40 + s,),
                                             3 + step, (0,)) for s in slots])
            together.append(out[0])
        for a, b in zip(alone, together):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)
