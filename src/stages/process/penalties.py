"""Repetition penalties: ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``.

Owns the three processors that penalize tokens a row has already seen. Semantics:

- ``repetition_penalty`` (Hugging Face / vLLM): every distinct token of prompt + output gets
  ``s / p`` when its logit ``s > 0`` and ``s * p`` otherwise, once however often it occurs;
- ``presence_penalty`` (OpenAI): ``s - presence`` for every token the output holds;
- ``frequency_penalty`` (OpenAI): ``s - frequency * count`` with count the token's occurrences
  in the output.

None is argmax-invariant; all work on dense and sparse scores, in place.

Each is a :class:`~pipeline.contracts.decode.StatefulProcessor`: a request's state is a
:class:`TokenCounts`, the counts of what it has seen (prompt and output for the repetition
penalty, output for the other two) and its distinct tokens, kept on the scores' device and
advanced per committed token, so a step touches the distinct tokens on the device instead of
rebuilding tables from the whole history in Python. ``benchmarks/penalty_history.py``, three
penalties over four rows at V = 49,152 on one thread: 0.60 / 0.73 / 1.2 / 2.5 ms per step
after 100 / 1,000 / 4,000 / 16,000 random output tokens, against 0.31 / 0.91 / 2.9 / 9.2 ms
rebuilding from the ids (the state path costs more below about a thousand tokens: a few
small device operations per row). A row the state does not cover (a verified draft position adds its drafts; a row with
no state) gets the same answer from its ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.contracts.decode import Batch, Row, Scores
from stages.process.rows import active_rows, contiguous
from stages.process.tokens import Weights, apply_table, count_table, id_table


class TokenCounts:
    """How often each token occurs in a request's ids so far, kept on the scores' device
    from the first use on: ``counts [V]`` float32, and ``ids``, the distinct tokens seen
    (the positions a penalty touches), in a buffer that doubles as it fills. Tokens added
    since the last use wait in ``pending``; ``outputs`` is how many output tokens it covers.
    A step then costs O(distinct tokens) on the device, with no pass over the history."""

    def __init__(self, initial: Sequence[int]) -> None:
        self.pending: list[int] = list(initial)
        self.outputs = 0
        self.counts: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None
        self._distinct = 0
        self._seen: set[int] = set()

    def add(self, token: int) -> None:
        """One more output token."""
        self.pending.append(token)
        self.outputs += 1

    def tensor(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct ids seen ``[n]`` and the counts ``[vocab]``, with every token added
        so far (ids outside ``[0, vocab)`` ignored)."""
        if self.counts is None or self._ids is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._ids = torch.empty(64, dtype=torch.int64, device=device)
        if self.pending:
            valid = [t for t in self.pending if 0 <= t < vocab]
            self.pending.clear()
            if valid:
                at = torch.tensor(valid, dtype=torch.int64).to(device)
                self.counts.index_put_((at,), torch.ones(len(valid), device=device),
                                       accumulate=True)
                new = [t for t in dict.fromkeys(valid) if t not in self._seen]
                self._seen.update(new)
                self._append(new, device)
        return self._ids[:self._distinct], self.counts

    def _append(self, new: list[int], device: torch.device) -> None:
        assert self._ids is not None
        need = self._distinct + len(new)
        if need > self._ids.numel():
            grown = torch.empty(max(need, 2 * self._ids.numel()), dtype=torch.int64,
                                device=device)
            grown[:self._distinct] = self._ids[:self._distinct]
            self._ids = grown
        if new:
            self._ids[self._distinct:need] = torch.tensor(new, dtype=torch.int64).to(device)
        self._distinct = need


def _tail_counts(columns: torch.Tensor, tail: Sequence[int]) -> torch.Tensor:
    """How often each of ``columns`` (token ids) occurs in ``tail``."""
    t = torch.tensor(tail, dtype=torch.int64).to(columns.device)
    return (columns.unsqueeze(1) == t.unsqueeze(0)).sum(1).to(torch.float32)


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


class _Counted:
    """What the three penalties share: their per-request :class:`TokenCounts`, and the rows
    of a batch those answer for (the rest are processed from their ids)."""

    name: str
    with_prompt = False

    def start(self, row: Row) -> TokenCounts:
        """Counts of the prompt (repetition) or of nothing yet (presence, frequency)."""
        return TokenCounts(row.prompt_ids if self.with_prompt else ())

    def advance(self, state: TokenCounts, token: int) -> None:
        """Count a committed token."""
        state.add(token)

    def finish(self, state: TokenCounts) -> None:
        """Drop the counts."""
        state.counts = None

    def _by_state(self, scores: Scores, batch: Batch, flags: list[bool],
                  update: Callable[[torch.Tensor, torch.Tensor, Row], torch.Tensor]
                  ) -> list[bool]:
        """Apply ``update(values, counts, row)`` at the columns of each flagged row whose
        state covers it (a dense row: the tokens it has seen; a sparse row: all its
        columns); returns the flags of the rows left for the ids path."""
        left = list(flags)
        values, device = scores.values, scores.values.device
        for b, row in enumerate(batch.rows):
            state: Any = row.states.get(self.name) if flags[b] else None
            if not isinstance(state, TokenCounts) or state.outputs > len(row.output_ids):
                continue
            ids, counts = state.tensor(batch.vocab_size, device)
            tail = [t for t in row.output_ids[state.outputs:] if 0 <= t < batch.vocab_size]
            if scores.indices is not None:       # the row's K columns, whatever they hold
                columns = scores.indices[b]
                at: torch.Tensor = torch.arange(columns.numel(), device=device)
            else:                                # the tokens seen (and a position's drafts)
                columns = torch.unique(torch.cat([ids, torch.tensor(
                    tail, dtype=torch.int64).to(device)])) if tail else ids
                at = columns
            c = counts[columns]
            if tail:
                c = c + _tail_counts(columns, tail)
            values[b, at] = update(values[b, at], c, row)
            left[b] = False
        return left


class RepetitionPenalty(_Counted):
    """``repetition_penalty``: scale the logits of tokens in prompt + output by ``1/p`` or ``p``."""

    name: str = "repetition_penalty"
    argmax_invariant: bool = False
    with_prompt = True

    def active(self, row: Row) -> bool:
        """Active when ``repetition_penalty != 1``."""
        return row.config.repetition_penalty != 1.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Penalize every distinct token each row has seen."""
        scores = contiguous(scores)

        def update(v: torch.Tensor, counts: torch.Tensor, row: Row) -> torch.Tensor:
            p = row.config.repetition_penalty
            return torch.where(counts > 0, _repetition(v, p), v)

        flags = self._by_state(scores, batch, active_rows(batch, self.active), update)
        table = id_table(batch, flags, _seen,
                         lambda r: r.config.repetition_penalty, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, _repetition)


class PresencePenalty(_Counted):
    """``presence_penalty``: subtract ``presence`` from each token the output already holds."""

    name: str = "presence_penalty"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``presence_penalty != 0``."""
        return row.config.presence_penalty != 0.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Subtract each row's presence penalty from its output tokens."""
        scores = contiguous(scores)

        def update(v: torch.Tensor, counts: torch.Tensor, row: Row) -> torch.Tensor:
            return v - (counts > 0).to(v.dtype) * row.config.presence_penalty

        flags = self._by_state(scores, batch, active_rows(batch, self.active), update)
        table = id_table(batch, flags, _outputs,
                         lambda r: r.config.presence_penalty, scores.values.device)
        return apply_table(scores, batch.vocab_size, table, _subtract)


class FrequencyPenalty(_Counted):
    """``frequency_penalty``: subtract ``frequency * count`` for each output token."""

    name: str = "frequency_penalty"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``frequency_penalty != 0``."""
        return row.config.frequency_penalty != 0.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Subtract each row's frequency penalty times the token's output count."""
        scores = contiguous(scores)

        def update(v: torch.Tensor, counts: torch.Tensor, row: Row) -> torch.Tensor:
            return v - counts.to(v.dtype) * row.config.frequency_penalty

        flags = self._by_state(scores, batch, active_rows(batch, self.active), update)
        counts = count_table(batch, flags, _outputs, scores.values.device)
        if counts.empty:
            return scores
        per_row = torch.tensor([r.config.frequency_penalty if on else 0.0
                                for r, on in zip(batch.rows, flags)],
                               dtype=torch.float32, device=scores.values.device)  # [B]
        amount = per_row[counts.keys // batch.vocab_size] * counts.weights  # [P]
        return apply_table(scores, batch.vocab_size, counts._replace(weights=amount), _subtract)
