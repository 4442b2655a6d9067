"""Embedding inputs in the torch backend, against the training scripts' own model.

The training scripts (``scripts/continuous_training.py``) compute the block-causal
two-stream forward in one pass with an explicit attention mask; the backend computes it
incrementally (a causal prefill into the KV cache, then a bidirectional block over it that
does not write, then the rounded block written causally). Equal logits mean the shipped
models are used at inference exactly as they were trained, and the cache of final blocks is
exact. Also: the calls' checks (shapes, conditioning the model lacks).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from backends.torch.backend import TorchBackend
from pipeline.errors import SlotError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.model import Attention, EmbeddingInputs, ModelCall

ROOT = Path(__file__).resolve().parent.parent


def training_module() -> ModuleType:
    name = "continuous_training"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, TorchBackend]:
    """A randomly initialised training model (weights rounded to bf16, as saved) and the
    backend that loads its saved folder in float32."""
    ct = training_module()
    cfg = ct.TrainConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    torch.manual_seed(3)
    model = ct.Denoiser(cfg, vocab_size=6144)
    with torch.no_grad():
        for p in model.parameters():  # far from the identity init: every term matters
            p.add_(torch.randn_like(p) * 0.2)
            p.copy_(p.to(torch.bfloat16).float())
    out = tmp_path_factory.mktemp("denoiser")
    ct.save(model, cfg, out, {"family": "flow", "strategy": "flow"})
    backend = TorchBackend.from_dir(out, num_slots=2, max_context=128, dtype="float32",
                                    pack=False)
    return model, backend


def test_block_call_equals_the_training_forward(pair: tuple[object, TorchBackend]) -> None:
    model, backend = pair
    ct = training_module()
    m, n, d = 10, 6, backend.embedding_dim
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6144, (1, m + n), generator=gen)
    x_t = torch.randn(1, m + n, d, generator=gen)
    sc = torch.randn(1, m + n, d, generator=gen)
    blocks = torch.tensor([[0] * m + [1] * n])
    times = torch.full((1, m + n), 0.37)
    with torch.no_grad():
        want = model(ids, x_t, times, sc, ct.block_causal_mask(blocks))[0, m:]     # [n, V]
        plain = model(ids, x_t, times, None, ct.block_causal_mask(blocks))[0, m:]
    slot = backend.allocate()
    backend.forward([ModelCall(slot, tuple(ids[0, :m].tolist()), 0, ())])
    placeholder = (0,) * n
    got = backend.forward([ModelCall(slot, placeholder, m, tuple(range(n)), Attention.BLOCK,
                                     write=False, embeddings=x_t[0, m:], time=0.37,
                                     self_condition=sc[0, m:])])
    assert backend.cache_length(slot) == m                     # the denoising pass wrote nothing
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4)
    got_plain = backend.forward([ModelCall(slot, placeholder, m, tuple(range(n)),
                                           Attention.BLOCK, write=False,
                                           embeddings=x_t[0, m:], time=0.37)])
    assert torch.allclose(got_plain, plain, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(got_plain, got, atol=1e-2)       # self-conditioning matters
    backend.release(slot)


def test_written_block_is_the_clean_stream(pair: tuple[object, TorchBackend]) -> None:
    """After the rounded block is written causally, the next block sees exactly what the
    training forward's second block sees (clean tokens before it)."""
    model, backend = pair
    ct = training_module()
    m, n, d = 7, 5, backend.embedding_dim
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6144, (1, m + 2 * n), generator=gen)
    x_t = torch.randn(1, m + 2 * n, d, generator=gen)
    blocks = torch.tensor([[0] * m + [1] * n + [2] * n])
    times = torch.full((1, m + 2 * n), 0.8)
    with torch.no_grad():
        want = model(ids, x_t, times, None, ct.block_causal_mask(blocks))[0, m + n:]
    slot = backend.allocate()
    backend.forward([ModelCall(slot, tuple(ids[0, :m].tolist()), 0, ())])
    backend.forward([ModelCall(slot, tuple(ids[0, m:m + n].tolist()), m, (n - 1,))])
    got = backend.forward([ModelCall(slot, (1,) * n, m + n, tuple(range(n)), Attention.BLOCK,
                                     write=False, embeddings=x_t[0, m + n:], time=0.8)])
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4)
    backend.release(slot)


def test_the_backend_takes_embedding_inputs(pair: tuple[object, TorchBackend]) -> None:
    _, backend = pair
    assert isinstance(backend, EmbeddingInputs)
    assert backend.time_conditioned and backend.self_conditioned
    space = backend.embedding_space()
    assert space.shape == (6144, backend.embedding_dim)
    assert torch.allclose(space.pow(2).mean(-1), torch.ones(6144), atol=1e-4)


def test_bad_embedding_calls_are_refused(pair: tuple[object, TorchBackend]) -> None:
    _, backend = pair
    slot = backend.allocate()
    backend.forward([ModelCall(slot, (5, 6, 7), 0, ())])
    d = backend.embedding_dim
    with pytest.raises(SlotError, match="embeddings and self_condition"):
        backend.forward([ModelCall(slot, (0, 0), 3, (0,), embeddings=torch.zeros(3, d))])
    with pytest.raises(SlotError, match="time must be"):
        backend.forward([ModelCall(slot, (0,), 3, (0,), embeddings=torch.zeros(1, d),
                                   time=1.5)])
    assert backend.cache_length(slot) == 3
    backend.release(slot)


def test_a_plain_model_refuses_conditioning_but_takes_embeddings() -> None:
    backend = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=1, max_context=64)
    assert not backend.time_conditioned and not backend.self_conditioned
    slot = backend.allocate()
    backend.forward([ModelCall(slot, (5, 6, 7), 0, ())])
    h = backend.embedding_dim
    with pytest.raises(SlotError, match="no time conditioning"):
        backend.forward([ModelCall(slot, (0,), 3, (0,), time=0.5)])
    with pytest.raises(SlotError, match="no self-conditioning"):
        backend.forward([ModelCall(slot, (0,), 3, (0,), self_condition=torch.zeros(1, h))])
    # Feeding a token's own embedding row gives that token's logits.
    row = backend.model.weights.embed[9:10]
    by_embedding = backend.forward([ModelCall(slot, (0,), 3, (0,), write=False,
                                              embeddings=row)])
    by_id = backend.forward([ModelCall(slot, (9,), 3, (0,), write=False)])
    assert torch.equal(by_embedding, by_id)
    backend.release(slot)
