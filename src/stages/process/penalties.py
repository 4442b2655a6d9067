"""Repetition penalties: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``.

Owns the three processors that penalize tokens a row has already seen. Semantics:

- ``repetition_penalty`` (Hugging Face / vLLM): every distinct token of prompt + output gets
  ``s / p`` when its logit ``s > 0`` and ``s * p`` otherwise, once however often it occurs;
- ``presence_penalty`` (OpenAI): ``s - presence`` for every token the output holds;
- ``frequency_penalty`` (OpenAI): ``s - frequency * count`` with count the token's occurrences
  in the output.

None is argmax-invariant; all work on dense and sparse scores, in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.protocols import Batch, Row, Scores
from stages.process.rows import active_rows, contiguous
from stages.process.tokens import Weights, apply_table, count_table, id_table


def _seen(row: Row) -> Sequence[int]:
    """Prompt and output ids of ``row``; a repeated id is penalized once, because the table's
    update is computed from the original score."""
    return (*row.prompt_ids, *row.output_ids)


def _outputs(row: Row) -> Sequence[int]:
    return row.output_ids


def _repetition(values: torch.Tensor, penalty: Weights) -> torch.Tensor:
    """Divide positive logits by the penalty and multiply the others by it."""
    return torch.where(values > 0, values / penalty, values * penalty)


def _subtract(values: torch.Tensor, amount: Weights) -> torch.Tensor:
    return values - amount


class RepetitionPenalty:
    """``repetition_penalty``: scale the logits of tokens in prompt + output by ``1/p`` or ``p``."""

    name: str = "repetition_penalty"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``repetition_penalty != 1``."""
        return row.config.repetition_penalty != 1.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Penalize every distinct token each row has seen."""
        scores = contiguous(scores)
        table = id_table(batch, active_rows(batch, self.active), _seen,
                         lambda r: r.config.repetition_penalty, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, _repetition)


class PresencePenalty:
    """``presence_penalty``: subtract ``presence`` from each token the output already holds."""

    name: str = "presence_penalty"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``presence_penalty != 0``."""
        return row.config.presence_penalty != 0.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Subtract each row's presence penalty from its output tokens."""
        scores = contiguous(scores)
        table = id_table(batch, active_rows(batch, self.active), _outputs,
                         lambda r: r.config.presence_penalty, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, _subtract)


class FrequencyPenalty:
    """``frequency_penalty``: subtract ``frequency * count`` for each output token."""

    name: str = "frequency_penalty"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``frequency_penalty != 0``."""
        return row.config.frequency_penalty != 0.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Subtract each row's frequency penalty times the token's output count."""
        scores = contiguous(scores)
        flags = active_rows(batch, self.active)
        counts = count_table(batch, flags, _outputs, scores.values.device)
        if counts.empty:
            return scores
        per_row = torch.tensor([r.config.frequency_penalty if on else 0.0
                                for r, on in zip(batch.rows, flags)],
                               dtype=torch.float32, device=scores.values.device)  # [B]
        amount = per_row[counts.keys // batch.vocab_size] * counts.weights  # [P]
        return apply_table(scores, batch.vocab_size, counts._replace(weights=amount), _subtract)
