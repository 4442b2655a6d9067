"""Request handles and request states: what a caller holds while the engine works.

Owns :class:`RequestState` (queued → prefilling → decoding → finished | cancelled | failed,
the last three terminal) and :class:`RequestHandle`, the thread-safe meeting point between the
engine thread (which pushes deltas and the result) and any number of consumer threads or event
loops (which read deltas, wait for the result, or cancel).
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from pipeline.errors import RequestFailed
from pipeline.contracts.output import Completion, Delta, FinishReason

T = TypeVar("T")


class RequestState(enum.Enum):
    """Where a request is in its life; ``terminal`` states never change again."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """True for finished, cancelled and failed."""
        return self in (RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED)


DeltaListener = Callable[[Delta], None]
log = logging.getLogger("pipeline.engine")


def _contained(callback: Callable[[T], None], value: T) -> None:
    """Run a consumer's callback on the engine thread; its failure is logged, never raised
    (a consumer's bug must not end the engine or the other requests)."""
    try:
        callback(value)
    except Exception:
        log.exception("a request callback raised; the engine goes on")


class RequestHandle:
    """A submitted request: stream its deltas, wait for its completion, or cancel it.

    Every method is safe from any thread. ``cancel()`` works in every state: a queued request
    leaves the queue, an active one gives up its slot at the start of the next engine step; a
    terminal request ignores it. ``result()`` returns the :class:`Completion` (also for a
    cancelled request, whose ``finish_reason`` says so) and raises
    :class:`~pipeline.errors.RequestFailed` (with ``.completion``) for a failed one.
    """

    def __init__(self, request_id: str, wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self._wake = wake
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._listeners: list[DeltaListener] = []
        self._done_callbacks: list[Callable[[Completion], None]] = []
        self._completion: Completion | None = None
        self._state = RequestState.QUEUED
        self._cancel = threading.Event()

    # --- consumer side ---------------------------------------------------------------------

    @property
    def state(self) -> RequestState:
        """The current state."""
        with self._cond:
            return self._state

    @property
    def cancel_requested(self) -> bool:
        """True once ``cancel()`` was called."""
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Ask the engine to stop this request and free its slot (idempotent)."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._wake()

    def done(self) -> bool:
        """True once the request reached a terminal state."""
        with self._cond:
            return self._completion is not None

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; raises ``TimeoutError`` if ``timeout`` passes first."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not done after {timeout}s")
            completion = self._completion
        assert completion is not None
        if completion.error is not None:
            exc = RequestFailed(self.request_id, completion.error)
            exc.completion = completion  # type: ignore[attr-defined]
            raise exc
        return completion

    def deltas(self, timeout: float | None = None) -> Iterator[Delta]:
        """Deltas in order, blocking for each; ends after the final one."""
        index = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: len(self._deltas) > index, timeout):
                    raise TimeoutError(f"no delta from {self.request_id} in {timeout}s")
                delta = self._deltas[index]
            index += 1
            yield delta
            if delta.final:
                return

    def pushed(self) -> tuple[Delta, ...]:
        """The deltas pushed so far (a snapshot)."""
        with self._cond:
            return tuple(self._deltas)

    def add_listener(self, listener: DeltaListener) -> None:
        """Call ``listener`` with every delta, those already pushed first (in order).

        Listeners run on the engine thread: they must be quick and must not block
        (``loop.call_soon_threadsafe`` is the intended use).
        """
        with self._cond:
            for delta in self._deltas:
                listener(delta)
            self._listeners.append(listener)

    def add_done_callback(self, callback: Callable[[Completion], None]) -> None:
        """Call ``callback`` with the completion once the request is terminal (at once if it
        already is). Runs on the engine thread: it must be quick and must not block."""
        with self._cond:
            completion = self._completion
            if completion is None:
                self._done_callbacks.append(callback)
                return
        callback(completion)

    # --- the engine's side (a job, or the process engine's parent for a request its child
    # holds): a caller never calls these ------------------------------------------------------

    def set_state(self, state: RequestState) -> None:
        """The request moved to ``state``."""
        with self._cond:
            self._state = state

    def push(self, delta: Delta) -> None:
        """Deliver ``delta`` to the readers and listeners (nothing once complete)."""
        with self._cond:
            if self._completion is not None:  # answered already (an abandoned engine's
                return                        # step returning late): the stream has ended
            self._deltas.append(delta)
            listeners = tuple(self._listeners)
            self._cond.notify_all()
        for listener in listeners:
            _contained(listener, delta)

    def fail(self, completion: Completion) -> None:
        """End in state failed without the job's help: a final delta if none was pushed
        yet (so stream readers end), then the completion. Does nothing once complete."""
        with self._cond:
            if self._completion is not None:
                return
            pushed_final = bool(self._deltas) and self._deltas[-1].final
        if not pushed_final:
            self.push(Delta(self.request_id, len(self._deltas), "",
                            finish_reason=FinishReason.ERROR))
        self.complete(completion, RequestState.FAILED)

    def complete(self, completion: Completion, state: RequestState) -> None:
        """Complete once; a later call (a bare abort after a failed ending) changes nothing."""
        with self._cond:
            if self._completion is not None:
                return
            self._completion = completion
            self._state = state
            self._cond.notify_all()
            callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            _contained(callback, completion)
