"""``sample``: inverse-CDF sampling with counter-based uniforms; argmax for greedy rows.

Owns :class:`SamplingSelector` and :func:`inverse_cdf`. For a sampled row the selector takes
the softmax of its processed scores over the candidates (dense or sparse), accumulates it in
float64 and picks the first column whose cumulative mass exceeds ``u * total``, with
``u = uniform(row.seed, row.stream, row.step)``. A zero-probability candidate can never be
picked, and the draw does not depend on the other rows of the batch.
"""

from __future__ import annotations

import torch

from pipeline.protocols import Batch, Scores, Selection
from stages.select.greedy import argmax_columns, selection
from stages.select.rng import row_uniforms


def inverse_cdf(values: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B]`` column drawn from ``softmax(values [B, N])`` by the uniforms ``u [B]``.

    Picks the first column with ``cdf > u * cdf[-1]``, never past the last column with
    positive mass. (A row with no finite score, which no request can produce through the
    built-in processors, gets a valid but arbitrary column.)
    """
    probs = torch.softmax(values, dim=1)  # [B, N]
    cdf = torch.cumsum(probs, dim=1, dtype=torch.float64)  # [B, N]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    picked = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)  # [B, 1]
    last = torch.searchsorted(cdf, total).clamp_(max=values.shape[1] - 1)  # last with mass
    return torch.minimum(picked, last).squeeze(1)


def _sampled_columns(scores: Scores, batch: Batch, sampled: list[int]) -> torch.Tensor:
    """Columns drawn for the rows ``sampled`` (indices into the batch)."""
    values = scores.values
    if len(sampled) == len(batch.rows):
        return inverse_cdf(values, row_uniforms(batch.rows, values.device))
    index = torch.tensor(sampled, device=values.device)
    rows = [batch.rows[i] for i in sampled]
    return inverse_cdf(values.index_select(0, index), row_uniforms(rows, values.device))


class SamplingSelector:
    """``sample``: draw each row's token from its processed distribution.

    Rows with ``temperature == 0`` take the argmax (lowest id among ties). Each other row
    draws with ``uniform(row.seed, row.stream, row.step)``; logprobs come from the same
    processed scores.

    Example::

        choice = SamplingSelector()(chain(Scores(logits), batch), batch)
        choice.token_ids[0], choice.logprobs[0]
    """

    name: str = "sample"

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """Select one token per row."""
        sampled = [i for i, r in enumerate(batch.rows) if not r.config.greedy]
        if not sampled:
            return selection(scores, batch, argmax_columns(scores))
        drawn = _sampled_columns(scores, batch, sampled)  # [S]
        if len(sampled) == len(batch.rows):
            return selection(scores, batch, drawn)
        columns = argmax_columns(scores)  # [B]
        columns[torch.tensor(sampled, device=columns.device)] = drawn
        return selection(scores, batch, columns)
