"""Token alignment: the routed (token, k) pairs sorted by expert, each expert's run padded.

Owns :class:`Alignment` and :func:`align`. The grouped GEMM kernels walk the sorted pairs in
blocks of ``block_m`` rows, every block belonging to one expert, so each expert's run is
padded up to a multiple of ``block_m`` with the sentinel ``T*K`` (a row the kernels mask). An
expert with no pairs gets no block and costs nothing.

Everything stays on the device and nothing is read back to the host: the number of blocks a
kernel launch covers is the host-side upper bound :func:`max_blocks`, and programs past
``num_padded`` return at once.

Example (K=1, experts ``[2, 0, 2]``, ``block_m=2``)::

    a = align(torch.tensor([[2], [0], [2]]), num_experts=3, block_m=2)
    a.sorted_ids   # [1, 3, 0, 2, ...]  pair 1 (expert 0) + pad, pairs 0 and 2 (expert 2)
    a.block_expert # [0, 2, -1, ...]    -1: a block past the end
    a.num_padded   # [4]
"""

from __future__ import annotations

import attrs
import torch

from pipeline.errors import InvalidValueError


@attrs.frozen(eq=False)
class Alignment:
    """``sorted_ids [P]`` int32: flat pair index ``t*K + k`` per padded row, ``num_pairs``
    for padding; ``block_expert [P / block_m]`` int32: each block's expert, ``-1`` past the
    end; ``num_padded [1]`` int32: rows in use (a multiple of ``block_m``)."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks that can hold ``num_pairs`` pairs: each expert wastes under one block, and at
    most ``num_pairs`` experts receive any pair."""
    return min(num_pairs, num_experts) + num_pairs // block_m


def align(ids: torch.Tensor, *, num_experts: int, block_m: int) -> Alignment:
    """Sort ``ids [T, K]`` (expert per token and slot) by expert and pad each run.

    Pairs of one expert keep their ``t*K + k`` order. Raises
    :class:`~pipeline.errors.InvalidValueError` for a block size below 1.
    """
    if block_m < 1:
        raise InvalidValueError("block_m", block_m, "must be >= 1")
    dev = ids.device
    flat = ids.reshape(-1).long()                                             # [N]
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))                                       # [E] (bincount syncs)
    padded = (counts + block_m - 1) // block_m * block_m                      # [E]
    padded_end = torch.cumsum(padded, 0)                                      # [E]
    order = torch.argsort(flat, stable=True)                                  # [N]
    expert_sorted = flat[order]                                               # [N]
    first_of_expert = torch.cumsum(counts, 0) - counts                        # [E]
    rank = torch.arange(n, device=dev) - first_of_expert[expert_sorted]       # [N]
    dest = (padded_end - padded)[expert_sorted] + rank                        # [N]
    blocks = max_blocks(n, num_experts, block_m)
    sorted_ids = torch.full((blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(blocks, device=dev) * block_m                  # [B]
    block_expert = torch.searchsorted(padded_end, block_start, right=True)    # [B]
    in_use = block_start < padded_end[-1]
    block_expert = torch.where(in_use, block_expert, -1).to(torch.int32)
    return Alignment(sorted_ids=sorted_ids, block_expert=block_expert,
                     num_padded=padded_end[-1:].to(torch.int32), num_pairs=n, block_m=block_m)
