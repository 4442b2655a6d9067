"""``sample``: inverse-CDF sampling with counter-based uniforms; argmax for greedy rows.

Owns :class:`SamplingSelector` and :func:`inverse_cdf`. For a sampled row the selector
accumulates ``exp(s - max s)`` of its candidates in float64 and picks the first one whose
cumulative mass exceeds ``u * total``, with ``u = uniform(row.seed, row.stream, row.step)``.
A zero-probability candidate can never be picked.

Batch invariance: the weights are unnormalized (no row sum whose rounding depends on how many
columns the layout has), the cumulative sum always runs over the candidates in token-id order
(a sparse layout is put in that order first), and removed candidates add exactly zero, so the
same ``u`` picks the same token whether the row's scores arrive dense or sparse, with any
number of padding columns, whatever else is in the batch (float64 ``exp`` may differ by one
unit in the last place between a vectorized and a scalar path: a draw within ~1e-16 of a
bin edge).
"""

from __future__ import annotations

import attrs
import torch

from pipeline.contracts.decode import Batch, Scores, Selection
from stages.select.greedy import argmax_columns, selection
from stages.select.rng import row_uniforms


def inverse_cdf(values: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B]`` column drawn from ``softmax(values [B, N])`` by the uniforms ``u [B]``.

    Picks the first column whose cumulative weight ``exp(s - max s)`` (float64) exceeds
    ``u * total``. With ``u <= 1 - 2**-52`` (see :func:`~stages.select.rng.row_uniforms`)
    that product rounds strictly below ``total``, so the column found always has positive
    probability. (A row whose every candidate was removed gets a valid but arbitrary column.)
    """
    wide = values.double()
    best = wide.amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float64).min)  # [B, 1]
    cdf = torch.cumsum(torch.exp(wide - best), dim=1)  # [B, N]
    target = cdf[:, -1:] * u.unsqueeze(1)  # [B, 1], < total
    picked = torch.searchsorted(cdf, target, right=True)  # [B, 1]
    return picked.squeeze(1).clamp_(max=values.shape[1] - 1)


def _draw(scores: Scores, u: torch.Tensor) -> torch.Tensor:
    """Columns ``[B]`` of ``scores`` drawn by ``u [B]``, the CDF taken in token-id order."""
    if scores.indices is None:
        return inverse_cdf(scores.values, u)
    order = torch.argsort(scores.indices, dim=1)  # [B, K], columns by token id
    drawn = inverse_cdf(scores.values.gather(1, order), u)  # [B]
    return order.gather(1, drawn.unsqueeze(1)).squeeze(1)


def _sampled_columns(scores: Scores, batch: Batch, sampled: list[int], u: torch.Tensor
                     ) -> torch.Tensor:
    """Columns drawn by ``u [S]`` for the rows ``sampled`` (indices into the batch)."""
    if len(sampled) == len(batch.rows):
        return _draw(scores, u)
    index = torch.tensor(sampled, device=scores.values.device)
    subset = Scores(scores.values.index_select(0, index),
                    None if scores.indices is None else scores.indices.index_select(0, index))
    return _draw(subset, u)


class SamplingSelector:
    """``sample``: draw each row's token from its processed distribution.

    Greedy rows (``temperature < 1e-5``) take the argmax (lowest id among ties). Each other row
    draws with ``uniform(row.seed, row.stream, row.step)``; logprobs come from the same
    processed scores. The selection records each row's draw (None for argmax rows).

    Example::

        choice = SamplingSelector()(chain(Scores(logits), batch), batch)
        choice.token_ids[0], choice.logprobs[0], choice.draws[0]
    """

    name: str = "sample"

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """Select one token per row."""
        sampled = [i for i, r in enumerate(batch.rows) if not r.config.greedy]
        if not sampled:
            return selection(scores, batch, argmax_columns(scores))
        u = row_uniforms([batch.rows[i] for i in sampled], scores.values.device)  # [S]
        drawn = _sampled_columns(scores, batch, sampled, u)  # [S]
        draws: list[float | None] = [None] * len(batch.rows)
        for i, value in zip(sampled, u.tolist()):
            draws[i] = value
        if len(sampled) == len(batch.rows):
            return attrs.evolve(selection(scores, batch, drawn), draws=tuple(draws))
        columns = argmax_columns(scores)  # [B]
        columns[torch.tensor(sampled, device=columns.device)] = drawn
        return attrs.evolve(selection(scores, batch, columns), draws=tuple(draws))
