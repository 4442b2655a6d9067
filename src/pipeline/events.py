"""Events and the per-request trace (docs/design.md §7).

Owns the :class:`Event` value type, content digests, the sinks that receive events (in memory,
JSON lines) and :class:`Tracer`, which numbers the events of one request. ``event_id`` is
monotonic per trace and *is* the causal order; ``monotonic_ns`` is for latency only. Payloads
hold versions, shapes, lengths and digests; text and tensors only at ``Recording.FULL``.

Also owns how long a written trace lasts (:data:`DURABILITY`): by default :class:`JsonlSink`
hands every event to the operating system as it is emitted and fsyncs the tool boundary's
commits and outcomes (:data:`LEDGER_EVENTS`) as the ledger does, the commit before the effect
runs, so the trace of a killed process still shows every call that crossed the commit
boundary, as the tool ledger does.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import attrs

from pipeline.errors import InvalidValueError

PAYLOAD_SCHEMA_VERSION = 1

MINIMAL_TIMELINE = (
    "request.accepted", "request.normalized", "context.rendered", "input.tokenized",
    "prefill.started", "prefill.completed", "token.selected", "stream.delta",
    "decode.completed", "generation.finished", "resources.released",
)
"""The event types every completed generation emits, in this causal order (docs/design.md §7)."""


def digest_bytes(data: bytes) -> str:
    """``sha256:`` + hex digest of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest_text(text: str) -> str:
    """Digest of the UTF-8 bytes of ``text``."""
    return digest_bytes(text.encode("utf-8"))


def digest_ids(ids: Sequence[int]) -> str:
    """Digest of a token-id sequence (as little-endian int64, so it is layout-independent)."""
    return digest_bytes(b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids))


def digest_json(value: Any) -> str:
    """Digest of a JSON value in canonical form (sorted keys, no spaces)."""
    return digest_text(json.dumps(value, sort_keys=True, separators=(",", ":"), default=str))


@attrs.frozen
class Event:
    """One thing that happened to a request, at a point in its causal order."""

    trace_id: str
    event_id: int
    parent_event_id: int | None
    component: str
    event_type: str
    monotonic_ns: int
    payload: Mapping[str, Any]
    payload_schema_version: int = PAYLOAD_SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON-ready mapping (one line of a JSONL trace)."""
        return {
            "trace_id": self.trace_id, "event_id": self.event_id,
            "parent_event_id": self.parent_event_id, "component": self.component,
            "event_type": self.event_type, "monotonic_ns": self.monotonic_ns,
            "payload_schema_version": self.payload_schema_version,
            "payload": dict(self.payload),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        """Inverse of :meth:`to_json`."""
        return cls(
            trace_id=data["trace_id"], event_id=data["event_id"],
            parent_event_id=data["parent_event_id"], component=data["component"],
            event_type=data["event_type"], monotonic_ns=data["monotonic_ns"],
            payload=data["payload"], payload_schema_version=data["payload_schema_version"],
        )


@runtime_checkable
class EventSink(Protocol):
    """Receives every event of every request, in each trace's causal order.

    ``emit`` is called from the engine thread and from submitting threads; an implementation
    must be thread-safe and fast (it sits on the per-token path). ``close`` flushes.
    """

    def emit(self, event: Event) -> None:
        """Record one event."""

    def close(self) -> None:
        """Flush and release resources; no ``emit`` follows."""


class MemorySink:
    """Keeps every event in a list (for tests and notebooks)."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Append ``event``."""
        with self._lock:
            self._events.append(event)

    def close(self) -> None:
        """Nothing to flush."""

    @property
    def events(self) -> list[Event]:
        """A copy of what was received, in arrival order."""
        with self._lock:
            return list(self._events)


DURABILITY = ("none", "flush", "fsync-boundary", "fsync")
"""How hard a :class:`JsonlSink` works to keep its events, weakest first:

- ``none``: events go through a write buffer, written when it fills and on ``close``; a
  process that is killed loses up to a buffer of events and may leave a torn last line.
- ``flush``: each event is handed to the operating system (one ``write``) before ``emit``
  returns: the trace survives the process being killed (SIGKILL, the OOM killer), not a
  power loss or a kernel crash.
- ``fsync-boundary`` (the default): ``flush``, and each event the tool ledger also records
  (:data:`LEDGER_EVENTS`: a commit, an outcome, a compensation) is fsynced, with everything
  written before it, before ``emit`` returns. ``tool.committed`` is emitted before the
  effect runs, so the call's validation, authorization and commit are on disk before it;
  the trace is as durable as the ledger at each of the ledger's writes, and survives a power
  loss where the ledger does.
- ``fsync``: every event is fsynced (for audits; the slowest).

``benchmarks/trace_durability.py`` measures what each costs per event, per decode step and
per tool call.
"""

LEDGER_EVENTS = frozenset({"tool.committed", "tool.executed", "tool.failed",
                           "tool.compensated"})
"""The tool boundary's events that match a durable record of the tool ledger
(:mod:`pipeline.tools.ledger`): the ones ``fsync-boundary`` fsyncs."""


class JsonlSink:
    """Appends each event as one JSON line to a file (``pipeline trace`` reads these), as
    durably as ``durability`` says (one of :data:`DURABILITY`).

    Opening a file whose last line a crash left unfinished cuts that line off (a line that is
    whole but for its newline is finished instead), so appending after a crash never glues
    two events together. A file has one writer at a time, or several at ``flush`` or above
    (their lines are single writes, so they interleave whole).
    """

    def __init__(self, path: str | Path, *, durability: str = "fsync-boundary") -> None:
        if durability not in DURABILITY:
            raise InvalidValueError("durability", durability,
                                    "must be one of " + ", ".join(DURABILITY))
        self.path = Path(path)
        self.durability = durability
        self._unsynced_folder = _mend_tail(self.path)
        self._file: IO[bytes] = self.path.open("ab", buffering=-1 if durability == "none"
                                               else 0)
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        """Write ``event`` as a line, as durably as the sink's level says."""
        data = (event_line(event) + "\n").encode("utf-8")
        sync = self.durability == "fsync" or (self.durability == "fsync-boundary"
                                              and event.event_type in LEDGER_EVENTS)
        with self._lock:
            view = memoryview(data)
            while view:  # unbuffered writes may be partial
                written = self._file.write(view)
                view = view[written if written is not None else len(view):]
            if sync:
                self._sync()

    def _sync(self) -> None:
        os.fsync(self._file.fileno())
        if self._unsynced_folder:  # a new file's name is durable once its folder is synced
            sync_folder(self.path.parent)
            self._unsynced_folder = False

    def close(self) -> None:
        """Flush (and at the fsync levels, fsync) and close the file."""
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                if self.durability.startswith("fsync"):
                    self._sync()
                self._file.close()


def _mend_tail(path: Path) -> bool:
    """Finish or cut off a last line a crash left unfinished; True when there is no file
    yet (its folder then needs a sync for the file to be durable)."""
    try:
        f = path.open("r+b")
    except FileNotFoundError:
        return True
    with f:
        end = f.seek(0, os.SEEK_END)
        at = end
        while at > 0:  # back to the last newline, a block at a time
            size = min(65536, at)
            f.seek(at - size)
            block = f.read(size)
            newline = block.rfind(b"\n")
            if newline >= 0:
                at = at - size + newline + 1
                break
            at -= size
        if at == end:
            return False
        f.seek(at)
        try:
            json.loads(f.read())
        except ValueError:
            f.truncate(at)
        else:
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return False


def sync_folder(folder: Path) -> None:
    """fsync ``folder``, so the names of files just made in it survive a power loss."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def event_line(event: Event) -> str:
    """``event`` as one line of a JSONL trace (no newline): what :class:`JsonlSink` writes and
    :func:`read_jsonl` reads."""
    return json.dumps(event.to_json(), ensure_ascii=False, default=str)


def read_jsonl(path: str | Path) -> list[Event]:
    """Events of a JSONL trace file, in file order (its last line must be whole: open a
    :class:`JsonlSink` on a crashed process's file first to mend it)."""
    with Path(path).open(encoding="utf-8") as f:
        return [Event.from_json(json.loads(line)) for line in f if line.strip()]


class Tracer:
    """Numbers and dispatches the events of one trace (one request).

    ``emit`` returns the new event's id so a caller can pass it as a later event's parent.
    """

    def __init__(self, trace_id: str, sinks: Iterable[EventSink] = ()) -> None:
        self.trace_id = trace_id
        self._sinks = tuple(sinks)
        self._ids = itertools.count(1)
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def emit(self, component: str, event_type: str, payload: Mapping[str, Any],
             parent: int | None = None) -> int:
        """Record an event now; returns its ``event_id``."""
        with self._lock:
            event = Event(self.trace_id, next(self._ids), parent, component, event_type,
                          time.monotonic_ns(), payload)
            self._events.append(event)
        for sink in self._sinks:
            sink.emit(event)
        return event.event_id

    @property
    def events(self) -> tuple[Event, ...]:
        """The trace so far, in causal order."""
        with self._lock:
            return tuple(self._events)

    def adopt(self, events: Sequence[Event]) -> None:
        """Take the events of this trace recorded elsewhere (an engine in another process
        that went on from this tracer's events): those after the last one here are appended
        and handed to the sinks."""
        with self._lock:
            last = max((e.event_id for e in self._events), default=0)
            new = [e for e in events if e.trace_id == self.trace_id and e.event_id > last]
            self._events.extend(new)
            if new:
                self._ids = itertools.count(new[-1].event_id + 1)
        for event in new:
            for sink in self._sinks:
                sink.emit(event)

    @classmethod
    def resume(cls, events: Sequence[Event], sinks: Iterable[EventSink] = ()) -> Tracer:
        """A tracer that goes on with the finished trace ``events`` (same trace id, ids after
        the last): what happens to a request's output after it ended, such as its tool
        calls crossing the commit boundary, joins its trace."""
        tracer = cls(events[0].trace_id, sinks)
        tracer._events = list(events)
        tracer._ids = itertools.count(max(e.event_id for e in events) + 1)
        return tracer
