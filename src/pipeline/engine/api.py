"""What a pipeline and a supervisor use of an engine: :class:`EngineAPI`, and the records it
names.

Owns the protocol, :class:`Stall` (the step in progress, for the stall watchdog),
:class:`Strategies` (a strategy per processor order, built once: the one cache both engines
use) and the constants every engine shares (:data:`ENGINE_DOWN`, :data:`MAX_CALLS`). Two
classes provide the protocol, both in :mod:`pipeline.runtime`: the engine driven by a thread
of this process (:class:`~pipeline.runtime.thread.ThreadEngine`) and the same engine in a child
process watched from this one (:class:`~pipeline.runtime.parent.ProcessEngine`).
:class:`~pipeline.pipe.Pipeline` holds either as ``engine``; the HTTP gateway's supervision
(stalls, restarts, ``/health``) reads only what is here.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import attrs

if TYPE_CHECKING:
    from pipeline.engine.job import Job
    from pipeline.contracts.model import Backend
    from pipeline.contracts.strategy import Strategy

T = TypeVar("T")
StrategyFactory = Callable[[tuple[str, ...] | None], "Strategy"]
MAX_CALLS = 256
"""The most :meth:`EngineAPI.call`\\ s waiting at once."""
ENGINE_DOWN = "the engine stopped"
"""How the error of every request an engine failed as a whole begins (its loop died or its
step stalled): the request was not at fault, and a retry on a fresh engine may succeed."""


@attrs.frozen
class Stall:
    """The step in progress: its number, how long it has run, what it is doing and for
    which requests."""

    step: int
    running_s: float
    phase: str
    request_ids: tuple[str, ...]

    def describe(self) -> str:
        """One line for ``/health``, the failed requests' errors and their usage rows: the
        step, how long, doing what, and how many requests — never which: a request id is its
        own client's, and these lines reach every client (``/health`` needs no key)."""
        return f"{self.what()} ({len(self.request_ids)} requests)"

    def describe_for_log(self) -> str:
        """:meth:`describe` with the first four request ids, for the operator's log."""
        ids = ", ".join(self.request_ids[:4]) + (" ..." if len(self.request_ids) > 4 else "")
        return f"{self.what()} ({len(self.request_ids)} requests: {ids})"

    def what(self) -> str:
        """What is stuck and for how long, without the requests."""
        return f"step {self.step} has run {self.running_s:.1f} s in {self.phase}"


class Strategies:
    """The strategy for a processor order, made by ``make`` once per distinct order (a
    fresh engine is given the same object, so it keeps what was made)."""

    def __init__(self, make: StrategyFactory) -> None:
        self.make = make
        self._made: dict[tuple[str, ...] | None, Strategy] = {}

    def __call__(self, order: tuple[str, ...] | None) -> Strategy:
        if order not in self._made:
            self._made[order] = self.make(order)
        return self._made[order]


class EngineAPI(Protocol):
    """An engine as its users see it (:class:`~pipeline.runtime.thread.ThreadEngine`
    documents each member's contract).

    ``backend`` answers the model's figures (slots, window, vocabulary, snapshot) in this
    process; ``failure`` says why the engine stopped other than by ``close`` (None while it
    runs); ``on_stop`` is called once when it does."""

    backend: Backend
    failure: str | None
    on_stop: Callable[[str], None] | None

    def submit(self, job: Job) -> None: ...

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]: ...

    def wake(self) -> None: ...

    def strategy(self, order: tuple[str, ...] | None) -> Strategy: ...

    @property
    def alive(self) -> bool: ...

    @property
    def steps(self) -> int: ...

    @property
    def active_slots(self) -> int: ...

    @property
    def queue_depth(self) -> int: ...

    def fresh(self) -> EngineAPI: ...

    def stall(self) -> Stall | None: ...

    def abandon(self, why: str) -> None: ...

    def close(self, timeout: float = 10.0) -> None: ...
