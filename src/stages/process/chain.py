"""The processor chain: an explicit, ordered list of logit processors.

Owns :class:`ProcessorChain`, the name-to-class table :data:`PROCESSORS` and the factory
:func:`make_processor`. The default order is :data:`pipeline.registry.DEFAULT_ORDER`; what
each processor does there, why the order is so, and where a user's processors join it are in
:func:`pipeline.build`'s docstring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from pipeline.errors import InvalidValueError, UnknownNameError
from pipeline.contracts.decode import Batch, LogitProcessor, Row, Scores, StatefulProcessor
from pipeline.registry import DEFAULT_ORDER
from stages.process.dry import DryPenalty
from stages.process.masks import AllowedTokens, BannedTokens, LogitBias, MinTokens
from stages.process.penalties import FrequencyPenalty, PresencePenalty, RepetitionPenalty
from stages.process.temperature import Temperature
from stages.process.truncation import MinP, TopK, TopP, TypicalP

PROCESSORS: Mapping[str, type[LogitProcessor]] = MappingProxyType({
    cls.name: cls for cls in (
        AllowedTokens, BannedTokens, LogitBias, MinTokens, RepetitionPenalty, PresencePenalty,
        FrequencyPenalty, DryPenalty, Temperature, TopK, TopP, MinP, TypicalP)
})
"""Built-in processor classes by name (read-only); each is built with no arguments."""


def make_processor(name: str) -> LogitProcessor:
    """A new built-in processor called ``name``; :class:`UnknownNameError` for any other."""
    if name not in PROCESSORS:
        raise UnknownNameError("processor", name, PROCESSORS)
    return PROCESSORS[name]()


def _applies(processor: LogitProcessor, row: Row) -> bool:
    """Whether ``processor`` changes ``row``: active, and not an argmax-invariant one on a
    greedy row (the argmax is all a greedy row needs)."""
    if processor.argmax_invariant and row.config.greedy:
        return False
    return processor.active(row)


class ProcessorChain:
    """Applies processors in their declared order to a batch's scores.

    A processor runs when it applies to at least one row; argmax-invariant processors are
    skipped outright when every row is greedy, and never count as applied to a greedy row
    (the built-ins report greedy rows inactive, so a greedy row's processed scores do not
    depend on its batch). Processors may modify ``scores.values`` in place, so the caller's
    logits tensor may change. Names must be unique (:class:`InvalidValueError` otherwise).

    Example::

        chain = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])
        processed = chain(Scores(logits), batch)     # logits [B, V]
        chain.order_for(batch.rows[0])               # ("temperature", "top_p")
    """

    def __init__(self, processors: Sequence[LogitProcessor]) -> None:
        names = [p.name for p in processors]
        if len(set(names)) != len(names):
            raise InvalidValueError("processors", names, "processor names must be unique")
        self._processors = tuple(processors)
        self._stateful = tuple(p for p in processors if isinstance(p, StatefulProcessor))

    @property
    def names(self) -> tuple[str, ...]:
        """The processors' names in declared order."""
        return tuple(p.name for p in self._processors)

    @property
    def processors(self) -> tuple[LogitProcessor, ...]:
        """The processors in declared order."""
        return self._processors

    def start(self, row: Row) -> dict[str, Any]:
        """The request's state of each :class:`~pipeline.contracts.decode.StatefulProcessor` of the
        chain that is active for ``row`` (by name; empty when none is)."""
        return {p.name: p.start(row) for p in self._stateful if p.active(row)}

    def advance(self, states: Mapping[str, Any], token: int) -> None:
        """Account for one committed token in every state."""
        for processor in self._stateful:
            if processor.name in states:
                processor.advance(states[processor.name], token)

    def finish(self, states: Mapping[str, Any]) -> None:
        """The request ended: let every state go."""
        for processor in self._stateful:
            if processor.name in states:
                processor.finish(states[processor.name])

    def order_for(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        return tuple(p.name for p in self._processors if _applies(p, row))

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Run every processor that applies to some row of ``batch``, in order."""
        rows = batch.rows
        all_greedy = all(r.config.greedy for r in rows)
        for processor in self._processors:
            if processor.argmax_invariant and all_greedy:
                continue
            if any(_applies(processor, r) for r in rows):
                scores = processor(scores, batch)
        return scores
