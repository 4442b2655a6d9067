r"""The decode side of the contracts: one step's state, processors and selection.

Decode state (docs/design.md §5, state D) is explicit: the engine owns one :class:`Row` per
active request and hands a read-only :class:`Batch` of them to :class:`LogitProcessor`\s and
:class:`Selector`\s, which see the step's :class:`Scores` and return a :class:`Selection`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, overload, runtime_checkable

import attrs
import torch

from pipeline.contracts.output import TokenLogprob
from pipeline.contracts.request import GenerationConfig

# --- decode state, processors, selection --------------------------------------------------


NO_STATES: Mapping[str, Any] = MappingProxyType({})
"""The processor states of a row whose strategy keeps none (shared: a row per step each)."""


class TokenIds(Sequence[int]):
    """A fixed, read-only view of token ids that copies nothing: the first ``n`` ids of a list
    that only grows (the engine's committed output), then ``tail`` (a verified position's
    drafts). The list may grow after the view was made; the view does not. Slices are lists;
    it equals any sequence with the same ids.

    Example::

        output = [5, 6]
        ids = TokenIds(output)            # (5, 6)
        output.append(7)                  # ids is still (5, 6)
        ids.extended((9,))                # (5, 6, 9), nothing copied
    """

    __slots__ = ("_base", "_n", "_tail")

    def __init__(self, base: Sequence[int], n: int | None = None,
                 tail: Sequence[int] = ()) -> None:
        self._base = base
        self._n = len(base) if n is None else n
        self._tail = tuple(tail)

    def extended(self, more: Sequence[int]) -> TokenIds:
        """These ids followed by ``more``."""
        return TokenIds(self._base, self._n, (*self._tail, *more))

    def __len__(self) -> int:
        return self._n + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n = self._n
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            out = list(self._base[start:min(stop, n)]) if start < n else []
            if stop > n:
                out.extend(self._tail[max(start - n, 0):stop - n])
            return out
        at = index + len(self) if index < 0 else index
        if not 0 <= at < len(self):
            raise IndexError(index)
        return self._base[at] if at < n else self._tail[at - n]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self._base, self._n), self._tail)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


def with_tokens(ids: Sequence[int], more: Sequence[int]) -> Sequence[int]:
    """``ids`` followed by ``more``, copying ``ids`` only when it is not a :class:`TokenIds`."""
    return ids.extended(more) if isinstance(ids, TokenIds) else (*ids, *more)


@attrs.frozen
class Row:
    """The decode state of one request, as processors and selectors see it (read-only).

    ``output_ids`` are the selected tokens y_1..y_{t-1} (from the engine, a :class:`TokenIds`
    view of its list: fixed when the row is made, nothing copied). ``step`` is t, the 1-based index of the token about to be selected; the RNG
    cursor is (``seed``, ``stream``, ``step``). ``states`` holds, by processor name, the
    request's state of each :class:`StatefulProcessor` (empty when the strategy keeps none):
    a cache of a function of the row's ids that covers its first outputs, never a different
    answer.
    """

    request_id: str
    config: GenerationConfig
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    step: int
    seed: int
    eos_token_ids: frozenset[int]
    stream: int = 0
    states: Mapping[str, Any] = attrs.field(default=NO_STATES, eq=False, repr=False)

    def with_states(self, states: Mapping[str, Any]) -> Row:
        """This row carrying ``states`` (built directly: it runs per row per step, where
        ``attrs.evolve`` costs several times more)."""
        return Row(self.request_id, self.config, self.prompt_ids, self.output_ids, self.step,
                   self.seed, self.eos_token_ids, self.stream, states)


@attrs.frozen
class Batch:
    """The rows whose logits are being processed this step, in logits-row order."""

    rows: tuple[Row, ...]
    vocab_size: int

    def __len__(self) -> int:
        return len(self.rows)


@attrs.frozen
class Scores:
    """Logits in one of two layouts.

    Dense: ``values`` is ``[B, V]`` and column j is token j (``indices`` is None). Sparse:
    after a truncation (top-k), ``values`` is ``[B, K]`` and ``indices`` ``[B, K]`` names the
    token of each column; tokens not listed have probability zero. ``-inf`` marks a removed
    candidate in either layout.
    """

    values: torch.Tensor
    indices: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        """True in the dense layout."""
        return self.indices is None

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """The ``[B, V]`` logits, ``-inf`` for tokens outside a sparse candidate set."""
        if self.indices is None:
            return self.values
        out = torch.full((self.values.shape[0], vocab_size), float("-inf"),
                         dtype=self.values.dtype, device=self.values.device)
        return out.scatter_(1, self.indices, self.values)


@runtime_checkable
class LogitProcessor(Protocol):
    """One link of the processor chain: a pure function of (scores, batch) -> scores.

    Processors are built once per pipeline (factories reject bad arguments then) and hold no
    per-request state: per-row parameters come from ``row.config``. ``active(row)`` says
    whether the processor changes that row; the chain skips a processor no row activates.
    ``argmax_invariant`` is true when the processor can never change the most likely token
    (temperature, top-k, top-p, min-p, typical-p), so the chain may skip it for greedy rows. A
    processor may return a new ``Scores`` or modify ``scores.values`` in place; it must not
    touch rows it is not active for. Raises only for programming errors.

    Example::

        class Ban13:
            name, argmax_invariant = "ban13", False
            def active(self, row): return True
            def __call__(self, scores, batch):
                scores.to_dense(batch.vocab_size)[:, 13] = float("-inf"); return scores
    """

    name: str
    argmax_invariant: bool

    def active(self, row: Row) -> bool:
        """Whether this processor changes ``row``'s logits."""
        ...

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Process the batch's logits."""
        ...


@runtime_checkable
class StatefulProcessor(Protocol):
    """An optional capability of a processor: per-request state that advances with each
    committed token, so its per-step work does not grow with the output (the penalties keep
    the counts of what a request has seen instead of rebuilding them from its ids).

    A strategy that commits one token at a time keeps the states (``start`` when the request
    starts, ``advance`` with every committed token, ``finish`` when it ends) and hands them to
    the chain in :attr:`Row.states`. A state covers the request's first committed outputs; a
    row whose ids go further (a verified draft position) adds the rest itself, and a row with
    no state is processed from its ids alone, with the same result.
    """

    def start(self, row: Row) -> Any:
        """The state of a request at its first step (``row.output_ids`` is empty)."""
        ...

    def advance(self, state: Any, token: int) -> None:
        """Account for one committed output token."""
        ...

    def finish(self, state: Any) -> None:
        """The request ended: release what the state holds."""
        ...


@runtime_checkable
class RequestCheck(Protocol):
    """An optional capability of a processor: a check of each request before it is queued,
    for what only that processor can tell (the grammar processor: whether ``max_tokens`` can
    hold any output its grammar allows). The pipeline calls it on the caller's thread, after
    tokenization; it raises :class:`~pipeline.errors.InvalidValueError` naming the field."""

    def check_request(self, config: GenerationConfig, prompt_ids: Sequence[int]) -> None:
        """Raise when no run of ``config`` after ``prompt_ids`` could succeed."""
        ...


@attrs.frozen
class Selection:
    """What a selector chose: one token per row, and log-probabilities where asked for.

    For the trace, a selector also returns the processed ``scores`` it chose from and, per
    row, the uniform ``draws`` it consumed (None for a row it did not sample); both are
    optional, and a trace records what is given.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    scores: Scores | None = attrs.field(default=None, eq=False)
    draws: tuple[float | None, ...] = ()


@runtime_checkable
class Selector(Protocol):
    """Chooses one token per row from processed scores.

    Deterministic given (scores, batch): a sampling selector draws its uniform number for a
    row as a pure function of (``row.seed``, ``row.stream``, ``row.step``), so a request's
    draws do not depend on the batch it runs in. Logprobs are those of the processed
    distribution it selected from; returned only for rows with ``config.logprobs``.

    Example::

        sel = SamplingSelector()
        choice = sel(Scores(logits), batch)
        token = choice.token_ids[0]
    """

    name: str

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """Select one token per row."""
        ...


