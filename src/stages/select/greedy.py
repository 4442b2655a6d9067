"""``greedy``: the argmax selector, ties to the lowest token id.

Owns :class:`GreedySelector` and :func:`argmax_columns`, the argmax over either score layout
(the sampling selector uses it for its greedy rows, ``temperature < 1e-5``).
"""

from __future__ import annotations

import torch

from pipeline.contracts.decode import Batch, Scores, Selection
from stages.process.rows import columns_to_tokens
from stages.process.topk import first_argmax
from stages.select.logprobs import selection_logprobs


def argmax_columns(scores: Scores) -> torch.Tensor:
    """``[B]`` column of each row's largest score; among ties, the lowest token id's column."""
    values = scores.values  # [B, N]
    if scores.indices is None:
        return first_argmax(values)
    best = values.amax(dim=1, keepdim=True)  # [B, 1]
    beyond = torch.iinfo(torch.int64).max
    ids = torch.where(values == best, scores.indices, beyond)  # [B, K]
    return ids.argmin(dim=1)


def selection(scores: Scores, batch: Batch, columns: torch.Tensor) -> Selection:
    """The :class:`Selection` for chosen ``columns [B]`` of ``scores`` (which it carries, for
    the trace)."""
    tokens = columns_to_tokens(scores, columns.unsqueeze(1)).squeeze(1)  # [B]
    return Selection(tuple(tokens.tolist()), selection_logprobs(scores, batch, columns),
                     scores=scores)


class GreedySelector:
    """``greedy``: each row's most likely token (lowest id among equals), whatever its config.

    Example::

        choice = GreedySelector()(Scores(logits), batch)     # logits [B, V]
    """

    name: str = "greedy"

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """Select each row's argmax."""
        return selection(scores, batch, argmax_columns(scores))
