"""Token-id masks and biases: ``allowed_tokens``, ``banned_tokens``, ``logit_bias``, ``min_tokens``.

Owns the four processors that change scores by token id. None is argmax-invariant. Each works
on dense and sparse scores (a request may put them after a truncation) through
:mod:`stages.process.tokens`, and modifies ``scores.values`` in place.
"""

from __future__ import annotations

import torch

from pipeline.contracts.decode import Batch, Row, Scores
from stages.process.rows import NEG_INF, active_rows, contiguous, row_mask
from stages.process.tokens import Weights, apply_table, id_table, map_table, member_mask


def _add(values: torch.Tensor, weights: Weights) -> torch.Tensor:
    """The update that adds the weight to the score."""
    return values + weights


def _no_weight(row: Row) -> float:
    return 0.0


class AllowedTokens:
    """``allowed_tokens``: every token outside ``config.allowed_token_ids`` gets ``-inf``."""

    name: str = "allowed_tokens"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when the row has an allow-list."""
        return row.config.allowed_token_ids is not None

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Remove every token the row's allow-list does not name."""
        scores = contiguous(scores)
        flags = active_rows(batch, self.active)
        table = id_table(batch, flags, lambda r: r.config.allowed_token_ids or (),
                         _no_weight, scores.values.device)
        keep = member_mask(scores, batch.vocab_size, table)  # [B, N]
        keep |= ~row_mask(flags, keep).unsqueeze(1)
        scores.values.masked_fill_(~keep, NEG_INF)
        return scores


class BannedTokens:
    """``banned_tokens``: the tokens of ``config.banned_token_ids`` get ``-inf``."""

    name: str = "banned_tokens"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when the row bans at least one token."""
        return len(row.config.banned_token_ids) > 0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Remove the banned tokens."""
        scores = contiguous(scores)
        table = id_table(batch, active_rows(batch, self.active),
                         lambda r: r.config.banned_token_ids, _no_weight, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, None)


class LogitBias:
    """``logit_bias``: add ``config.logit_bias[token]`` to each listed token's logit."""

    name: str = "logit_bias"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when the row has a non-empty bias map."""
        return len(row.config.logit_bias) > 0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Add each row's biases."""
        scores = contiguous(scores)
        table = map_table(batch, active_rows(batch, self.active),
                          lambda r: r.config.logit_bias, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, _add)


def _min_tokens_ids(row: Row) -> frozenset[int]:
    """The ids ``min_tokens`` holds back: stop token ids, and EOS unless ``ignore_eos``."""
    stops = frozenset(row.config.stop_token_ids)
    return stops if row.config.ignore_eos else stops | row.eos_token_ids


class MinTokens:
    """``min_tokens``: while fewer than ``config.min_tokens`` tokens were selected, EOS and the
    stop token ids get ``-inf`` so the run cannot end early.

    As in vLLM, ``ignore_eos`` rows keep EOS (it does not end them) but still hold back
    ``stop_token_ids``.
    """

    name: str = "min_tokens"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active while ``len(output_ids) < min_tokens`` and there is an id to hold back."""
        return len(row.output_ids) < row.config.min_tokens and bool(_min_tokens_ids(row))

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Remove the ending tokens of the rows still under their minimum."""
        scores = contiguous(scores)
        table = id_table(batch, active_rows(batch, self.active),
                         lambda r: tuple(_min_tokens_ids(r)), _no_weight, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, None)

