"""Live invariant checking (docs/design.md §8: "optionally live, raising in debug mode").

Owns :class:`CheckingSink`, an event sink that gathers each request's events and runs
:func:`~pipeline.trace.check` when the request's ``resources.released`` arrives. Failing
reports are kept; ``close()`` (called by ``Pipeline.close``) raises
:class:`~pipeline.errors.InvariantViolation` when any trace failed and ``strict`` is set. It
never raises on the engine's thread: an exception there would fail requests instead of
reporting them. Checking costs a few milliseconds per request: for tests and debugging.
"""

from __future__ import annotations

import threading

from pipeline.errors import InvariantViolation
from pipeline.events import Event
from pipeline.trace.check import CheckReport, check
from pipeline.trace.invariants import Detokenize


class CheckingSink:
    """Checks every trace when its request releases its resources.

    Example::

        sink = CheckingSink(detokenize=lambda ids: tok.decode(ids))
        with build(sinks=[sink]) as pipe:      # close() raises InvariantViolation on failure
            pipe.generate("hi", recording="full")
        assert sink.checked == 1
    """

    def __init__(self, *, detokenize: Detokenize | None = None, strict: bool = True) -> None:
        self.detokenize = detokenize
        self.strict = strict
        self.checked = 0
        self._open: dict[str, list[Event]] = {}
        self._failed: list[CheckReport] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Collect ``event``; check its trace once the request has released its resources."""
        with self._lock:
            events = self._open.setdefault(event.trace_id, [])
            events.append(event)
            if event.event_type != "resources.released":
                return
            del self._open[event.trace_id]
        report = check(events, detokenize=self.detokenize)
        with self._lock:
            self.checked += 1
            if not report.ok:
                self._failed.append(report)

    @property
    def failures(self) -> list[CheckReport]:
        """Reports of the traces that broke an invariant so far."""
        with self._lock:
            return list(self._failed)

    def close(self) -> None:
        """Raise :class:`InvariantViolation` if a checked trace failed (when ``strict``)."""
        failed = self.failures
        if failed and self.strict:
            raise InvariantViolation(failed, [r.render() for r in failed])
