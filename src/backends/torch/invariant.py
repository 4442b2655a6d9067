"""Batch-invariant products: a row's result never depends on the batch it was computed in.

Owns :func:`tiled_rows` (a matrix product run on fixed-size tiles of rows), :class:`RowTiles`
(which tile each row of a forward gets) and :func:`grid_attention` (causal attention for the
queries of a prompt chunk, whatever the chunk's bounds). The torch backend uses both when ``BackendOptions.batch_invariant`` is on
(the default on CPU), so a greedy or seeded request gives the same tokens alone and in any
batch, with or without prefix-cache hits, in float32, bfloat16 and float16.

Why it is needed. A library matrix product picks its kernel and its blocking from the shape:
on a CPU, ``F.linear`` in float32 or float16 sums row 0 of a 1-row product in another order
than row 0 of a 2-row product, and bfloat16 changes again past 32 rows; the float32 attention
kernel sums a query's keys in an order that depends on how many queries and keys the call
has. The results differ by one unit in the last place, which flips a near-tie argmax, most
often in bfloat16. (vLLM and SGLang offer a batch-invariant mode on GPUs for the same reason.)

How it holds, by construction rather than by measurement:

- :func:`tiled_rows` feeds the product tiles of exactly ``tile`` rows (the last one padded
  with zeros), so every call the kernel sees has the same shape and a row's result depends
  only on the row: kernels never mix values across rows, and a row's place inside the tile
  does not change its order of summation. :class:`RowTiles` gives each row its tile size by
  what its own request's call is (a decode token: narrow tiles, cheap for one request alone;
  a prompt chunk or a multi-token call: wide tiles, cheap for many rows).
- :func:`grid_attention` attends the prompt positions ``t*GRID .. (t+1)*GRID - 1`` with one
  call of exactly ``GRID`` queries over exactly ``(t+1)*GRID`` keys (absent queries and keys
  zero and masked), so the call a position lands in has the same shape, the same row for it
  and the same visible keys whether its prompt was prefilled in one call, in budget-sized
  chunks, or after a prefix-cache hit.

- :func:`sdpa` is the backend's one attention call. On a CPU in float32 it is written out
  (query heads of a kv head folded into rows, a product, a softmax, a product) because
  torch's fused float32 kernel gives a head other bits when it is the first a worker thread
  takes than when it follows another (torch 2.13 on an AVX-512 CPU, one to three queries,
  one thread against two), so the thread count would change tokens. Written out it costs a
  decode's attention about what the fused kernel does (docs/performance.md).

What it does not cover: a decode token (one query) still uses torch's attention, which is
the same call alone or batched; a prompt position is always computed by a chunk and an
output position by a decode, except when a preempted request recomputes its output as a
prompt, or a prompt reuses cached blocks another request wrote while decoding: those
positions may differ at a near-tie. The cost is measured in ``docs/performance.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

GRID = 64
"""Prompt positions are attended in tiles of this many, aligned at position 0."""
NARROW_TILE = 8
"""Rows per product for the tokens of one-token calls (decode steps): one request decoding
alone pays for this many rows; eight decoding together pay nothing more."""
WIDE_TILE = 32
"""Rows per product for prompt chunks and multi-token calls (draft verification, diffusion
blocks), where the rows come many at a time."""


class RowTiles:
    """A forward's rows and the tile each is computed on: :data:`WIDE_TILE` where ``wide``
    (a prompt chunk's or a multi-token call's rows), :data:`NARROW_TILE` elsewhere. A row's
    class comes from its own request's call, never from the batch, so its result does not
    depend on the batch either."""

    def __init__(self, wide: Sequence[bool], device: torch.device) -> None:
        self.rows = len(wide)
        self.wide = tuple(wide)
        self.uniform = (WIDE_TILE if all(wide) else NARROW_TILE if not any(wide) else None)
        if self.uniform is None:  # index tensors only for a mixed forward
            picked = torch.tensor(list(wide), dtype=torch.bool, device=device)
            self._wide = picked.nonzero().squeeze(1)
            self._narrow = (~picked).nonzero().squeeze(1)

    def apply(self, x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor]
              ) -> torch.Tensor:
        """``product(x)`` for ``x [rows, in]``, each row on its class's tiles."""
        if self.uniform is not None:
            return tiled_rows(x, product, self.uniform)
        wide = tiled_rows(x.index_select(0, self._wide), product, WIDE_TILE)
        narrow = tiled_rows(x.index_select(0, self._narrow), product, NARROW_TILE)
        out = wide.new_empty((self.rows, *wide.shape[1:]))
        out[self._wide] = wide
        out[self._narrow] = narrow
        return out


def tiled_rows(x: torch.Tensor, product: Callable[[torch.Tensor], torch.Tensor],
               tile: int) -> torch.Tensor:
    """``product(x)`` for ``x [T, in]``, computed on tiles of exactly ``tile`` rows.

    Returns ``[T, out]``. The last tile is padded with zero rows whose results are dropped.
    """
    rows = x.shape[0]
    pad = (-rows) % tile
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    if x.shape[0] == tile:
        out = product(x)
    else:
        out = torch.cat([product(part) for part in torch.split(x, tile)])
    return out[:rows] if pad else out


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
         enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (same arguments, a boolean ``attn_mask [n, L]``)
    with bits that do not depend on the thread count: for float32 on a CPU it is written out
    as two batched products and a softmax (module doc), otherwise torch's fused kernel."""
    if q.dtype != torch.float32 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask,
                                              is_causal=is_causal, enable_gqa=enable_gqa)
    b, hq, n, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    group = hq // hkv if enable_gqa else 1
    # the query heads that share a kv head become rows of one product: [B, Hkv, g*n, D]
    scores = torch.matmul(q.reshape(b, hkv, group * n, d), keys.transpose(-1, -2))
    scores.mul_(d ** -0.5)
    if is_causal:  # top-left aligned, as torch's is_causal
        attn_mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        scores.view(b, hkv, group, n, length).masked_fill_(~attn_mask, float("-inf"))
    out = torch.matmul(scores.softmax(-1), values)                            # [B,Hkv,g*n,D]
    return out.view(b, hq, n, d)


def grid_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   window: int | None) -> torch.Tensor:
    """Causal attention of the prompt queries ``q [n, Hq, D]`` at positions
    ``start..start+n-1`` over ``keys``/``values [1, Hkv, L, D]`` (``L = start + n``);
    returns ``[n, Hq, D]``, each row independent of ``n`` and ``start``.

    The queries at positions ``t*GRID .. (t+1)*GRID - 1`` are attended by one call of
    exactly ``GRID`` queries (absent ones zero, seeing only key 0) over exactly
    ``(t+1)*GRID`` keys (absent ones zero and hidden), so the call a position lands in has
    the same shape, the same row for it and the same visible keys whatever chunk it came in.
    A query at position p sees keys at ``p - window < k <= p`` (no lower bound without a
    ``window``); GQA: query head h reads kv head ``h // (Hq/Hkv)``.
    """
    n, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    first, last = start // GRID, (start + n - 1) // GRID
    width = (last + 1) * GRID
    if length < width:  # zero keys past the end, hidden by the mask
        pad = keys.new_zeros((1, hkv, width - length, d))
        keys, values = torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)
    rows = torch.arange(GRID, device=q.device).unsqueeze(1)                  # [G, 1]
    outs = []
    for tile in range(first, last + 1):
        lo, hi = tile * GRID, (tile + 1) * GRID
        a, b = max(lo, start), min(hi, start + n)       # the positions this call has
        qt = q.new_zeros((GRID, hq, d))
        qt[a - lo:b - lo] = q[a - start:b - start]
        q_pos = lo + rows                                                      # [G, 1]
        k_pos = torch.arange(hi, device=q.device).unsqueeze(0)                 # [1, hi]
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        absent = (q_pos < a) | (q_pos >= b)
        seen = torch.where(absent, k_pos == 0, seen)                          # [G, hi]
        out = sdpa(qt.transpose(0, 1)[None], keys[:, :, :hi], values[:, :, :hi],
                   attn_mask=seen, enable_gqa=True)                                                   # [1, Hq, G, D]
        outs.append(out[0, :, a - lo:b - lo].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
