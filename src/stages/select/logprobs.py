"""Log-probabilities of the processed distribution, for rows that ask for them.

Owns :func:`selection_logprobs`: ``log_softmax`` of the processed scores (over the candidates,
for sparse scores), the chosen token's value, and the ``config.top_logprobs`` best tokens, most
likely first. Tokens the processors removed (``-inf``) never appear among the alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pipeline.contracts.decode import Batch, Scores
from pipeline.contracts.output import TokenLogprob


def _one(logp: torch.Tensor, tokens: torch.Tensor | None, column: int, n: int) -> TokenLogprob:
    """The logprob record of one row: ``logp [N]``, ``tokens [N]`` (None: dense)."""
    token = column if tokens is None else int(tokens[column])
    top: list[TokenLogprob] = []
    if n > 0:
        values, columns = torch.topk(logp, min(n, logp.shape[0]))
        for value, col in zip(values.tolist(), columns.tolist()):
            if value != -math.inf:
                top.append(TokenLogprob(col if tokens is None else int(tokens[col]), value))
    return TokenLogprob(token, float(logp[column]), tuple(top))


def selection_logprobs(scores: Scores, batch: Batch, columns: torch.Tensor
                       ) -> tuple[TokenLogprob | None, ...]:
    """One entry per row: a :class:`TokenLogprob` where ``config.logprobs``, else None.

    ``columns [B]`` are the chosen columns of ``scores`` (token ids when dense).
    """
    wanted = [i for i, r in enumerate(batch.rows) if r.config.logprobs]
    out: list[TokenLogprob | None] = [None] * len(batch.rows)
    if not wanted:
        return tuple(out)
    index = torch.tensor(wanted, device=scores.values.device)
    logp = torch.log_softmax(scores.values.index_select(0, index), dim=1)  # [W, N]
    chosen: Sequence[int] = columns.index_select(0, index).tolist()
    for j, i in enumerate(wanted):
        tokens = None if scores.indices is None else scores.indices[i]
        out[i] = _one(logp[j], tokens, chosen[j], batch.rows[i].config.top_logprobs)
    return tuple(out)
