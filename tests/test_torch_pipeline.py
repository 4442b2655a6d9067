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


def test_kv_pool_options_size_the_paged_cache(tiny_qwen3) -> None:
    """``block_size`` and ``kv_blocks`` or a byte budget ``kv_cache_bytes`` reach the backend;
    generation is unchanged by the block size."""
    from backends.torch.backend import block_bytes
    from pipeline.errors import InvalidValueError

    folder, model = tiny_qwen3
    stages = dict(tokenizer=ByteTokenizer(), renderer=ChatMLRenderer(),
                  detokenizer=ByteDetokenizer())
    per_block = 2 * 2 * 2 * 16 * 4 * 8          # k and v, 2 layers, 2 kv heads, D 16, fp32
    with build(folder, **stages, options={"num_slots": 2, "max_context": 128, "block_size": 8,
                                          "kv_cache_bytes": 40 * per_block + 5}) as pipe:
        backend = pipe.engine.backend
        assert block_bytes(backend.model.spec, torch.float32, 8) == per_block
        assert (backend.num_blocks, backend.block_size) == (40, 8)
        done = pipe.generate("Why is the sky blue?", max_tokens=20, temperature=0,
                             ignore_eos=True)
        prompt = pipe.tokenize("Why is the sky blue?")
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt.input_ids]), max_new_tokens=20,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    assert list(done.token_ids) == ref[0, len(prompt):].tolist()
    with build(folder, **stages, options={"max_context": 128, "kv_blocks": 9}) as pipe:
        assert (pipe.engine.backend.num_blocks, pipe.engine.backend.block_size) == (9, 16)
    with pytest.raises(InvalidValueError, match="kv_blocks or kv_cache_bytes"):
        build(folder, **stages, options={"kv_blocks": 9, "kv_cache_bytes": 1 << 20})


def test_a_real_qwen3_layout_with_its_padded_vocabulary_generates(tmp_path: Path) -> None:
    # Every Qwen3 checkpoint has 151,936 rows for a tokenizer of 151,669 ids: the engine masks
    # the padding rows of the backend's (inference-mode) logits before selection, in place.
    import shutil

    from qwen_files import qwen_dir

    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=151_936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_dir() / name, tmp_path / name)
    with build(tmp_path) as counter:  # tokenizer files only so far: the prompt's ids
        first = list(counter.tokenize("Hello").input_ids)
    with torch.no_grad():  # a padding row that wins the first step, as an untrained row can
        hidden = model.model(torch.tensor([first])).last_hidden_state[0, -1]
        model.lm_head.weight[151_900] = 100.0 * hidden / hidden.norm() ** 2
        assert int(model(torch.tensor([first])).logits[0, -1].argmax()) == 151_900
    model.save_pretrained(tmp_path)
    with build(tmp_path, options={"max_context": 96}) as pipe:
        assert pipe.engine is not None and pipe.engine.decodable_vocab == 151_669
        prompt = pipe.tokenize("Hello")
        done = pipe.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True)
    ids = list(prompt.input_ids)
    with torch.no_grad():  # transformers, greedy over the ids the tokenizer can decode
        for _ in range(6):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits[:151_669].argmax()))
    assert list(done.token_ids) == ids[len(prompt):]
