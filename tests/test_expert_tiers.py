"""Expert tiers (:mod:`backends.torch.experts`): an MoE model under an expert memory cap.

The oracle is the same checkpoint loaded whole (itself checked against transformers in
``test_torch_backend``) and, for a Mixtral checkpoint, transformers directly: a capped model
must give the same logits bit for bit and the same greedy tokens, whatever the cap and the
layout the experts are stored in. The eviction policies are checked against hand-worked
access sequences.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.torch.backend import TorchBackend
from backends.torch.config import ModelSpec
from backends.torch.experts import DOWN, GATE_UP, ExpertCache
from backends.torch.loader import read_config
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.options import BackendOptions
from pipeline.contracts.model import PrefillChunk

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_SPEC = ModelSpec.from_hf_config(read_config(TINY_MODEL_DIR))
ONE_EXPERT_F32 = 3 * 256 * 192 * 4  # the tiny model's gate, up and down in float32


def _run(backend: TorchBackend, prompts: Sequence[Sequence[int]], steps: int) -> tuple[
        torch.Tensor, list[list[int]]]:
    """A batched prefill then ``steps`` batched greedy decode steps: every logit row seen,
    and each sequence's tokens."""
    slots = [backend.allocate() for _ in prompts]
    z = backend.prefill([PrefillChunk(s, tuple(p), 0, True) for s, p in zip(slots, prompts)])
    rows, tokens = [z], [[] for _ in prompts]
    for _ in range(steps):
        picked = [int(i) for i in z.argmax(-1)]
        for seq, t in zip(tokens, picked):
            seq.append(t)
        z = backend.decode(slots, picked)
        rows.append(z)
    return torch.cat(rows), tokens


PROMPTS = [[1, 872, 198, 3219, 47, 9, 2025, 17, 5, 6], [44, 45, 46]]


@pytest.mark.parametrize("dtype,fraction,policy", [
    ("float32", 0.25, "lfu"), ("float32", 0.5, "lfu"), ("bfloat16", 0.25, "lfu"),
    ("float32", 0.25, "lru")])
def test_a_capped_model_computes_the_uncapped_models_logits(dtype: str, fraction: float,
                                                            policy: str) -> None:
    full = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=2, max_context=64, dtype=dtype)
    assert full.model.experts is None
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    total = 4 * 8 * 3 * 256 * 192 * size
    capped = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=2, max_context=64, dtype=dtype,
                                   expert_cache_bytes=int(total * fraction),
                                   expert_cache_policy=policy)
    want, want_tokens = _run(full, PROMPTS, 12)
    got, got_tokens = _run(capped, PROMPTS, 12)
    assert got_tokens == want_tokens
    assert torch.equal(got, want)
    cache = capped.model.experts
    assert cache is not None and cache.total_bytes == total and cache.policy == policy
    stats = cache.stats
    assert stats.misses > 0 and stats.evictions > 0           # it did run out of room
    assert stats.resident_bytes <= cache.cap_bytes
    assert capped.model_info().weight_bytes < full.model_info().weight_bytes


def test_every_expert_resident_reads_each_once() -> None:
    backend = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=2, max_context=64,
                                    dtype="float32", expert_cache_bytes=1 << 30)
    _run(backend, PROMPTS, 12)
    cache = backend.model.experts
    assert cache is not None
    assert cache.stats.evictions == 0
    assert cache.stats.misses == cache.stats.resident <= 4 * 8
    assert cache.stats.read_bytes == cache.stats.misses * ONE_EXPERT_F32


def _fused_copy(tmp_path: Path) -> Path:
    """The tiny model rewritten with fused ``experts.gate_up_proj``/``down_proj`` stacks."""
    out = tmp_path / "fused"
    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, out / name)
    tensors = load_file(str(TINY_MODEL_DIR / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".experts." not in name:
            fused[name] = t
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
            for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"]
                                               for e in range(8)])
    save_file(fused, str(out / "model.safetensors"))
    return out


def test_fused_expert_stacks_are_read_per_expert(tmp_path: Path) -> None:
    folder = _fused_copy(tmp_path)
    full = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=2, max_context=64, dtype="float32")
    capped = TorchBackend.from_dir(folder, num_slots=2, max_context=64, dtype="float32",
                                   expert_cache_bytes=3 * ONE_EXPERT_F32)
    want, _ = _run(full, PROMPTS, 8)
    got, _ = _run(capped, PROMPTS, 8)
    assert torch.equal(got, want)
    cache = capped.model.experts
    assert cache is not None and cache.stats.misses > 0 and cache.stats.evictions > 0


def test_a_mixtral_checkpoint_under_a_one_expert_cap_matches_transformers(
        tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.hf_weights import redraw

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    redraw(model)
    model.save_pretrained(tmp_path)
    one = 3 * 96 * 64 * 4
    capped = TorchBackend.from_dir(tmp_path, num_slots=1, max_context=64,
                                   expert_cache_bytes=one)     # one expert at a time
    ids = [3, 17, 99, 4, 56, 7, 8, 120]
    got = capped.prefill([PrefillChunk(capped.allocate(), tuple(ids), 0, True)])[0]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1].float()
    assert (got - want).abs().max().item() <= 1e-4
    cache = capped.model.experts
    assert cache is not None and cache.stats.resident == 1


class _Source:
    """Experts whose matrices are filled with their own number; records each read."""

    def __init__(self) -> None:
        self.reads: list[tuple[int, int]] = []

    def read(self, layer: int, expert: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append((layer, expert))
        return (torch.full((512, 192), float(expert), dtype=dtype),
                torch.full((192, 256), float(expert), dtype=dtype))


def _cache(policy: str, experts: int) -> tuple[ExpertCache, _Source]:
    source = _Source()
    cache = ExpertCache(source, TINY_SPEC, cap_bytes=experts * ONE_EXPERT_F32, policy=policy,
                        dtype=torch.float32, device=torch.device("cpu"), pack=False)
    return cache, source


def _route(cache: ExpertCache, sequence: Sequence[int]) -> None:
    for e in sequence:
        gate_up, _ = cache.matrix(0, e, GATE_UP)
        down, _ = cache.matrix(0, e, DOWN)
        assert gate_up[0, 0].item() == down[0, 0].item() == e   # the expert asked for


def test_lru_evicts_the_least_recently_routed_expert() -> None:
    cache, source = _cache("lru", 2)
    _route(cache, [0, 0, 0, 1, 2])          # 2 evicts 0 (routed longest ago)
    _route(cache, [1])
    assert cache.stats.hits == 3 and source.reads == [(0, 0), (0, 1), (0, 2)]
    _route(cache, [0])                      # 0 was evicted: read again, evicting 2
    assert source.reads[-1] == (0, 0) and cache.stats.evictions == 2
    _route(cache, [1])
    assert cache.stats.hits == 4


def test_lfu_keeps_the_most_often_routed_expert() -> None:
    cache, source = _cache("lfu", 2)
    _route(cache, [0, 0, 0, 1, 2])          # 2 evicts 1 (routed once), not 0 (three times)
    _route(cache, [0])
    assert source.reads == [(0, 0), (0, 1), (0, 2)] and cache.stats.hits == 3
    _route(cache, [1])                      # 2 (once) goes before 0 (four times)
    assert source.reads[-1] == (0, 1)
    _route(cache, [0])
    assert cache.stats.hits == 4 and cache.stats.resident == 2


def test_lfu_breaks_a_tie_by_recency() -> None:
    cache, source = _cache("lfu", 2)
    _route(cache, [0, 1, 2])                # 0 and 1 routed once each: 0 (older) goes
    _route(cache, [1])
    assert source.reads == [(0, 0), (0, 1), (0, 2)] and cache.stats.hits == 1
    _route(cache, [0])                      # read again: it was the one evicted
    assert source.reads[-1] == (0, 0)


def test_a_cap_below_one_expert_and_a_dense_model_are_refused_by_name() -> None:
    with pytest.raises(InvalidValueError, match="expert_cache_bytes.*at least one expert"):
        _cache("lfu", 0)
    with pytest.raises(InvalidValueError, match="expert_cache_policy"):
        BackendOptions(expert_cache_policy="fifo")
    with pytest.raises(InvalidValueError, match="expert_cache_bytes"):
        BackendOptions(expert_cache_bytes=0)
    dense = ModelSpec.from_hf_config({**read_config(TINY_MODEL_DIR),
                                      "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(InvalidValueError, match="mixture-of-experts"):
        ExpertCache(_Source(), dense, cap_bytes=1 << 20, dtype=torch.float32,
                    device=torch.device("cpu"))


def test_a_fused_kernel_refuses_tiers() -> None:
    def other_moe(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("not reached")

    with pytest.raises(InvalidValueError, match="torch experts path"):
        TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=1, max_context=64, moe=other_moe,
                              expert_cache_bytes=1 << 20)


def test_the_cli_reads_sizes_and_refuses_nonsense() -> None:
    import argparse

    from transports.cli.run import byte_size

    assert byte_size("512MiB") == 512 << 20
    assert byte_size("2GB") == 2 * 10**9
    assert byte_size("1.5 GiB") == 3 << 29
    assert byte_size("4096") == 4096
    for bad in ("", "lots", "-3", "0", "12XB"):
        with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
            byte_size(bad)


def test_a_gguf_files_quantized_expert_stacks_are_read_per_expert(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from backends.gguf.backend import hf_config
    from backends.gguf.load import GGUFExperts, load_weights
    from backends.torch.model import Transformer
    from pipeline.gguf_file import GGUFFile
    from tests.test_gguf_model import _tiny_as_gguf

    path = _tiny_as_gguf(tmp_path / "tiny.gguf", expert_qtype=gguf.GGMLQuantizationType.Q8_0)
    f = GGUFFile.open(path)
    spec = ModelSpec.from_hf_config(hf_config(f))

    def backend(tiered: bool) -> TorchBackend:
        loaded = load_weights(f, spec, mapped_experts=tiered)
        cache = (ExpertCache(GGUFExperts(f, spec), spec, cap_bytes=3 * ONE_EXPERT_F32,
                             dtype=torch.float32, device=torch.device("cpu"))
                 if tiered else None)
        return TorchBackend(Transformer(spec, loaded.weights, experts=cache), "x",
                            num_slots=2, max_context=64)

    want, _ = _run(backend(False), PROMPTS, 6)
    capped = backend(True)
    got, _ = _run(capped, PROMPTS, 6)
    assert torch.equal(got, want)
    cache = capped.model.experts
    assert cache is not None and cache.stats.misses > 0 and cache.stats.evictions > 0


def test_build_with_an_expert_cap_generates_the_same_text() -> None:
    from pipeline import build

    opts = dict(num_slots=1, max_context=128, dtype="float32")
    plain = build(TINY_MODEL_DIR, options=BackendOptions(**opts))
    capped = build(TINY_MODEL_DIR, options=BackendOptions(**opts,
                                                          expert_cache_bytes=4 * ONE_EXPERT_F32,
                                                          expert_cache_policy="lru"))
    try:
        a = plain.generate("Once upon a time", max_tokens=16, temperature=0)
        b = capped.generate("Once upon a time", max_tokens=16, temperature=0)
        assert a.token_ids == b.token_ids and a.text == b.text
        cache = capped.engine.backend.model.experts  # type: ignore[union-attr]
        assert cache is not None and cache.policy == "lru"     # the options reached it
        assert cache.stats.evictions > 0 and cache.cap_bytes == 4 * ONE_EXPERT_F32
        assert plain.engine.backend.model.experts is None  # type: ignore[union-attr]
    finally:
        plain.close()
        capped.close()


def test_the_config_lists_the_tiny_model_as_moe() -> None:
    # the tests above rely on the shipped model having 4 MoE layers of 8 experts
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert TINY_SPEC.moe is not None and TINY_SPEC.moe_layers == (0, 1, 2, 3)
    assert config["num_experts"] == 8 and config["moe_intermediate_size"] == 256


def test_the_command_line_and_the_server_take_the_expert_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    import transports.http
    from transports import cli
    from transports.http import ServerConfig
    from transports.http.accounting import logs
    from transports.cli.run import add_backend, backend_options

    parser = argparse.ArgumentParser()
    add_backend(parser)
    opts = backend_options(parser.parse_args(["--expert-cache", "64MiB",
                                              "--expert-cache-policy", "lru"]))
    assert (opts.expert_cache_bytes, opts.expert_cache_policy) == (64 << 20, "lru")
    assert backend_options(parser.parse_args([])).expert_cache_bytes is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-cache-policy", "fifo"])
    served: list[ServerConfig] = []
    monkeypatch.setattr(transports.http, "serve", lambda config, *_: served.append(config))
    monkeypatch.setattr(logs, "configure", lambda level: None)
    assert cli.main(["serve", "--model", "tiny", "--port", "1", "--expert-cache", "1GiB",
                     "--engine-process"]) == 0
    assert served[0].backend_options().expert_cache_bytes == 1 << 30
    assert served[0].engine_process and served[0].expert_cache_policy == "lfu"
    with pytest.raises(InvalidValueError, match="expert_cache_policy"):
        ServerConfig(models={"default": None}, expert_cache_policy="mru")


def test_float8_experts_are_read_and_an_unreadable_dtype_fails_the_load(tmp_path: Path) -> None:
    from pipeline.errors import ArtifactError

    tensors = load_file(str(TINY_MODEL_DIR / "model.safetensors"))
    for kind, dtype in (("f8", torch.float8_e4m3fn), ("i32", torch.int32)):
        folder = tmp_path / kind
        folder.mkdir()
        shutil.copy(TINY_MODEL_DIR / "config.json", folder / "config.json")
        save_file({n: (t.to(dtype) if ".experts." in n else t) for n, t in tensors.items()},
                  str(folder / "model.safetensors"))
        if kind == "i32":  # refused when the model loads, not at its first request
            with pytest.raises(ArtifactError, match="I32, which expert tiers do not read"):
                TorchBackend.from_dir(folder, num_slots=2, max_context=64, dtype="float32",
                                      expert_cache_bytes=3 * ONE_EXPERT_F32)
            continue
        full = TorchBackend.from_dir(folder, num_slots=2, max_context=64, dtype="float32")
        capped = TorchBackend.from_dir(folder, num_slots=2, max_context=64, dtype="float32",
                                       expert_cache_bytes=3 * ONE_EXPERT_F32)
        assert torch.equal(_run(capped, PROMPTS, 4)[0], _run(full, PROMPTS, 4)[0])
        assert capped.model.experts is not None and capped.model.experts.stats.misses > 0
