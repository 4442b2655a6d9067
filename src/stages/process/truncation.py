"""Truncation processors: ``top_k``, ``top_p``, ``min_p`` and ``typical_p``.

Owns the four argmax-invariant processors that remove unlikely tokens. Each is inactive for
greedy rows (so a greedy row's processed distribution, and its logprobs, do not depend on the
batch it runs in) and for rows whose parameter is "off".

Ties and batch invariance. The kept set is a function of the row alone: the tokens whose
score is at least a threshold (the k-th largest score; the last score of the nucleus), ties
included, so which of several equal scores a ranking lists first never matters, and a row
keeps the same tokens whether its batch takes the sparse or the threshold path. (Keeping
exactly k would need a tie rule; ranking kernels order equal values differently with the
batch's shape.)

Layouts. When every row of the batch is active, ``top_k`` and ``top_p`` return sparse scores:
the kept candidates, most likely first, as ``[B, K]`` values and token ids (a row that keeps
fewer than K has ``-inf`` in its extra columns), so later processors and the selector work on
K columns instead of V, unless a row's ties at the threshold reach past the ranked columns.
Otherwise they mask in place by the per-row threshold. Neither sorts the
vocabulary when it can avoid it: ``top_k`` uses a block-pruned top-k, and ``top_p`` looks for
the nucleus in a bounded prefix of the ranking first and sorts everything only when that prefix
holds less than ``top_p`` of the mass.

Semantics are those of transformers' warpers: ``top_k`` keeps the k largest and every token
tied with the k-th; ``top_p`` keeps a token when the mass of the tokens ranked above it is
below ``p``, and every token tied with the last one kept; ``min_p`` keeps ``prob >= min_p * max prob``
(compared in log space: ``s >= max s + log min_p``); ``typical_p`` follows
``TypicalLogitsWarper``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pipeline.contracts.decode import Batch, Row, Scores
from stages.process.rows import (
    NEG_INF, active_rows, columns_to_tokens, contiguous, keep_rows, row_floats, row_ints,
    row_mask,
)
from stages.process.topk import block_topk

TOP_P_PREFIXES = (256, 4096)
"""Ranking prefixes ``top_p`` tries, in order, before it sorts the whole row."""
SLICE_ABOVE = 64
"""``top_p``'s sparse output keeps every ranked column up to this many (cutting costs more)."""


def _sampled(row: Row) -> bool:
    return not row.config.greedy


def _threshold_mask(scores: Scores, threshold: torch.Tensor) -> Scores:
    """Remove, in place, every score below its row's ``threshold [B]`` (``-inf``: keep all)."""
    values = scores.values
    values.masked_fill_(values < threshold.unsqueeze(1), NEG_INF)
    return scores


def _ties_fit(values: torch.Tensor, threshold: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether each row of ``values [B, N]`` has exactly ``keep [B]`` scores at or above its
    ``threshold [B]``: the ranked prefix already holds every tie (the sparse layout is
    exact)."""
    at_least = (values >= threshold.unsqueeze(1)).sum(dim=1)
    return bool((at_least == keep).all())


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor | float:
    """A row parameter as a scalar when every row has the same value, else ``[B, 1]``."""
    if len(set(values)) == 1:
        return values[0]
    return row_floats(values, like).unsqueeze(1)


def _ranked(scores: Scores, columns: torch.Tensor, top: torch.Tensor,
            keep: list[int]) -> Scores:
    """Sparse scores from a ranking: the first ``keep[b]`` of ``top``/``columns [B, C]``."""
    width = max(keep)
    top, columns = top[:, :width], columns[:, :width]
    if min(keep) < width:
        rank = torch.arange(width, device=top.device)
        top = top.masked_fill(rank >= row_ints(keep, top).unsqueeze(1), NEG_INF)  # [B, K]
    return Scores(top.contiguous(), columns_to_tokens(scores, columns).contiguous())


class TopK:
    """``top_k``: keep each row's ``config.top_k`` most likely tokens."""

    name: str = "top_k"
    argmax_invariant: bool = True

    def active(self, row: Row) -> bool:
        """Active for sampled rows with ``top_k > 0``."""
        return _sampled(row) and row.config.top_k > 0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Keep the top k of each active row (sparse output when every row is active)."""
        scores = contiguous(scores)
        width = scores.values.shape[1]
        flags = [on and r.config.top_k < width
                 for r, on in zip(batch.rows, active_rows(batch, self.active))]
        if not any(flags):
            return scores
        ks = [r.config.top_k if on else width for r, on in zip(batch.rows, flags)]
        k_max = max(k for k, on in zip(ks, flags) if on)
        top, columns = block_topk(scores.values, k_max)  # [B, k_max], largest first
        last = row_ints([min(k, k_max) - 1 for k in ks], top).unsqueeze(1)  # [B, 1]
        kth = top.gather(1, last).squeeze(1)  # [B], exact: only the order of ties is not
        if all(flags) and _ties_fit(scores.values, kth, last.squeeze(1) + 1):
            return _ranked(scores, columns, top, ks)
        return _threshold_mask(scores, torch.where(row_mask(flags, kth), kth, NEG_INF))


def _nucleus(scores: Scores, columns: torch.Tensor, top: torch.Tensor,
             outside: torch.Tensor) -> Scores:
    """Sparse scores of the masked ranking ``top``/``columns [B, C]``, cut to the widest
    nucleus when that saves many columns."""
    if top.shape[1] > SLICE_ABOVE:
        width = int((~outside).sum(dim=1).max())
        top, columns = top[:, :width].contiguous(), columns[:, :width]
    return Scores(top, columns_to_tokens(scores, columns).contiguous())


def _nucleus_prefix(values: torch.Tensor, top_p: torch.Tensor | float, flags: Sequence[bool]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ranking prefix that holds every active row's nucleus.

    Returns ``(top [B, C], columns [B, C], above [B, C])``, largest first, where ``above`` is
    the probability mass (float64, normalized over the whole row) ranked strictly above each
    column.
    Tries the bounded prefixes when the row is wide, then sorts the whole row.
    """
    width = values.shape[1]
    # Masses in float64: a row's nucleus must not move with the rounding of a float32 sum,
    # which differs with the layout (how many columns, which kernel path) the batch took.
    log_total = torch.logsumexp(values.double(), dim=1, keepdim=True)  # [B, 1]
    if 2 * TOP_P_PREFIXES[0] <= width:
        need = torch.where(row_mask(flags, values).unsqueeze(1), float(top_p)
                           if isinstance(top_p, float) else top_p.double(), 0.0)  # [B, 1]
        for size in TOP_P_PREFIXES:
            if 2 * size > width:
                break
            top, columns = block_topk(values, size)  # [B, size]
            probs = torch.exp(top.double() - log_total)
            mass = torch.cumsum(probs, dim=1)
            if bool((mass[:, -1:] >= need).all()):
                return top, columns, mass - probs
    top, columns = torch.sort(values, dim=1, descending=True)  # [B, N]
    probs = torch.exp(top.double() - log_total)
    return top, columns, torch.cumsum(probs, dim=1) - probs


class TopP:
    """``top_p``: keep the most likely tokens until their mass reaches ``config.top_p``."""

    name: str = "top_p"
    argmax_invariant: bool = True

    def active(self, row: Row) -> bool:
        """Active for sampled rows with ``top_p < 1``."""
        return _sampled(row) and row.config.top_p < 1.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Keep each active row's nucleus (sparse output when every row is active)."""
        scores = contiguous(scores)
        flags = active_rows(batch, self.active)
        top_p = _per_row([r.config.top_p for r in batch.rows], scores.values)
        top, columns, above = _nucleus_prefix(scores.values, top_p, flags)  # [B, C]
        outside = above >= top_p  # [B, C]
        # The most likely token always stays (its mass above is 0 < top_p), also when top_p
        # is below float32's range (1e-320 rounds to 0 in the comparison).
        outside[:, 0] = False
        keep = outside.shape[1] - outside.sum(dim=1)  # [B], a prefix of the ranking
        last = top.gather(1, (keep - 1).unsqueeze(1)).squeeze(1)  # [B]
        if all(flags) and _ties_fit(scores.values, last, keep):
            return _nucleus(scores, columns, top.masked_fill_(outside, NEG_INF), outside)
        return _threshold_mask(scores, torch.where(row_mask(flags, last), last, NEG_INF))


class MinP:
    """``min_p``: keep tokens with ``prob >= config.min_p * (largest prob)``."""

    name: str = "min_p"
    argmax_invariant: bool = True

    def active(self, row: Row) -> bool:
        """Active for sampled rows with ``min_p > 0``."""
        return _sampled(row) and row.config.min_p > 0.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Remove tokens below ``max + log(min_p)`` in each active row."""
        logs = [math.log(r.config.min_p) if self.active(r) else NEG_INF for r in batch.rows]
        best = scores.values.amax(dim=1, keepdim=True)  # [B, 1]
        values = scores.values
        values.masked_fill_(values < best + _per_row(logs, best), NEG_INF)
        return scores


class TypicalP:
    """``typical_p``: locally typical sampling (transformers' ``TypicalLogitsWarper``).

    Ranks tokens by ``|-log p - H|`` (H the entropy) and keeps the closest ones until their
    mass reaches ``config.typical_p``, plus every token tied with the last one kept.
    """

    name: str = "typical_p"
    argmax_invariant: bool = True

    def active(self, row: Row) -> bool:
        """Active for sampled rows with ``typical_p < 1``."""
        return _sampled(row) and row.config.typical_p < 1.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Mask the atypical tokens of each active row."""
        values = scores.values  # [B, N]
        flags = active_rows(batch, self.active)
        mass = row_floats([r.config.typical_p for r in batch.rows], values)  # [B]
        logp = torch.log_softmax(values, dim=1)
        p = torch.exp(logp)
        entropy = -(logp * p).nansum(dim=1, keepdim=True)  # [B, 1]
        distance = (-logp - entropy).abs()  # [B, N]
        ranked, order = torch.sort(distance, dim=1)
        reached = torch.cumsum(p.gather(1, order), dim=1) < mass.unsqueeze(1)
        last = reached.sum(dim=1).clamp_(max=values.shape[1] - 1)  # [B]
        limit = ranked.gather(1, last.unsqueeze(1))  # [B, 1]
        typical = values.masked_fill(distance > limit, NEG_INF)
        return Scores(keep_rows(typical, values, flags), scores.indices)
