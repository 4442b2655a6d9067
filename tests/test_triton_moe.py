"""The Triton MoE kernels against the torch reference MoE and transformers, on the CPU.

Kernels run through the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is
imported), so shapes are tiny and dtypes are float32 and float16 (the interpreter has no
bfloat16 dot). Oracles: :func:`backends.torch.moe.moe_forward` / ``route`` /
``expert_forward`` (themselves tested against transformers), transformers' DeepSeek-V3 MoE
block, and plain-Python constructions of the expected alignment.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from backends.torch.moe import RoutingSpec, expert_forward, moe_forward  # noqa: E402
from backends.torch.moe import route as torch_route  # noqa: E402
from backends.triton_moe import (  # noqa: E402
    ConfigKey, GroupedSigmoidTopK, LaunchConfig, SoftmaxTopK, TritonMoe, fused_experts, route,
)
from backends.triton_moe.align import align, max_blocks  # noqa: E402
from pipeline.errors import BackendError, InvalidValueError  # noqa: E402

transformers = pytest.importorskip("transformers")

TOL = {torch.float32: 1e-5, torch.float16: 2e-2}
SMALL = LaunchConfig(block_m=4, block_n=16, block_k=16, group_m=2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _experts(e: int, h: int, i: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn((e, 2 * i, h), generator=gen) / h ** 0.5
    w_down = torch.randn((e, h, i), generator=gen) / i ** 0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _inputs(t: int, h: int, e: int, dtype: torch.dtype,
            seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((t, h), generator=gen)
    logits = 2 * torch.randn((t, e), generator=gen)
    return x.to(dtype), logits.to(dtype)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


# --- routing ------------------------------------------------------------------------------

@pytest.mark.parametrize("e,k", [(8, 1), (8, 2), (6, 2), (16, 8), (60, 4)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_the_torch_router(e: int, k: int, renormalize: bool) -> None:
    _, logits = _inputs(21, 4, e, torch.float32, seed=e + k)
    spec = RoutingSpec(renormalize=renormalize, weights_in_float32=True)
    ref_w, ref_ids = torch_route(logits, top_k=k, routing=spec)
    weights, ids = route(logits, SoftmaxTopK(k, renormalize))
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bias_scale", [0.0, 0.5, -3.0])
def test_grouped_sigmoid_topk_matches_transformers_deepseek_v3(bias_scale: float) -> None:
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        moe_intermediate_size=16, routed_scaling_factor=2.5, norm_topk_prob=True)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(bias_scale * torch.randn(16, generator=gen))
    x = torch.randn((19, 32), generator=gen) / 4
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    rule = GroupedSigmoidTopK(4, num_groups=4, topk_group=2, renormalize=True, scaling=2.5)
    weights, ids = route(logits, rule, router.e_score_correction_bias)
    # transformers' top-k is unsorted: compare as {expert: weight} per token
    for t in range(x.shape[0]):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        want = dict(zip(ref_ids[t].tolist(), ref_w[t].tolist()))
        assert got.keys() == want.keys(), t
        assert all(abs(got[j] - want[j]) < 1e-6 for j in got)
    choice = (logits.sigmoid() + router.e_score_correction_bias).gather(1, ids.long())
    assert torch.all(choice[:, :-1] >= choice[:, 1:])  # in selection order


def test_routing_rejects_what_it_cannot_route() -> None:
    logits = torch.zeros((3, 8))
    with pytest.raises(InvalidValueError, match="top_k"):
        route(logits, SoftmaxTopK(9))
    with pytest.raises(InvalidValueError, match="num_groups"):
        route(logits, GroupedSigmoidTopK(2, num_groups=3, topk_group=1), torch.zeros(8))
    with pytest.raises(InvalidValueError, match="correction_bias"):
        route(logits, GroupedSigmoidTopK(2, num_groups=4, topk_group=2))
    with pytest.raises(InvalidValueError, match="topk_group"):
        GroupedSigmoidTopK(2, num_groups=2, topk_group=3)
    with pytest.raises(InvalidValueError, match="top_k"):
        SoftmaxTopK(0)


# --- alignment ----------------------------------------------------------------------------

def _expected_alignment(ids: list[list[int]], e: int, bm: int) -> tuple[list[int], list[int]]:
    """Plain Python: pairs grouped by expert in flat order, each run padded with the sentinel."""
    flat = [x for row in ids for x in row]
    rows: list[int] = []
    blocks: list[int] = []
    for expert in range(e):
        run = [p for p, x in enumerate(flat) if x == expert]
        pad = -len(run) % bm
        rows += run + [len(flat)] * pad
        blocks += [expert] * ((len(run) + pad) // bm)
    return rows, blocks


@pytest.mark.parametrize("t,k,e,bm", [(13, 2, 8, 4), (1, 8, 16, 16), (7, 1, 3, 1),
                                      (33, 4, 5, 8)])
def test_alignment_sorts_pairs_by_expert_and_pads_each_run(t: int, k: int, e: int,
                                                            bm: int) -> None:
    gen = torch.Generator().manual_seed(t * k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[: t // 2, 0] = 0  # a crowded expert
    a = align(ids.to(torch.int32), num_experts=e, block_m=bm)
    rows, blocks = _expected_alignment(ids.tolist(), e, bm)
    used = int(a.num_padded)
    assert used == len(rows)
    assert a.sorted_ids[:used].tolist() == rows
    assert a.sorted_ids[used:].eq(t * k).all()
    assert a.block_expert[: used // bm].tolist() == blocks
    assert a.block_expert[used // bm:].eq(-1).all()
    assert a.block_expert.numel() == max_blocks(t * k, e, bm) >= len(blocks)


def test_experts_without_tokens_get_no_block() -> None:
    ids = torch.tensor([[5], [5], [5], [1]])
    a = align(ids, num_experts=8, block_m=2)
    assert int(a.num_padded) == 6
    assert [b for b in a.block_expert.tolist() if b >= 0] == [1, 5, 5]


# --- the fused experts --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k,renormalize,f32_weights", [(1, False, False), (2, True, True),
                                                      (8, False, False), (8, True, True)])
def test_moe_matches_torch_reference(dtype: torch.dtype, k: int, renormalize: bool,
                                     f32_weights: bool) -> None:
    """Qwen-MoE (no renormalization, weights cast) and Mixtral (renormalized, float32 weights)
    routing; 13 tokens (not a multiple of any block size); top-1, top-2, top-8."""
    t, h, e, i = 13, 48, 16, 24
    x, logits = _inputs(t, h, e, dtype, seed=k)
    w_gate_up, w_down = _experts(e, h, i, dtype)
    spec = RoutingSpec(renormalize=renormalize, weights_in_float32=f32_weights)
    config = SMALL if k < 8 else LaunchConfig(block_m=8, block_n=32, block_k=32, group_m=2)
    out = TritonMoe(config=config)(x, logits, w_gate_up, w_down, top_k=k, routing=spec)
    ref = moe_forward(x.float(), logits.float(), w_gate_up.float(), w_down.float(), top_k=k,
                      routing=spec)
    assert out.dtype == dtype and out.shape == (t, h)
    assert _rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_expert_takes_every_token_and_most_take_none(dtype: torch.dtype) -> None:
    t, h, e, i = 11, 32, 8, 16
    x, logits = _inputs(t, h, e, dtype)
    logits = logits.float()
    logits[:, 6] += 50.0   # expert 6 is everyone's first choice
    logits[:, 2] += 25.0   # expert 2 everyone's second: experts 0,1,3,4,5,7 get nothing
    logits = logits.to(dtype)
    w_gate_up, w_down = _experts(e, h, i, dtype, seed=5)
    spec = RoutingSpec(renormalize=True, weights_in_float32=True)
    out = TritonMoe(config=SMALL)(x, logits, w_gate_up, w_down, top_k=2, routing=spec)
    ref = moe_forward(x.float(), logits.float(), w_gate_up.float(), w_down.float(), top_k=2,
                      routing=spec)
    assert _rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_deepseek_v3_block_matches_transformers(dtype: torch.dtype) -> None:
    """Grouped sigmoid routing with a correction bias, routed experts, plus the shared expert
    (the model adds it, as here), against transformers' DeepseekV3MoE."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
        moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    block = DeepseekV3MoE(cfg).eval()
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
        x = torch.randn((10, 32), generator=gen)
        ref = block(x)
        logits = x @ block.gate.weight.T
        rule = GroupedSigmoidTopK(4, num_groups=4, topk_group=2, renormalize=True, scaling=2.5)
        weights, ids = route(logits, rule, block.gate.e_score_correction_bias)
        routed = fused_experts(x.to(dtype), weights, ids, block.experts.gate_up_proj.to(dtype),
                               block.experts.down_proj.to(dtype), SMALL)
        out = routed.float() + block.shared_experts(x)
    assert _rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("config", [LaunchConfig(block_m=1, block_n=8, block_k=8),
                                    LaunchConfig(block_m=16, block_n=64, block_k=32, group_m=4)])
def test_block_sizes_do_not_change_the_result(config: LaunchConfig) -> None:
    """Tiles smaller and larger than H and I, one-row blocks, K tails (H=40, I=20)."""
    x, logits = _inputs(5, 40, 8, torch.float32)
    w_gate_up, w_down = _experts(8, 40, 20, torch.float32)
    weights, ids = torch_route(logits, top_k=2, routing=RoutingSpec(True, True))
    out = fused_experts(x, weights, ids, w_gate_up, w_down, config)
    ref = expert_forward(x, weights, ids, w_gate_up, w_down)
    assert _rel_err(out, ref) <= 1e-5


def test_chunked_calls_equal_one_call() -> None:
    x, logits = _inputs(13, 32, 8, torch.float32)
    w_gate_up, w_down = _experts(8, 32, 16, torch.float32)
    spec = RoutingSpec(renormalize=False)
    whole = TritonMoe(config=SMALL)(x, logits, w_gate_up, w_down, top_k=2, routing=spec)
    chunked = TritonMoe(config=SMALL, chunk_tokens=5)(x, logits, w_gate_up, w_down, top_k=2,
                                                      routing=spec)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)


def test_no_tokens_gives_an_empty_result() -> None:
    w_gate_up, w_down = _experts(4, 16, 8, torch.float32)
    out = TritonMoe()(torch.zeros((0, 16)), torch.zeros((0, 4)), w_gate_up, w_down, top_k=2,
                      routing=RoutingSpec(True))
    assert out.shape == (0, 16)


def test_bad_operands_are_named() -> None:
    moe = TritonMoe()
    x, logits = _inputs(3, 16, 4, torch.float32)
    w_gate_up, w_down = _experts(4, 16, 8, torch.float32)
    spec = RoutingSpec(True)
    with pytest.raises(InvalidValueError, match="moe shapes"):
        moe(x, logits, w_gate_up, w_down[:, :, :4], top_k=2, routing=spec)
    with pytest.raises(InvalidValueError, match="moe dtypes"):
        moe(x.half(), logits, w_gate_up, w_down, top_k=2, routing=spec)
    with pytest.raises(InvalidValueError, match="router_logits"):
        moe(x, logits[:, :3], w_gate_up, w_down, top_k=2, routing=spec)
    with pytest.raises(InvalidValueError, match="strides"):
        moe(x, logits, w_gate_up.transpose(1, 2).contiguous().transpose(1, 2), w_down,
            top_k=2, routing=spec)
    with pytest.raises(BackendError, match="bfloat16"):
        moe(x.bfloat16(), logits, w_gate_up.bfloat16(), w_down.bfloat16(), top_k=2,
            routing=spec)


def test_tuned_table_is_used_for_the_nearest_batch(tmp_path: Path) -> None:
    from backends.triton_moe.configs import default_config, write_table
    key = ConfigKey(4, 8, "interpreter", "float32")
    small, big = LaunchConfig(2, 8, 8), LaunchConfig(8, 16, 16, group_m=4)
    write_table(tmp_path, key, {4: small, 64: big}, "test")
    moe = TritonMoe([tmp_path])
    w_gate_up, w_down = _experts(4, 16, 8, torch.float32)
    assert moe.pick(torch.zeros((30, 16)), w_gate_up, 2) == small
    assert moe.pick(torch.zeros((40, 16)), w_gate_up, 2) == big
    # without a table for the shape: the heuristic default
    assert TritonMoe().pick(torch.zeros((3, 16)), w_gate_up, 2) == default_config(
        3, 4, 2, "interpreter")


def test_launch_configs_and_tables_reject_bad_values(tmp_path: Path) -> None:
    from backends.triton_moe.configs import read_table
    from pipeline.errors import ArtifactError
    with pytest.raises(InvalidValueError, match="block_n"):
        LaunchConfig(block_m=16, block_n=48, block_k=32)
    with pytest.raises(InvalidValueError, match="unknown keys"):
        LaunchConfig.from_dict({"block_m": 16, "block_n": 32, "block_k": 32, "blockm": 1})
    bad = tmp_path / "E=4,N=8,device_name=x,dtype=float32.json"
    bad.write_text('{"configs": {"1": {"block_m": 3, "block_n": 8, "block_k": 8}}}')
    with pytest.raises(ArtifactError, match=bad.name):
        read_table(bad)
    bad.write_text("not json")
    with pytest.raises(ArtifactError, match=bad.name):
        read_table(bad)


def test_fused_experts_names_mismatched_routing() -> None:
    x, _ = _inputs(3, 16, 4, torch.float32)
    w_gate_up, w_down = _experts(4, 16, 8, torch.float32)
    with pytest.raises(InvalidValueError, match="routing"):
        fused_experts(x, torch.ones((3, 2)), torch.zeros((3, 1), dtype=torch.int32),
                      w_gate_up, w_down, SMALL)
