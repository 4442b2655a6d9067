"""The grouped expert GEMM kernels and the top-k reduction, in Triton.

Owns three ``@triton.jit`` kernels; :mod:`.launch` checks their operands and launches them.
Notation: T tokens, K experts per token, N = T*K routed pairs, H hidden, I expert
intermediate size, P padded sorted rows (see :mod:`.align`), blocks of ``BLOCK_M`` rows each
owned by one expert.

1. :func:`gate_up_kernel` — ``act[P, I] = silu(x @ Wg[e].T) * (x @ Wu[e].T)`` per block: the
   block's token rows of ``x`` are gathered by integer offset (no permuted copy), the gate and
   up tiles of ``w_gate_up [E, 2I, H]`` (gate rows first) accumulate side by side in float32,
   and SiLU-and-multiply runs in registers before the one store, in sorted row order.
2. :func:`down_kernel` — ``y[N, H] = (act @ Wd[e].T) * weight`` per block over
   ``w_down [E, H, I]``; the routing weight multiplies the float32 accumulator and the rows
   are scattered back to pair order ``t*K + k`` (float32).
3. :func:`sum_topk_kernel` — ``out[T, H] = sum_k y[t*K + k]`` in float32, cast to ``out``'s
   dtype: deterministic, no atomics.

Both GEMMs use a 1-D grid over (row block, column block) with the grouped ordering of the
Triton matmul tutorial (``GROUP_M`` row blocks share weight tiles in L2). A block past
``num_padded`` returns at once; padding rows load zeros and are never stored (kernel 2).
"""

# @triton.jit kernels take untyped arguments (Triton reads annotations itself).
# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """Grouped ordering: program ``pid`` -> (row block, column block)."""
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _block_rows(pid_m, sorted_ids_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """Row block ``pid_m`` of the sorted pairs: its positions ``[BM]``, the pair ids there,
    which of them are real (padding ids are ``>= num_pairs``), and the block's expert."""
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # [BM]
    pair = tl.load(sorted_ids_ptr + offs_p)                                   # [BM]
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return offs_p, pair, pair < num_pairs, expert


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                   blocks_m, blocks_n, num_pairs, I, H,
                   stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ap, stride_ai,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """``x [T, H]``, ``w [E, 2I, H]``, ``act [P, I]``; ``sorted_ids [P]`` i32,
    ``block_expert [P / BLOCK_M]`` i32, ``num_padded [1]`` i32; the grid covers
    ``blocks_m`` row blocks (<= P / BLOCK_M) times ``blocks_n = cdiv(I, BLOCK_N)``."""
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, blocks_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_p, pair, live, expert = _block_rows(pid_m, sorted_ids_ptr, block_expert_ptr,
                                             num_pairs, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % I                    # [BN] wraps
    offs_k = tl.arange(0, BLOCK_K)                                            # [BK]
    a_ptrs = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_xt \
        + offs_k[None, :] * stride_xh                                         # [BM, BK]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn \
        + offs_k[:, None] * stride_wh                                         # [BK, BN]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, (H + BLOCK_K - 1) // BLOCK_K):
        left = H - k * BLOCK_K
        a = tl.load(a_ptrs, mask=live[:, None] & (offs_k[None, :] < left), other=0.0)
        g = tl.load(g_ptrs, mask=offs_k[:, None] < left, other=0.0)
        u = tl.load(u_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                              # [BM, BN] silu*up
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + cols[None, :] * stride_ai
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=cols[None, :] < I)


@triton.jit
def down_kernel(act_ptr, w_ptr, y_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr,
                num_padded_ptr, blocks_m, blocks_n, num_pairs, H, I,
                stride_ap, stride_ai, stride_we, stride_wh, stride_wi, stride_yn, stride_yh,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """``act [P, I]`` (sorted rows), ``w [E, H, I]``, ``y [N, H]`` f32, ``weights [N]`` f32
    (routing weight of pair ``t*K + k``); the other operands as in :func:`gate_up_kernel`."""
    pid_m, pid_n = _tile(tl.program_id(0), blocks_m, blocks_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_p, pair, live, expert = _block_rows(pid_m, sorted_ids_ptr, block_expert_ptr,
                                             num_pairs, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % H                    # [BN] wraps
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + offs_k[None, :] * stride_ai
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wh \
        + offs_k[:, None] * stride_wi                                         # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, (I + BLOCK_K - 1) // BLOCK_K):
        left = I - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ai
        b_ptrs += BLOCK_K * stride_wi
    acc = acc * tl.load(weights_ptr + pair, mask=live, other=0.0)[:, None]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yn + cols[None, :] * stride_yh
    tl.store(out_ptrs, acc, mask=live[:, None] & (cols[None, :] < H))


@triton.jit
def sum_topk_kernel(y_ptr, out_ptr, H, stride_yn, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``y [T*K, H]`` f32 (unit stride along H) -> ``out [T, H]``; grid ``(T, cdiv(H, BH))``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + k) * stride_yn + cols, mask=cols < H, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)
