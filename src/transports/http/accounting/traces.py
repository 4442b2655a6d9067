"""Finished requests' traces, kept in memory for ``GET /traces/{request_id}``.

Owns :class:`TraceStore` and :func:`key_fingerprint`. The store holds the event traces of the
last ``capacity`` finished requests (finished, cancelled or failed), each with the fingerprints
of the API keys that made it: only a caller presenting one of those keys can read it, and to
any other caller it does not exist (with no keys configured, anyone can, as with every
endpoint). Fingerprints, not keys, are kept.

A request that asked for several choices (``n``, or a batched completions prompt) is kept as
one entry under its own id, holding each choice's trace (trace id: the choice's request id,
``{id}-{k}`` for choice ``k``): its id reads them all, one after the other in choice order
(``pipeline trace`` groups a file's events by trace id), and a choice's id reads that choice's
alone. The capacity counts requests, not choices.

A trace arrives on the engine thread as the completion's tuple of events and is kept as is, so
it can be read the moment its response ends; a compactor thread of the store's own then
replaces it with its JSONL text, zlib-compressed (about 0.25 KB per generated token at the
default recording level, against about 3 KB as Python objects), off both the engine thread
and the event loop. Adding the request that makes one too many drops the oldest.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import threading
import zlib
from collections.abc import Sequence

import attrs

from transports.http.serving_errors import TraceNotFoundError
from pipeline.events import Event, event_line

log = logging.getLogger("pipeline.serve")
MEDIA_TYPE = "application/x-ndjson"
"""The content type of a trace: one JSON event per line (what ``pipeline trace`` reads)."""


def key_fingerprint(key: str) -> str:
    """What the store keeps of an API key: its sha256, never the key itself."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def encode(events: Sequence[Event]) -> bytes:
    """``events`` as JSONL bytes, one event per line, each line ending in a newline."""
    text = "".join(event_line(e) + "\n" for e in events)
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate becomes a JSON escape


_Stored = Sequence[Event] | bytes  # one choice's trace: its events, or its packed JSONL


@attrs.define
class _Kept:
    owners: frozenset[str]
    ids: tuple[str, ...]  # each choice's request id, in choice order
    traces: tuple[_Stored, ...]  # replaced whole once packed


class TraceStore:
    """The last ``capacity`` finished requests' traces, by request id (and by choice id for a
    request of several choices). Thread-safe.

    ``add`` and ``add_choices`` are called on the engine thread and cost O(choices);
    ``jsonl`` decompresses or encodes (call it off the event loop); ``close`` stops the
    compactor. ``capacity`` 0 keeps nothing.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self._choices: dict[str, tuple[str, int]] = {}  # choice id -> (request id, index)
        self._lock = threading.Lock()
        self._pending: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if capacity:
            self._thread = threading.Thread(target=self._compact, daemon=True,
                                            name="trace-store")
            self._thread.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def add(self, request_id: str, owners: frozenset[str], events: Sequence[Event]) -> None:
        """Keep ``events`` as ``request_id``'s trace, readable with any key in ``owners``
        (by anyone when empty); the oldest request's traces go when there are too many."""
        self.add_choices(request_id, owners, [(request_id, events)])

    def add_choices(self, request_id: str, owners: frozenset[str],
                    choices: Sequence[tuple[str, Sequence[Event]]]) -> None:
        """Keep the traces of ``request_id``'s choices (each ``(choice id, events)``, in
        choice order) as one request, readable with any key in ``owners`` (by anyone when
        empty): by ``request_id`` all of them, by a choice's id that choice's."""
        if not self.capacity or not choices:
            return
        ids = tuple(choice_id for choice_id, _ in choices)
        with self._lock:
            self._drop(request_id)
            self._kept[request_id] = _Kept(owners, ids, tuple(e for _, e in choices))
            for index, choice_id in enumerate(ids):
                if choice_id != request_id:
                    self._choices[choice_id] = (request_id, index)
            while len(self._kept) > self.capacity:
                self._drop(next(iter(self._kept)))
        self._pending.put(request_id)

    def _drop(self, request_id: str) -> None:
        """Forget ``request_id`` and its choices' ids (hold the lock)."""
        kept = self._kept.pop(request_id, None)
        if kept is not None:
            for index, choice_id in enumerate(kept.ids):
                if self._choices.get(choice_id) == (request_id, index):
                    del self._choices[choice_id]

    def jsonl(self, request_id: str, keys: frozenset[str]) -> bytes:
        """The trace of ``request_id`` (a request: every choice's; a choice: its own) as
        JSONL for a caller presenting ``keys`` (fingerprints); :class:`TraceNotFoundError`
        when none is kept for that caller."""
        index: int | None = None
        with self._lock:
            kept = self._kept.get(request_id)
            if kept is None and request_id in self._choices:
                owner_id, index = self._choices[request_id]
                kept = self._kept[owner_id]
            owners, traces = (kept.owners, kept.traces) if kept is not None else (None, ())
        if owners is None or (owners and not owners & keys):
            raise TraceNotFoundError(request_id, self.capacity)
        chosen = traces if index is None else (traces[index],)
        return b"".join(zlib.decompress(t) if isinstance(t, bytes) else encode(t)
                        for t in chosen)

    def close(self) -> None:
        """Stop the compactor thread (kept traces stay readable)."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(10)

    def _compact(self) -> None:
        while (request_id := self._pending.get()) is not None:
            with self._lock:
                kept = self._kept.get(request_id)
                traces = kept.traces if kept is not None else None
            if kept is None or traces is None:
                continue  # dropped meanwhile
            try:
                packed = tuple(t if isinstance(t, bytes) else zlib.compress(encode(t), 1)
                               for t in traces)
            except Exception:  # the trace stays readable as events; the next one is packed
                log.exception("packing the trace of request %r failed", request_id)
                continue
            with self._lock:
                if self._kept.get(request_id) is kept:
                    kept.traces = packed
