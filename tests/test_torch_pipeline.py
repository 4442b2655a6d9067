"""The torch backend behind the whole pipeline: build() picks it by name for a folder with
weights, and pipeline.generate's greedy tokens equal transformers' generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline import build
from pipeline.testing import ByteDetokenizer, ByteTokenizer, ChatMLRenderer

transformers = pytest.importorskip("transformers")
V = ByteTokenizer.VOCAB


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = transformers.Qwen3ForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(folder)
    return folder, model


def test_generate_through_the_pipeline_equals_transformers(tiny_qwen3) -> None:
    folder, model = tiny_qwen3
    with build(folder, tokenizer=ByteTokenizer(), renderer=ChatMLRenderer(),
               detokenizer=ByteDetokenizer(), options={"num_slots": 4, "max_context": 128}) as pipe:
        prompt = pipe.tokenize("Why is the sky blue?")
        done = pipe.generate("Why is the sky blue?", max_tokens=32, temperature=0,
                             ignore_eos=True)
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert list(done.token_ids) == ref[0, len(prompt):].tolist()
    assert len(done.token_ids) == 32
