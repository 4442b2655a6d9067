"""Per-row parameters as tensors, and the small layout helpers every processor shares.

Owns the conversions from a :class:`~pipeline.contracts.decode.Batch` (one ``GenerationConfig`` per
row) to the ``[B]`` tensors the processors compute with, and :func:`keep_rows`, the one way a
processor restores the rows it is not active for. Nothing here holds state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeline.contracts.decode import Batch, Row, Scores

NEG_INF = float("-inf")


def active_rows(batch: Batch, active: Callable[[Row], bool]) -> list[bool]:
    """``active(row)`` for every row of ``batch``, in row order."""
    return [active(row) for row in batch.rows]


def row_floats(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` float32 tensor on ``like``'s device."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def row_ints(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` int64 tensor on ``like``'s device."""
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def row_mask(flags: Sequence[bool], like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` bool tensor on ``like``'s device."""
    return torch.tensor(flags, dtype=torch.bool, device=like.device)


def keep_rows(new: torch.Tensor, old: torch.Tensor, flags: Sequence[bool]) -> torch.Tensor:
    """``new`` on the rows where ``flags`` is true, ``old`` elsewhere (same ``[B, N]`` shape)."""
    if all(flags):
        return new
    return torch.where(row_mask(flags, new).unsqueeze(1), new, old)


def columns_to_tokens(scores: Scores, columns: torch.Tensor) -> torch.Tensor:
    """Token ids ``[B, C]`` of ``columns [B, C]`` of ``scores`` (the identity when dense)."""
    if scores.indices is None:
        return columns
    return scores.indices.gather(1, columns)


def contiguous(scores: Scores) -> Scores:
    """``scores`` with row-major contiguous tensors (flat indexing needs it)."""
    if scores.values.is_contiguous() and (
            scores.indices is None or scores.indices.is_contiguous()):
        return scores
    indices = None if scores.indices is None else scores.indices.contiguous()
    return Scores(scores.values.contiguous(), indices)
