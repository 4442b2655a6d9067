"""Draft proposers for speculative decoding, and the model-free one: n-gram prompt lookup.

Owns the :class:`Proposer` Protocol (what :class:`~stages.strategies.speculative.
SpeculativeStrategy` asks for its drafts), the :class:`Proposal` value and
:class:`NgramProposer`. A draft model proposer lives in :mod:`stages.strategies.draft`.

Prompt lookup (as in transformers' ``prompt_lookup_num_tokens`` and vLLM's n-gram
speculator): take the last n tokens of prompt + output, for n from ``max_n`` down to
``min_n``, find their most recent earlier occurrence, and propose the (up to) k tokens that
followed it. Each state keeps an index from n-gram to the end of its latest occurrence,
updated as tokens are committed, so a lookup is ``max_n - min_n + 1`` dictionary probes
however long the sequence is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from pipeline.errors import InvalidValueError
from pipeline.contracts.decode import Row


@attrs.frozen
class Proposal:
    """Drafts for one sequence: ``ids`` (possibly none), the probabilities ``q [len(ids), V]``
    they were drawn with (None: each was chosen deterministically, a point mass), and a
    ``note`` for the trace's ``spec.drafted`` event (e.g. the matched n-gram length)."""

    ids: tuple[int, ...] = ()
    q: torch.Tensor | None = attrs.field(default=None, eq=False)
    note: dict[str, Any] = attrs.field(factory=dict, eq=False)


@runtime_checkable
class Proposer(Protocol):
    """Proposes the drafts a speculative strategy verifies.

    Lifecycle per sequence: ``start`` once when its prompt is in the target's cache; then
    ``propose`` once per step, batched over the strategy's sequences, with each sequence's
    committed tokens (``row.output_ids``; ``row.step`` is the index of the first draft) and
    the most drafts it may return (``limits``, 0 = none); ``finish`` once when its request
    ends. States belong to the proposer (the strategy only stores them) and may be mutated by
    it. Used from the engine's thread only. A proposer never raises for one sequence's
    trouble: it proposes nothing for it and says why in the note.

    Example::

        ngram = NgramProposer(max_n=3, min_n=1)
        state = ngram.start(row)
        proposal = ngram.propose([state], [row], [4])[0]     # Proposal((12, 7), None, {"n": 2})
        ngram.finish(state)
    """

    name: str

    def start(self, row: Row) -> Any:
        """The proposer's state for a sequence whose prompt is ``row.prompt_ids``."""
        ...

    def propose(self, states: Sequence[Any], rows: Sequence[Row],
                limits: Sequence[int]) -> list[Proposal]:
        """At most ``limits[i]`` drafts to follow each sequence's committed tokens."""
        ...

    def finish(self, state: Any) -> None:
        """The sequence's request ended: release what ``state`` holds."""
        ...


@attrs.define
class NgramState:
    """One sequence's tokens (prompt + committed output) and the index of its n-grams: each
    n-gram's key maps to the position where its latest occurrence ends, for occurrences that
    end before ``indexed``."""

    tokens: list[int]
    index: dict[tuple[int, ...], int] = attrs.field(factory=dict)
    indexed: int = 0


class NgramProposer:
    """``ngram``: prompt lookup over the sequence's own tokens; drafts are point masses.

    Raises :class:`~pipeline.errors.InvalidValueError` unless ``1 <= min_n <= max_n``.

    Example::

        ngram = NgramProposer(max_n=4, min_n=1)
    """

    name: str = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise InvalidValueError("min_n", min_n, f"must be in 1..max_n ({max_n})")
        self.max_n, self.min_n = max_n, min_n

    def start(self, row: Row) -> NgramState:
        """The prompt's tokens; the index is built at the first proposal."""
        return NgramState(list(row.prompt_ids))

    def propose(self, states: Sequence[NgramState], rows: Sequence[Row],
                limits: Sequence[int]) -> list[Proposal]:
        """Each sequence's continuation of its longest recent n-gram match."""
        out = []
        for state, row, limit in zip(states, rows, limits):
            self._sync(state, row)
            out.append(self._lookup(state, limit) if limit > 0 else Proposal())
        return out

    def finish(self, state: NgramState) -> None:
        """Nothing to release."""

    def _sync(self, state: NgramState, row: Row) -> None:
        """Append the newly committed tokens and index every n-gram that ends before the
        last token (the last token's own n-grams are the query, not a match)."""
        seen = len(state.tokens) - len(row.prompt_ids)
        state.tokens.extend(row.output_ids[seen:])
        tokens, index = state.tokens, state.index
        for end in range(state.indexed, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index[tuple(tokens[end - n + 1:end + 1])] = end
        state.indexed = max(state.indexed, len(tokens) - 1)

    def _lookup(self, state: NgramState, limit: int) -> Proposal:
        tokens = state.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = state.index.get(tuple(tokens[-n:]))
            if end is not None:
                return Proposal(tuple(tokens[end + 1:end + 1 + limit]), None, {"n": n})
        return Proposal()
