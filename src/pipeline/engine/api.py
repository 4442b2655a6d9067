"""What a pipeline and a supervisor use of an engine: :class:`EngineAPI`.

Owns the protocol only. Two classes provide it: :class:`~pipeline.engine.loop.Engine`, the
engine on a thread of this process, and :class:`~pipeline.engine.process.ProcessEngine`, the
same engine in a child process watched from this one. :class:`~pipeline.pipe.Pipeline` holds
either as ``engine``; the HTTP gateway's supervision (stalls, restarts, ``/health``) reads only
what is here.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from pipeline.engine.job import Job
    from pipeline.engine.loop import Stall
    from pipeline.contracts.model import Backend
    from pipeline.contracts.strategy import Strategy

T = TypeVar("T")


class EngineAPI(Protocol):
    """An engine as its users see it (:class:`~pipeline.engine.loop.Engine` documents each
    member's contract).

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
