"""The torch reference backend against transformers (the oracle) on tiny random checkpoints.

Each architecture gets a tiny model built by transformers from a config, saved with
``save_pretrained`` (safetensors) and loaded by ``TorchBackend.from_dir``. Weights are
re-drawn at a scale where attention, routing and logits are far from uniform, so agreement is
not an accident of near-zero activations.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from backends.torch.backend import TorchBackend
from backends.torch.config import ModelSpec
from backends.torch.moe import RoutingSpec, moe_forward
from pipeline.errors import ArtifactError, CapacityError, InvalidValueError, SlotError
from pipeline.contracts.model import Attention, Backend, ModelCall, PagedBackend, PrefillChunk
from pipeline.testing import ScriptedBackend, peaked
from tests.hf_weights import redraw

transformers = pytest.importorskip("transformers")

VOCAB = 128
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "llama3-rope-tied-bias": lambda: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen2-sliding-linear-rope": lambda: transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **COMMON, head_dim=16,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64}),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, **MOE, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **MOE, norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    torch.manual_seed(0)
    out = {}
    for name, make in CONFIGS.items():
        model = transformers.AutoModelForCausalLM.from_config(make()).eval()
        redraw(model)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        model.generation_config.eos_token_id = None  # never stop early in generate
        model.generation_config.pad_token_id = 0
        out[name] = (folder, model)
    return out


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _ref_last_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model(torch.tensor([list(ids)])).logits[0, -1]
    return logits.float()


def _greedy(backend: Backend, slot: int, prompt: Sequence[int], n: int) -> list[int]:
    z = backend.prefill([PrefillChunk(slot, tuple(prompt), 0, True)])[0]
    assert backend.cache_length(slot) == len(prompt)
    out = []
    for _ in range(n):
        out.append(int(z.argmax()))
        z = backend.decode([slot], [out[-1]])[0]
        assert backend.cache_length(slot) == len(prompt) + len(out)
    return out


ARCHS = list(CONFIGS)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(arch: str, checkpoints: dict[str, Any]) -> None:
    folder, ref = checkpoints[arch]
    backend = TorchBackend.from_dir(folder, num_slots=3, max_context=64)
    prompts = [_prompt(n, seed) for seed, n in enumerate((1, 7, 20))]
    chunks = [PrefillChunk(backend.allocate(), p, 0, True) for p in prompts]
    logits = backend.prefill(chunks)
    assert logits.dtype == torch.float32 and logits.shape == (3, VOCAB)
    for row, p in zip(logits, prompts):
        assert (row - _ref_last_logits(ref, p)).abs().max().item() <= 1e-4
    assert [backend.cache_length(c.slot) for c in chunks] == [1, 7, 20]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_generate(arch: str, checkpoints: dict[str, Any]) -> None:
    folder, ref = checkpoints[arch]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
    prompt = _prompt(9, 42)
    with torch.no_grad():
        expected = ref.generate(torch.tensor([list(prompt)]), do_sample=False,
                                max_new_tokens=32)[0, len(prompt):].tolist()
    assert _greedy(backend, backend.allocate(), prompt, 32) == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_batch_equals_solo_runs(arch: str, checkpoints: dict[str, Any]) -> None:
    folder, _ = checkpoints[arch]
    prompts = [_prompt(n, 100 + n) for n in (3, 11, 1, 8)]
    solo = []
    for p in prompts:
        b = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
        solo.append(_greedy(b, b.allocate(), p, 6))
    backend = TorchBackend.from_dir(folder, num_slots=4, max_context=64)
    slots = [backend.allocate() for _ in prompts]
    z = backend.prefill([PrefillChunk(s, p, 0, True) for s, p in zip(slots, prompts)])
    batched: list[list[int]] = [[] for _ in prompts]
    for _ in range(6):
        for out, row in zip(batched, z):
            out.append(int(row.argmax()))
        z = backend.decode(slots, [out[-1] for out in batched])
    assert batched == solo
    assert [backend.cache_length(s) for s in slots] == [len(p) + 6 for p in prompts]


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_one_shot(arch: str, checkpoints: dict[str, Any]) -> None:
    folder, _ = checkpoints[arch]
    prompt = _prompt(23, 7)
    backend = TorchBackend.from_dir(folder, num_slots=2, max_context=64)
    whole, chunked = backend.allocate(), backend.allocate()
    z_whole = backend.prefill([PrefillChunk(whole, prompt, 0, True)])[0]
    cuts = [0, 5, 6, 14, 23]
    for a, b in zip(cuts, cuts[1:]):
        z = backend.prefill([PrefillChunk(chunked, prompt[a:b], a, b == len(prompt))])[0]
        assert backend.cache_length(chunked) == b
    assert (z - z_whole).abs().max().item() <= 1e-5
    nxt = int(z_whole.argmax())
    z2 = backend.decode([whole, chunked], [nxt, nxt])
    assert (z2[0] - z2[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama3-rope-tied-bias", "qwen2-moe", "mixtral"])
def test_half_precision_prefill_close_to_transformers(arch: str, dtype: str,
                                                      checkpoints: dict[str, Any]) -> None:
    """On CPU the two agree bit for bit in bfloat16 today; the bound leaves room for other
    kernels (and float16's narrower range)."""
    folder, _ = checkpoints[arch]
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, dtype)).eval()
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=32, dtype=dtype)
    assert backend.model.dtype == getattr(torch, dtype)
    prompt = _prompt(15, 11)
    z = backend.prefill([PrefillChunk(backend.allocate(), prompt, 0, True)])[0]
    assert z.dtype == torch.float32
    assert (z - _ref_last_logits(ref, prompt)).abs().max().item() <= 3e-2


def test_chunk_and_new_prompt_in_one_call(checkpoints: dict[str, Any]) -> None:
    """A later chunk of one prompt and the first chunk of another share one prefill call."""
    folder, ref = checkpoints["qwen3-moe"]
    backend = TorchBackend.from_dir(folder, num_slots=2, max_context=64)
    a, b = backend.allocate(), backend.allocate()
    pa, pb = _prompt(12, 1), _prompt(5, 2)
    backend.prefill([PrefillChunk(a, pa[:7], 0, False)])
    z = backend.prefill([PrefillChunk(a, pa[7:], 7, True), PrefillChunk(b, pb, 0, True)])
    assert (z[0] - _ref_last_logits(ref, pa)).abs().max().item() <= 1e-4
    assert (z[1] - _ref_last_logits(ref, pb)).abs().max().item() <= 1e-4


# --- Backend.forward: one call shape for chunks, decode, verification, blocks -------------


def _ref_logits(model: Any, ids: Sequence[int], mask: torch.Tensor | None = None
                ) -> torch.Tensor:
    """transformers' logits ``[L, V]`` at every position of ``ids``."""
    with torch.no_grad():
        kwargs = {} if mask is None else {"attention_mask": mask}
        logits: torch.Tensor = model(torch.tensor([list(ids)]), **kwargs).logits[0]
    return logits.float()


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen2-sliding-linear-rope"])
def test_one_forward_mixes_chunks_decode_and_verification(arch: str,
                                                          checkpoints: dict[str, Any]) -> None:
    """A decode token with three drafts (logits at all four), a later prompt chunk and a
    new prompt in one forward: every wanted row equals transformers' logits at that position."""
    folder, ref = checkpoints[arch]
    backend = TorchBackend.from_dir(folder, num_slots=3, max_context=64)
    a, b, c = backend.allocate(), backend.allocate(), backend.allocate()
    pa, pb, pc = _prompt(9, 1), _prompt(12, 2), _prompt(5, 3)
    backend.forward([ModelCall(a, pa, 0, (8,)), ModelCall(b, pb[:7], 0, ())])
    verify = _prompt(4, 4)
    z = backend.forward([ModelCall(a, verify, 9, (0, 1, 2, 3)),
                         ModelCall(b, pb[7:], 7, (4,)), ModelCall(c, pc, 0, (2, 4))])
    assert z.shape == (4 + 1 + 2, VOCAB)
    want_a = _ref_logits(ref, pa + verify)[9:13]
    assert (z[:4] - want_a).abs().max().item() <= 1e-4
    assert (z[4] - _ref_logits(ref, pb)[-1]).abs().max().item() <= 1e-4
    assert (z[5:] - _ref_logits(ref, pc)[[2, 4]]).abs().max().item() <= 1e-4
    assert [backend.cache_length(s) for s in (a, b, c)] == [13, 12, 5]


def test_truncate_rolls_back_rejected_drafts(checkpoints: dict[str, Any]) -> None:
    """Verify four drafts, keep two, continue: as if the rejected ones never ran."""
    folder, ref = checkpoints["qwen3-moe"]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
    slot = backend.allocate()
    prompt, drafts = _prompt(10, 5), _prompt(4, 6)
    backend.forward([ModelCall(slot, prompt, 0, (9,)), ])
    backend.forward([ModelCall(slot, drafts, 10, (0, 1, 2, 3))])
    backend.truncate(slot, 12)
    assert backend.cache_length(slot) == 12
    assert backend.cache_layout(slot).key_lengths == (12, 12)
    nxt = (7,)
    z = backend.forward([ModelCall(slot, nxt, 12, (0,))])[0]
    assert (z - _ref_logits(ref, prompt + drafts[:2] + nxt)[-1]).abs().max().item() <= 1e-4
    with pytest.raises(SlotError, match="truncate"):
        backend.truncate(slot, 14)


def test_a_call_that_does_not_write_leaves_the_cache_as_it_was(checkpoints: dict[str, Any]) -> None:
    folder, ref = checkpoints["llama"]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
    slot = backend.allocate()
    prompt = _prompt(8, 7)
    backend.forward([ModelCall(slot, prompt, 0, ())])
    peek = backend.forward([ModelCall(slot, (3, 4), 8, (1,), write=False)])[0]
    assert backend.cache_length(slot) == 8
    assert (peek - _ref_logits(ref, prompt + (3, 4))[-1]).abs().max().item() <= 1e-4
    z = backend.forward([ModelCall(slot, (5,), 8, (0,))])[0]
    assert (z - _ref_logits(ref, prompt + (5,))[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_block_attention_matches_transformers_with_the_same_mask(
        arch: str, checkpoints: dict[str, Any]) -> None:
    """A bidirectional block over a causal prefix, against transformers given the same
    attention pattern as an explicit 4-D mask (0 = attend, -inf = not)."""
    folder, ref = checkpoints[arch]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
    slot = backend.allocate()
    prefix, block = _prompt(6, 8), _prompt(5, 9)
    backend.forward([ModelCall(slot, prefix, 0, ())])
    z = backend.forward([ModelCall(slot, block, 6, tuple(range(5)), Attention.BLOCK,
                                   write=False)])
    n = 11
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed[6:, 6:] = True
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    want = _ref_logits(ref, prefix + block, mask)[6:]
    assert (z - want).abs().max().item() <= 1e-4
    causal = _ref_logits(ref, prefix + block)[6:]
    assert (z[:4] - causal[:4]).abs().max().item() > 1e-2  # the block really saw ahead
    assert backend.cache_length(slot) == 6


def test_forward_rejects_bad_output_offsets(checkpoints: dict[str, Any]) -> None:
    folder, _ = checkpoints["llama"]
    backend = TorchBackend.from_dir(folder, num_slots=1, max_context=64)
    slot = backend.allocate()
    for outputs in [(3,), (1, 0), (0, 0)]:
        with pytest.raises(SlotError, match="output offsets"):
            backend.forward([ModelCall(slot, (1, 2, 3), 0, outputs)])
        assert backend.cache_length(slot) == 0


# --- the MoE function against a naive per-token reference ---------------------------------


def _naive_moe(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in top) if renormalize else 1.0
        for e in top:
            g, u = gate_up[e, :inter] @ x[t], gate_up[e, inter:] @ x[t]
            out[t] += float(probs[e]) / total * (down[e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("hidden,inter", [(64, 32), (6, 5)])
@pytest.mark.parametrize("routing", [RoutingSpec(renormalize=False),
                                     RoutingSpec(renormalize=True, weights_in_float32=True)])
def test_moe_forward_matches_naive_reference(hidden: int, inter: int,
                                             routing: RoutingSpec) -> None:
    gen = torch.Generator().manual_seed(3)
    t, e, k = 37, 8, 2
    x = torch.randn(t, hidden, generator=gen)
    logits = torch.randn(t, e, generator=gen) * 2
    gate_up = torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5
    got = moe_forward(x, logits, gate_up, down, top_k=k, routing=routing)
    want = _naive_moe(x, logits, gate_up, down, k, routing.renormalize)
    assert (got - want).abs().max().item() <= 1e-5


def test_moe_forward_matches_transformers_block() -> None:
    cfg = transformers.Qwen3MoeConfig(**COMMON, **MOE, norm_topk_prob=True)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(cfg)
    redraw(block)
    x = torch.randn(1, 19, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = block(x)[0]
        got = moe_forward(x[0], x[0] @ block.gate.weight.T, block.experts.gate_up_proj,
                          block.experts.down_proj, top_k=2, routing=RoutingSpec(True))
    assert (got - want).abs().max().item() <= 1e-5


# --- loading: layouts, snapshot, and every way a folder can be broken ---------------------


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _rewrite(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_fused_expert_layout_loads_the_same(checkpoints: dict[str, Any],
                                            tmp_path: Path) -> None:
    for arch, (g, u, d) in {"qwen3-moe": ("gate_proj", "up_proj", "down_proj"),
                            "mixtral": ("w1", "w3", "w2")}.items():
        src, ref = checkpoints[arch]
        folder = _copy(src, tmp_path / arch)

        def fuse(t: dict[str, torch.Tensor]) -> None:
            prefix = "mlp" if arch == "qwen3-moe" else "block_sparse_moe"
            for layer in range(2):
                p = f"model.layers.{layer}.{prefix}.experts"
                n = sum(1 for k in t if k.startswith(f"{p}.") and k.endswith(f".{g}.weight"))
                t[f"{p}.gate_up_proj"] = torch.stack([torch.cat(
                    [t.pop(f"{p}.{j}.{g}.weight"), t.pop(f"{p}.{j}.{u}.weight")])
                    for j in range(n)])
                t[f"{p}.down_proj"] = torch.stack([t.pop(f"{p}.{j}.{d}.weight")
                                                   for j in range(n)])

        _rewrite(folder, fuse)
        backend = TorchBackend.from_dir(folder, num_slots=1, max_context=32)
        prompt = _prompt(10, 9)
        z = backend.prefill([PrefillChunk(backend.allocate(), prompt, 0, True)])[0]
        assert (z - _ref_last_logits(ref, prompt)).abs().max().item() <= 1e-4


def test_sharded_checkpoint_and_snapshot(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    src, ref = checkpoints["qwen2-moe"]
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    one = TorchBackend.from_dir(src, num_slots=1, max_context=32)
    sharded = TorchBackend.from_dir(tmp_path / "sharded", num_slots=1, max_context=32)
    renamed = TorchBackend.from_dir(_copy(src, tmp_path / "other-name"), num_slots=1,
                                    max_context=32)
    assert one.snapshot == renamed.snapshot and one.snapshot.startswith("sha256:")
    prompt = _prompt(6, 3)
    z1 = one.prefill([PrefillChunk(one.allocate(), prompt, 0, True)])
    z2 = sharded.prefill([PrefillChunk(sharded.allocate(), prompt, 0, True)])
    assert torch.equal(z1, z2)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ArtifactError, match=shards[-1].name):
        TorchBackend.from_dir(tmp_path / "sharded")


def test_unknown_architecture_is_named(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="GPT2LMHeadModel"):
        ModelSpec.from_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    folder = _copy(checkpoints["llama"][0], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ArtifactError, match="FalconForCausalLM"):
        TorchBackend.from_dir(folder)


@pytest.mark.parametrize("edit,key", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
])
def test_unsupported_config_features_raise(edit: dict[str, Any], key: str,
                                           checkpoints: dict[str, Any]) -> None:
    cfg = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    with pytest.raises(ArtifactError, match=key):
        ModelSpec.from_hf_config({**cfg, **edit})


def test_missing_tensor_is_named(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    folder = _copy(checkpoints["qwen3-yarn"][0], tmp_path / "m")
    _rewrite(folder, lambda t: t.__delitem__("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ArtifactError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        TorchBackend.from_dir(folder)


def test_wrong_shape_names_file_and_tensor(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    folder = _copy(checkpoints["mixtral"][0], tmp_path / "m")
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    _rewrite(folder, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(ArtifactError, match=rf"model\.safetensors: tensor '{name}' has shape"):
        TorchBackend.from_dir(folder)


def test_unexpected_tensor_is_an_error(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    folder = _copy(checkpoints["llama"][0], tmp_path / "m")
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias",
                                             torch.zeros(64)))
    with pytest.raises(ArtifactError, match="q_proj.bias"):
        TorchBackend.from_dir(folder)


def test_truncated_file_and_missing_weights(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    folder = _copy(checkpoints["llama"][0], tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ArtifactError, match="model.safetensors"):
        TorchBackend.from_dir(folder)
    path.unlink()
    with pytest.raises(ArtifactError, match="model.safetensors"):
        TorchBackend.from_dir(folder)


# --- the Backend contract ------------------------------------------------------------------


def test_slot_errors_leave_caches_intact(checkpoints: dict[str, Any]) -> None:
    backend = TorchBackend.from_dir(checkpoints["qwen2"][0], num_slots=2, max_context=16)
    a, b = backend.allocate(), backend.allocate()
    with pytest.raises(CapacityError):
        backend.allocate()
    backend.prefill([PrefillChunk(a, (1, 2, 3), 0, True)])
    with pytest.raises(SlotError) as info:   # b's chunk claims a wrong start
        backend.prefill([PrefillChunk(a, (4,), 3, True), PrefillChunk(b, (5,), 2, True)])
    assert info.value.slots == (b,)
    with pytest.raises(SlotError):            # would outgrow max_context
        backend.prefill([PrefillChunk(b, tuple(range(17)), 0, True)])
    with pytest.raises(SlotError):            # token outside the vocabulary
        backend.decode([a], [VOCAB])
    assert (backend.cache_length(a), backend.cache_length(b)) == (3, 0)
    backend.release(a)
    with pytest.raises(SlotError):
        backend.decode([a], [1])
    assert backend.allocate() == a and backend.cache_length(a) == 0


def test_loading_draws_a_progress_bar_by_bytes(checkpoints: dict[str, Any],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from backends.torch.loader import load_checkpoint

    folder = checkpoints["llama3-rope-tied-bias"][0]   # a tied head: lm_head is never read
    stream = io.StringIO()
    load_checkpoint(folder, progress=stream)
    frames = stream.getvalue().split("\r")
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert frames[-1].startswith("Loading weights [" + "#" * 30 + "] 100%")
    assert frames[-1].endswith("\n")
    # the bar counts tensor bytes: the files' sizes less their JSON headers
    shown_total = float(frames[-1].split("/")[1].split()[0])
    assert abs(shown_total - total / 1e9) < 0.01
    capsys.readouterr()
    load_checkpoint(folder, progress=True)       # forced onto standard error
    assert "100%" in capsys.readouterr().err
    load_checkpoint(folder)                      # standard error is not a terminal here
    load_checkpoint(folder, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", [RoutingSpec(renormalize=True),
                                     RoutingSpec(renormalize=True, weights_in_float32=True)])
def test_one_token_path_equals_the_grouped_path(dtype: torch.dtype, routing: RoutingSpec) -> None:
    """A batch-1 decode token skips the sort/gather/scatter; it agrees with its row of a larger
    call and with the naive reference (bit for bit is not promised: BLAS picks other kernels
    for one row than for several)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    logits = torch.randn(5, 8, generator=gen).to(dtype) * 2
    gate_up = (torch.randn(8, 64, 64, generator=gen) / 8).to(dtype)
    down = (torch.randn(8, 64, 32, generator=gen) / 6).to(dtype)
    together = moe_forward(x, logits, gate_up, down, top_k=3, routing=routing)
    for t in range(5):
        alone = moe_forward(x[t:t + 1], logits[t:t + 1], gate_up, down, top_k=3, routing=routing)
        torch.testing.assert_close(alone[0], together[t], atol=1e-5, rtol=0)
        want = _naive_moe(x[t:t + 1].double(), logits[t:t + 1].double(), gate_up.double(),
                          down.double(), 3, routing.renormalize)
        tol = 1e-5 if dtype == torch.float32 else 0.05
        assert (alone.double() - want).abs().max().item() <= tol


@pytest.mark.parametrize("arch", ["qwen2-moe", "llama"])
def test_packed_weights_agree_with_plain_linear(arch: str, checkpoints: dict[str, Any]) -> None:
    """oneDNN-packed float32 weights (the default on CPU) against plain F.linear, prefill and a
    ragged decode; the transformers parity tests above run packed too."""
    from backends.torch.packed import packing_available

    folder = checkpoints[arch][0]
    packed = TorchBackend.from_dir(folder, num_slots=2, max_context=32)
    plain = TorchBackend.from_dir(folder, num_slots=2, max_context=32, pack=False)
    if not packing_available(packed.model.weights.embed):
        pytest.skip("this torch has no oneDNN weight packing")
    assert len(packed.model.linears) > 0 and len(plain.model.linears) == 0
    outs = []
    for backend in (packed, plain):
        a, b = backend.allocate(), backend.allocate()
        z = backend.prefill([PrefillChunk(a, _prompt(9, 1), 0, True),
                             PrefillChunk(b, _prompt(4, 2), 0, True)])
        outs.append(torch.cat([z, backend.decode([a, b], [3, 5])]))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_cache_layout_reports_each_layer_and_a_failed_call_changes_nothing(
        checkpoints: dict[str, Any]) -> None:
    """Invariant 2 from the backend's own bookkeeping: every layer's keys and values cover the
    slot's length after prefill, chunked prefill and decode; a forward that fails after some
    layers wrote leaves every layer's extent (and the length) as it was."""
    from backends.torch.loader import load_checkpoint
    from backends.torch.model import Transformer

    ckpt = load_checkpoint(checkpoints["qwen3-moe"][0])
    fail = {"on": False}

    def moe(*args: Any, **kwargs: Any) -> torch.Tensor:
        if fail["on"]:
            raise RuntimeError("injected failure after layer 0's attention wrote its cache")
        return moe_forward(*args, **kwargs)

    backend = TorchBackend(Transformer(ckpt.spec, ckpt.weights, moe=moe), ckpt.snapshot,
                           num_slots=2, max_context=32)
    layers = ckpt.spec.num_layers
    a, b = backend.allocate(), backend.allocate()
    backend.prefill([PrefillChunk(a, _prompt(7, 1), 0, True), PrefillChunk(b, _prompt(3, 2), 0, False)])
    backend.prefill([PrefillChunk(b, _prompt(4, 3), 3, True)])
    backend.decode([a, b], [5, 6])
    for slot, n in ((a, 8), (b, 8)):
        layout = backend.cache_layout(slot)
        assert layout.key_lengths == layout.value_lengths == (n,) * layers
    fail["on"] = True
    with pytest.raises(RuntimeError, match="injected"):
        backend.decode([a], [7])
    fail["on"] = False
    assert backend.cache_length(a) == 8
    assert backend.cache_layout(a).key_lengths == (8,) * layers
    backend.decode([b], [7])                  # the failed call's writes are not committed now
    assert backend.cache_layout(a).key_lengths == (8,) * layers
    assert backend.cache_layout(b).key_lengths == (9,) * layers
    backend.release(a)
    assert backend.allocate() == a and backend.cache_layout(a).key_lengths == (0,) * layers


@pytest.mark.parametrize("arch", ARCHS)
def test_model_info_counts_what_transformers_counts(arch: str,
                                                    checkpoints: dict[str, Any]) -> None:
    """Parameters as transformers counts them (a tied head once), the weights' bytes at the
    loaded dtype, packed copies only where packing happened, and the KV pool's bytes from the
    config's shape."""
    from pipeline.contracts.model import ModelDescriber

    folder, model = checkpoints[arch]
    config = model.config
    want = model.num_parameters()
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or head_dim
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        backend = TorchBackend.from_dir(folder, num_slots=3, max_context=40, dtype=dtype)
        assert isinstance(backend, ModelDescriber)
        info = backend.model_info()
        assert (info.architecture, info.dtype, info.device) == (
            config.architectures[0], dtype, "cpu")
        assert info.parameters == want
        assert info.weight_bytes == want * size
        packed = len(backend.model.linears) > 0
        assert (info.packed_bytes > 0) == packed and info.packed_bytes <= info.weight_bytes
        positions = 3 * -(-40 // 16) * 16     # the pool: three windows in whole blocks of 16
        assert info.cache_bytes == (2 * config.num_hidden_layers * positions * kv_heads
                                    * head_dim * size)


# --- the paged KV cache: block tables as given, shared prefixes, rollback -----------------


def _paged(folder: Path, num_blocks: int = 48, block_size: int = 4, **kw: Any) -> TorchBackend:
    return TorchBackend.from_dir(folder, num_slots=4, max_context=64, kv_blocks=num_blocks,
                                 block_size=block_size, **kw)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe", "qwen2-sliding-linear-rope"])
def test_scattered_block_table_matches_transformers(arch: str,
                                                    checkpoints: dict[str, Any]) -> None:
    """A table whose blocks lie out of order all over the pool, filled by a chunked prefill and
    decode steps (with a window of 6 the sliding layer cuts in), gives transformers' logits at
    every step; the same calls over a contiguous table give the same logits bit for bit."""
    folder, ref = checkpoints[arch]
    prompt, steps = _prompt(13, 21), _prompt(10, 22)
    seq = prompt + steps
    want = _ref_logits(ref, seq)
    runs = []
    for table in [(40, 3, 17, 9, 31, 0, 22), tuple(range(10, 17))]:
        backend = _paged(folder)
        slot = backend.allocate()
        got = [backend.forward([ModelCall(slot, prompt[:5], 0, (), blocks=table[:2])]),
               backend.forward([ModelCall(slot, prompt[5:], 5, (7,), blocks=table[:4])])]
        for i, t in enumerate(steps):
            n = len(prompt) + i
            got.append(backend.forward([ModelCall(slot, (t,), n, (0,),
                                                  blocks=table[:-(-(n + 1) // 4)])]))
            assert backend.cache_length(slot) == n + 1
        logits = torch.cat(got)
        assert _close(logits, want[len(prompt) - 1:]) <= 1e-4
        runs.append(logits)
    assert torch.equal(runs[0], runs[1])


def test_a_batch_mixing_viewed_and_gathered_tables_matches_transformers(
        checkpoints: dict[str, Any]) -> None:
    """Three sequences whose blocks interleave (each gathered, from one gather per layer)
    and one whose blocks are a run (a view) prefill and decode in the same calls."""
    folder, ref = checkpoints["qwen2"]
    backend = _paged(folder)
    tables = [tuple(range(i, 24, 3)) for i in range(3)] + [tuple(range(30, 38))]
    slots = [backend.allocate() for _ in tables]
    seqs = [list(_prompt(n, 50 + n)) for n in (9, 2, 14, 5)]
    z = backend.forward([ModelCall(s, tuple(p), 0, (len(p) - 1,), blocks=t)
                         for s, p, t in zip(slots, seqs, tables)])
    for _ in range(5):
        for p, row in zip(seqs, z):
            assert _close(row, _ref_logits(ref, p)[-1]) <= 1e-4
            p.append(int(row.argmax()))
        z = backend.forward([ModelCall(s, (p[-1],), len(p) - 1, (0,), blocks=t)
                             for s, p, t in zip(slots, seqs, tables)])


def test_sequences_sharing_prefix_blocks_each_continue_correctly(
        checkpoints: dict[str, Any]) -> None:
    """B reuses A's first three blocks (the same physical blocks, two references each) and
    computes only the rest of its prompt; both then decode in one batch, and both match
    transformers on their own sequences."""
    from pipeline.engine.blocks import BlockManager

    folder, ref = checkpoints["qwen3-moe"]
    backend = _paged(folder, num_blocks=20)
    kv = BlockManager(backend.num_blocks, backend.block_size, snapshot=backend.snapshot)
    pa = _prompt(14, 31)
    pb = pa[:12] + _prompt(3, 32)
    a, b = backend.allocate(), backend.allocate()
    za = backend.forward([ModelCall(a, pa, 0, (13,), blocks=kv.allocate(a, len(pa)))])[0]
    kv.publish(a, pa)
    hit = kv.match(pb)
    assert hit.cached_tokens == 12
    table_b = kv.allocate(b, len(pb), prefix=hit)
    assert table_b[:3] == kv.table(a)[:3] and kv.stats.used_blocks == 4 + 1
    zb = backend.forward([ModelCall(b, pb[12:], 12, (2,), blocks=table_b)])[0]
    assert backend.cache_length(b) == len(pb)
    assert _close(za, _ref_logits(ref, pa)[-1]) <= 1e-4
    assert _close(zb, _ref_logits(ref, pb)[-1]) <= 1e-4
    seqs = {a: list(pa), b: list(pb)}
    z = {a: za, b: zb}
    for _ in range(6):
        calls = []
        for s in (a, b):
            seqs[s].append(int(z[s].argmax()))
            calls.append(ModelCall(s, (seqs[s][-1],), len(seqs[s]) - 1, (0,),
                                   blocks=kv.grow(s, len(seqs[s]))))
        out = backend.forward(calls)
        z = {a: out[0], b: out[1]}
        kv.check()
    for s in (a, b):
        assert _close(z[s], _ref_logits(ref, seqs[s])[-1]) <= 1e-4


def test_truncate_across_a_block_boundary_then_continue(checkpoints: dict[str, Any]) -> None:
    """Verify six drafts after a 10-token prompt (blocks of 4: into a fourth block), keep one:
    the manager frees the trailing block, the backend shortens the slot, and the next token
    is computed as if the rejected drafts never ran, in the freed block's place too."""
    from pipeline.engine.blocks import BlockManager

    folder, ref = checkpoints["qwen3-moe"]
    for paged in (True, False):
        backend = _paged(folder, num_blocks=32)
        kv = BlockManager(backend.num_blocks, backend.block_size, snapshot=backend.snapshot)
        slot = backend.allocate()
        prompt, drafts = _prompt(10, 41), _prompt(6, 42)

        def call(ids: tuple[int, ...], start: int, outputs: tuple[int, ...]) -> ModelCall:
            blocks = kv.grow(slot, start + len(ids)) if paged else None
            return ModelCall(slot, ids, start, outputs, blocks=blocks)

        if paged:
            kv.allocate(slot, 0)
        backend.forward([call(prompt, 0, (9,))])
        backend.forward([call(drafts, 10, tuple(range(6)))])
        backend.truncate(slot, 11)
        if paged:
            kv.truncate(slot, 11)
            assert len(kv.table(slot)) == 3 and kv.stats.used_blocks == 3
        assert backend.cache_layout(slot).key_lengths == (11, 11)
        nxt = _prompt(6, 43)                  # refills block 2 and a fresh fourth block
        z = backend.forward([call(nxt, 11, (5,))])[0]
        assert _close(z, _ref_logits(ref, prompt + drafts[:1] + nxt)[-1]) <= 1e-4


def test_paged_block_attention_and_a_peek_that_does_not_write(
        checkpoints: dict[str, Any]) -> None:
    """A bidirectional block and a non-writing call over scattered blocks: the peek needs
    blocks only for the positions it reads, and writes none."""
    folder, ref = checkpoints["llama"]
    backend = _paged(folder)
    slot = backend.allocate()
    prefix, block = _prompt(6, 8), _prompt(5, 9)
    backend.forward([ModelCall(slot, prefix, 0, (), blocks=(7, 2))])
    z = backend.forward([ModelCall(slot, block, 6, tuple(range(5)), Attention.BLOCK,
                                   write=False, blocks=(7, 2))])
    n = 11
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    allowed[6:, 6:] = True
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    assert _close(z, _ref_logits(ref, prefix + block, mask)[6:]) <= 1e-4
    assert backend.cache_length(slot) == 6
    before = [t.clone() for t in backend.cache.k]
    z = backend.forward([ModelCall(slot, (3, 4), 6, (1,), write=False, blocks=(7, 2))])[0]
    assert _close(z, _ref_logits(ref, prefix + (3, 4))[-1]) <= 1e-4
    # bit for bit: the pool is uninitialised, and garbage may read as NaN (NaN != NaN)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32))
               for x, y in zip(before, backend.cache.k))


def test_malformed_block_tables_are_named_and_change_nothing(
        checkpoints: dict[str, Any]) -> None:
    folder, _ = checkpoints["llama"]
    backend = _paged(folder, num_blocks=16)
    a, b = backend.allocate(), backend.allocate()
    backend.forward([ModelCall(a, (1, 2, 3, 4, 5), 0, (), blocks=(0, 1))])
    cases = [
        ([ModelCall(b, (1,), 0, (0,), blocks=(16,))], "outside 0..15", [b]),
        ([ModelCall(b, (1,) * 5, 0, (0,), blocks=(3, 3))], "twice", [b]),
        ([ModelCall(b, (1,) * 5, 0, (0,), blocks=(3,))], "too short", [b]),
        ([ModelCall(a, (6,), 5, (0,), blocks=(0, 1)),
          ModelCall(b, (1,) * 5, 0, (0,), blocks=(4, 1))], "writes a block", [a, b]),
        ([ModelCall(b, (1,), 0, (0,))], "every call needs its block table", [b]),
        ([ModelCall(a, (6,), 4, (0,), blocks=(0, 1))], "start differs", [a]),
        ([ModelCall(b, (1,), 3, (0,), blocks=(5,))], "start differs", [b]),   # not a block edge
    ]
    for calls, message, slots in cases:
        with pytest.raises(SlotError, match=message) as info:
            backend.forward(calls)
        assert sorted(info.value.slots) == slots
        assert (backend.cache_length(a), backend.cache_length(b)) == (5, 0)


def test_slot_mode_reserves_a_window_per_slot_and_hands_the_pool_over_once(
        checkpoints: dict[str, Any]) -> None:
    """Without block tables a slot's first call reserves a whole window (16 blocks of 4 for 64
    positions), so a pool of two windows serves two slots at once. The first call with tables
    needs every slot's cache empty; after it, calls without tables are refused."""
    folder, _ = checkpoints["llama"]
    with pytest.raises(InvalidValueError, match="one window"):
        _paged(folder, num_blocks=15)
    backend = _paged(folder, num_blocks=32)
    assert backend.num_blocks == 32 and not backend.caller_owns_blocks
    assert isinstance(backend, PagedBackend)
    assert not isinstance(ScriptedBackend(4, peaked(4, lambda t: 0)), PagedBackend)
    a, b, c = backend.allocate(), backend.allocate(), backend.allocate()
    backend.prefill([PrefillChunk(a, (1, 2, 3), 0, True), PrefillChunk(b, (4,), 0, True)])
    with pytest.raises(SlotError, match="no free KV window") as info:
        backend.prefill([PrefillChunk(c, (5,), 0, True)])
    assert info.value.slots == (c,) and backend.cache_length(c) == 0
    backend.release(b)
    backend.prefill([PrefillChunk(c, (5,), 0, True)])     # b's window, reused
    with pytest.raises(SlotError, match="still hold caches") as info:
        backend.forward([ModelCall(b := backend.allocate(), (1,), 0, (0,), blocks=(0,))])
    assert info.value.slots == (a, c)
    backend.release(a)
    backend.release(c)
    backend.forward([ModelCall(b, (1,), 0, (0,), blocks=(0,))])
    assert backend.caller_owns_blocks
    assert [backend.allocate(), backend.allocate()] == [0, 2]
    with pytest.raises(SlotError, match="every call needs its block table"):
        backend.decode([b], [2])
    default = TorchBackend.from_dir(folder, num_slots=3, max_context=50)
    assert default.num_blocks == 3 * 4 and default.block_size == 16  # ceil(50 / 16) per slot
