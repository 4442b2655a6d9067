"""(row, token) tables and how to apply them to either score layout.

Owns :class:`TokenTable` and the functions that build one from the batch (the token ids of
each row, with a weight or a count) and apply it to :class:`~pipeline.contracts.decode.Scores`. Masks
and penalties are all "change the score of these tokens in these rows"; keeping that in one
place lets each of them work on dense ``[B, V]`` and sparse ``[B, K]`` scores alike.

A table's keys are ``row * V + token``. Dense scores are updated with one flat gather and one
scatter; a key may repeat there, because every update is computed from the original score and
repeats write the same value. Sparse scores sort the keys and find their columns with one
``searchsorted``. Ids are moved into tensors through ``array`` buffers, which is several times
faster than ``torch.tensor`` on a tuple of Python ints. Token ids outside ``[0, V)`` are
ignored (a prompt may hold ids the output layer does not have).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from pipeline.contracts.decode import Batch, Row, Scores

Weights = torch.Tensor | float
Update = Callable[[torch.Tensor, Weights], torch.Tensor]
"""``f(scores_at_keys [P], weights) -> new scores [P]``; ``weights`` is ``[P]`` or a scalar."""


class TokenTable(NamedTuple):
    """Keys ``row * V + token`` ``[P]`` int64, and their weights (``[P]`` float32 or a scalar)."""

    keys: torch.Tensor
    weights: Weights

    @property
    def empty(self) -> bool:
        """True when the table names no token."""
        return self.keys.numel() == 0


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if device.type == "cpu" else tensor.to(device)


def _int64(buffer: array[int], device: torch.device) -> torch.Tensor:
    if not len(buffer):
        return torch.empty(0, dtype=torch.int64, device=device)
    return _on(torch.frombuffer(buffer, dtype=torch.int64), device)


def _float32(buffer: array[float], device: torch.device) -> torch.Tensor:
    if not len(buffer):
        return torch.empty(0, dtype=torch.float32, device=device)
    return _on(torch.frombuffer(buffer, dtype=torch.float32), device)


def _keys(batch: Batch, flags: Sequence[bool], ids_of: Callable[[Row], Sequence[int]],
          device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Keys ``[N]`` of every id ``ids_of(row)`` of the flagged rows (repeats kept), and how
    many ids each row contributed."""
    vocab = batch.vocab_size
    tokens: array[int] = array("q")
    offsets: array[int] = array("q")
    counts = []
    for b, (row, on) in enumerate(zip(batch.rows, flags)):
        ids = ids_of(row) if on else ()
        tokens.extend(ids)
        if b:
            offsets.extend(array("q", [b * vocab]) * len(ids))
        elif ids:
            offsets.extend(array("q", [0]) * len(ids))
        counts.append(len(ids))
    tok = _int64(tokens, device)  # [N]
    keys = (tok + _int64(offsets, device)) if len(batch.rows) > 1 else tok
    if tok.numel():
        low, high = torch.aminmax(tok)
        if int(high) >= vocab or int(low) < 0:
            return keys[(tok >= 0) & (tok < vocab)], counts
    return keys, counts


def _row_weights(batch: Batch, flags: Sequence[bool], weight_of: Callable[[Row], float],
                 counts: Sequence[int], device: torch.device) -> Weights:
    """One weight per key: a scalar when every flagged row has the same one."""
    per_row = [weight_of(r) for r, on in zip(batch.rows, flags) if on]
    if len(set(per_row)) <= 1:
        return per_row[0] if per_row else 0.0
    weights: array[float] = array("f")
    for r, on, n in zip(batch.rows, flags, counts):
        if on:
            weights.extend(array("f", [weight_of(r)]) * n)
    return _float32(weights, device)


def id_table(batch: Batch, flags: Sequence[bool], ids_of: Callable[[Row], Sequence[int]],
             weight_of: Callable[[Row], float], device: torch.device) -> TokenTable:
    """The ids of each flagged row (repeats kept), each weighted by its row's ``weight_of``."""
    keys, counts = _keys(batch, flags, ids_of, device)
    if keys.numel() != sum(counts):  # ids outside the vocabulary were dropped: weight by key
        per_row = torch.tensor([weight_of(r) if on else 0.0 for r, on in zip(batch.rows, flags)],
                               dtype=torch.float32, device=device)
        return TokenTable(keys, per_row[keys // batch.vocab_size])
    return TokenTable(keys, _row_weights(batch, flags, weight_of, counts, device))


def count_table(batch: Batch, flags: Sequence[bool], ids_of: Callable[[Row], Sequence[int]],
                device: torch.device) -> TokenTable:
    """The distinct ids of each flagged row, weighted by how often they occur in ``ids_of``."""
    keys, counts = torch.unique(_keys(batch, flags, ids_of, device)[0], return_counts=True)
    return TokenTable(keys, counts.to(torch.float32))


def map_table(batch: Batch, flags: Sequence[bool],
              items_of: Callable[[Row], Mapping[int, float]], device: torch.device) -> TokenTable:
    """Per flagged row, the ids of the mapping ``items_of(row)`` weighted by their values."""
    vocab = batch.vocab_size
    keys: array[int] = array("q")
    weights: array[float] = array("f")
    for b, (row, on) in enumerate(zip(batch.rows, flags)):
        for token, weight in (items_of(row).items() if on else ()):
            if 0 <= token < vocab:
                keys.append(b * vocab + token)
                weights.append(weight)
    return TokenTable(_int64(keys, device), _float32(weights, device))


def _sparse_hits(scores: Scores, vocab: int, table: TokenTable
                 ) -> tuple[torch.Tensor, Weights]:
    """Sparse scores: flat positions ``[H]`` of the columns the table names, and their weights."""
    assert scores.indices is not None
    keys, order = torch.sort(table.keys)  # [P]
    rows = scores.indices.shape[0]
    base = torch.arange(rows, device=keys.device).unsqueeze(1) * vocab  # [B, 1]
    column_keys = (base + scores.indices).reshape(-1)  # [B*K]
    where = torch.searchsorted(keys, column_keys).clamp_(max=keys.numel() - 1)  # [B*K]
    hit = (keys[where] == column_keys).nonzero().squeeze(1)  # [H]
    weights = table.weights
    if isinstance(weights, torch.Tensor):
        weights = weights[order][where[hit]]
    return hit, weights


def apply_table(scores: Scores, vocab: int, table: TokenTable, update: Update | None) -> Scores:
    """Replace each listed (row, token) score ``s`` with ``update(s, weight)`` in place;
    ``update=None`` removes the token (``-inf``)."""
    if table.empty:
        return scores
    flat = scores.values.view(-1)  # [B*N]
    if scores.indices is None:
        at, weights = table.keys, table.weights
    else:
        at, weights = _sparse_hits(scores, vocab, table)
    if update is None:
        flat.index_fill_(0, at, float("-inf"))
    else:
        flat[at] = update(flat[at], weights)
    return scores


def member_mask(scores: Scores, vocab: int, table: TokenTable) -> torch.Tensor:
    """``[B, N]`` bool: whether each column's (row, token) is in the table."""
    rows, width = scores.values.shape
    mask = torch.zeros(rows * width, dtype=torch.bool, device=scores.values.device)
    if not table.empty:
        at = table.keys if scores.indices is None else _sparse_hits(scores, vocab, table)[0]
        mask[at] = True
    return mask.view(rows, width)
