"""The stopper registry and :class:`StopperChain`, which runs several stoppers as one.

It owns ``STOPPERS`` (a read-only map from name to class, each with a zero-argument
constructor) and :func:`make_stopper`; the names and order ``build`` uses are
:data:`pipeline.registry.DEFAULT_STOPPERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from pipeline.errors import UnknownNameError
from pipeline.contracts.text import StopContext, Stopper, StopVerdict
from pipeline.contracts.request import Request
from pipeline.registry import DEFAULT_STOPPERS
from stages.stop.strings import StopStringStopper
from stages.stop.tokens import DeadlineStopper, EosStopper, MaxTokensStopper

STOPPERS: Mapping[str, Callable[[], Stopper[Any]]] = MappingProxyType({
    "eos": EosStopper,
    "max_tokens": MaxTokensStopper,
    "stop_strings": StopStringStopper,
    "deadline": DeadlineStopper,
})
"""Every built-in stopper by name (read-only)."""


def make_stopper(name: str) -> Stopper[Any]:
    """A new stopper registered as ``name``; :class:`~pipeline.errors.UnknownNameError` if none."""
    try:
        factory = STOPPERS[name]
    except KeyError:
        raise UnknownNameError("stopper", name, STOPPERS) from None
    return factory()


class StopperChain:
    """Several stoppers run as one; its state is the tuple of their states.

    ``check_token`` returns the first verdict in chain order. ``check_text`` passes the text
    through each stopper in order, each receiving what the one before released. When one
    returns a verdict the run ends, so the stoppers after it are called once more with
    ``final=True`` to release what they hold (text that came before the match); a verdict of
    theirs wins, since it lies earlier in the text. The chain satisfies
    :class:`pipeline.contracts.text.Stopper` itself.

    Example::

        chain = StopperChain.from_names()
        st = chain.start(request, StopContext(frozenset({2}), time.monotonic_ns()))
        verdict = chain.check_token(st, token_id, generated=1)
        st, released, verdict = chain.check_text(st, piece, final=verdict is not None)
    """

    name = "chain"

    def __init__(self, stoppers: Sequence[Stopper[Any]]) -> None:
        self.stoppers = tuple(stoppers)

    @classmethod
    def from_names(cls, names: Sequence[str] = DEFAULT_STOPPERS) -> StopperChain:
        """A chain of the named built-in stoppers, in order."""
        return cls([make_stopper(n) for n in names])

    def start(self, request: Request, context: StopContext) -> tuple[Any, ...]:
        """Every stopper's initial state."""
        return tuple(s.start(request, context) for s in self.stoppers)

    def check_token(self, state: tuple[Any, ...], token_id: int,
                    generated: int) -> StopVerdict | None:
        """The first stopper's verdict on the token, in chain order."""
        for stopper, st in zip(self.stoppers, state):
            verdict = stopper.check_token(st, token_id, generated)
            if verdict is not None:
                return verdict
        return None

    def check_text(self, state: tuple[Any, ...], text: str, final: bool
                   ) -> tuple[tuple[Any, ...], str, StopVerdict | None]:
        """Chain ``text`` through every stopper; see the class docstring for verdicts."""
        states = list(state)
        verdict: StopVerdict | None = None
        for i, stopper in enumerate(self.stoppers):
            states[i], text, found = stopper.check_text(states[i], text, final)
            if found is not None:
                verdict, final = found, True
        return tuple(states), text, verdict
