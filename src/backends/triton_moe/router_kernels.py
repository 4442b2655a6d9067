"""The router kernels: one program per block of tokens, the whole expert row in registers.

Owns the ``@triton.jit`` code behind :func:`backends.triton_moe.routing.route`, which holds
the rules' definitions, checks operands and launches these. Top-k is K rounds of ``argmax``
then mask, so ids come out in descending order, ties going to the lower expert id.
"""

# @triton.jit kernels take untyped arguments (Triton reads annotations itself).
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_t, stride_e,
                        TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """``logits [T, E]`` (any float dtype) -> ``weights [T, TOP_K]`` f32, ``ids [T, TOP_K]`` i32."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                # [BT]
    cols = tl.arange(0, BLOCK_E)                                              # [BE]
    valid = (rows[:, None] < T) & (cols[None, :] < E)                         # [BT, BE]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :] * stride_e,
                mask=valid, other=-float("inf")).to(tl.float32)
    top = tl.max(x, axis=1)                                                   # [BT]
    top = tl.where(rows < T, top, 0.0)              # rows past T: no inf - inf
    p = tl.where(valid, tl.exp(x - top[:, None]), 0.0)
    total = tl.sum(p, axis=1)                                                 # [BT]
    p = p / tl.where(total > 0, total, 1.0)[:, None]                          # [BT, BE]
    p = tl.where(valid, p, -1.0)
    kcols = tl.arange(0, BLOCK_K)                                             # [BK]
    out_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    out_id = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)                                              # [BT]
        idx = tl.argmax(p, axis=1)                                            # [BT]
        out_w = tl.where(kcols[None, :] == k, best[:, None], out_w)
        out_id = tl.where(kcols[None, :] == k, idx[:, None].to(tl.int32), out_id)
        p = tl.where(cols[None, :] == idx[:, None], -1.0, p)
    if RENORMALIZE:
        out_w = out_w / tl.sum(out_w, axis=1)[:, None]
    _store_topk(weights_ptr, ids_ptr, out_w, out_id, rows, kcols, T, TOP_K)


@triton.jit
def _store_topk(weights_ptr, ids_ptr, out_w, out_id, rows, kcols, T, TOP_K: tl.constexpr):
    """Store ``out_w``/``out_id [BT, BK]`` as rows of ``[T, TOP_K]``."""
    offs = rows[:, None] * TOP_K + kcols[None, :]
    mask = (rows[:, None] < T) & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + offs, out_w, mask=mask)
    tl.store(ids_ptr + offs, out_id, mask=mask)


@triton.jit
def grouped_sigmoid_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, T, E, stride_t,
                                 stride_e, scaling, TOP_K: tl.constexpr,
                                 GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                                BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    """DeepSeek-V3 routing of ``logits [T, E]`` with ``bias [E]`` f32; outputs as above."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)                # [BT]
    cols = tl.arange(0, BLOCK_E)                                              # [BE]
    valid = (rows[:, None] < T) & (cols[None, :] < E)                         # [BT, BE]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :] * stride_e,
                mask=valid, other=0.0).to(tl.float32)
    scores = tl.sigmoid(x)                                                    # [BT, BE]
    bias = tl.load(bias_ptr + cols, mask=cols < E, other=0.0)
    choice = tl.where(valid, scores + bias[None, :], -float("inf"))          # [BT, BE]
    per_group = E // GROUPS
    group_of = cols // per_group                                              # [BE]
    gcols = tl.arange(0, BLOCK_G)                                             # [BG]
    gscore = tl.full((BLOCK_T, BLOCK_G), -float("inf"), tl.float32)          # [BT, BG]
    for g in tl.static_range(GROUPS):
        mine = tl.where(group_of[None, :] == g, choice, -float("inf"))
        first = tl.max(mine, axis=1)
        second = tl.max(tl.where(cols[None, :] == tl.argmax(mine, axis=1)[:, None],
                                 -float("inf"), mine), axis=1)
        gscore = tl.where(gcols[None, :] == g, (first + second)[:, None], gscore)
    keep = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        g = tl.argmax(gscore, axis=1)                                         # [BT]
        keep = keep | (group_of[None, :] == g[:, None])
        gscore = tl.where(gcols[None, :] == g[:, None], -float("inf"), gscore)
    choice = tl.where(keep, choice, -float("inf"))
    kcols = tl.arange(0, BLOCK_K)                                             # [BK]
    out_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    out_id = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        idx = tl.argmax(choice, axis=1)                                       # [BT]
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)                        # [BT] unbiased
        out_w = tl.where(kcols[None, :] == k, w[:, None], out_w)
        out_id = tl.where(kcols[None, :] == k, idx[:, None].to(tl.int32), out_id)
        choice = tl.where(hit, -float("inf"), choice)
    if RENORMALIZE:
        out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
    _store_topk(weights_ptr, ids_ptr, out_w * scaling, out_id, rows, kcols, T, TOP_K)
