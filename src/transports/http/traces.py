"""Finished requests' traces, kept in memory for ``GET /traces/{request_id}``.

Owns :class:`TraceStore` and :func:`key_fingerprint`. The store holds the event traces of the
last ``capacity`` finished requests (finished, cancelled or failed), each with the fingerprints
of the API keys that made it: only a caller presenting one of those keys can read it, and to
any other caller it does not exist (with no keys configured, anyone can, as with every
endpoint). Fingerprints, not keys, are kept.

A trace arrives on the engine thread as the completion's tuple of events and is kept as is, so
it can be read the moment its response ends; a compactor thread of the store's own then
replaces it with its JSONL text, zlib-compressed (about 0.25 KB per generated token at the
default recording level, against about 3 KB as Python objects), off both the engine thread
and the event loop. Adding the trace that makes one too many drops the oldest.
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

from pipeline.errors import TraceNotFoundError
from pipeline.events import Event, event_line

log = logging.getLogger("pipeline.http")
MEDIA_TYPE = "application/x-ndjson"
"""The content type of a trace: one JSON event per line (what ``pipeline trace`` reads)."""


def key_fingerprint(key: str) -> str:
    """What the store keeps of an API key: its sha256, never the key itself."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def encode(events: Sequence[Event]) -> bytes:
    """``events`` as JSONL bytes, one event per line, each line ending in a newline."""
    text = "".join(event_line(e) + "\n" for e in events)
    return text.encode("utf-8", "backslashreplace")  # a lone surrogate becomes a JSON escape


@attrs.define
class _Kept:
    owners: frozenset[str]
    events: Sequence[Event] | None
    packed: bytes | None = None


class TraceStore:
    """The last ``capacity`` finished requests' traces, by request id. Thread-safe.

    ``add`` is called on the engine thread and costs O(1); ``jsonl`` decompresses or encodes
    (call it off the event loop); ``close`` stops the compactor. ``capacity`` 0 keeps nothing.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
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
        (by anyone when empty); the oldest trace goes when there are too many."""
        if not self.capacity:
            return
        with self._lock:
            self._kept[request_id] = _Kept(owners, events)
            self._kept.move_to_end(request_id)
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        self._pending.put(request_id)

    def jsonl(self, request_id: str, keys: frozenset[str]) -> bytes:
        """``request_id``'s trace as JSONL for a caller presenting ``keys`` (fingerprints);
        :class:`TraceNotFoundError` when none is kept for that caller."""
        with self._lock:
            kept = self._kept.get(request_id)
            events, packed = (kept.events, kept.packed) if kept is not None else (None, None)
        if kept is None or (kept.owners and not kept.owners & keys):
            raise TraceNotFoundError(request_id, self.capacity)
        if packed is not None:
            return zlib.decompress(packed)
        assert events is not None
        return encode(events)

    def close(self) -> None:
        """Stop the compactor thread (kept traces stay readable)."""
        if self._thread is not None:
            self._pending.put(None)
            self._thread.join(10)

    def _compact(self) -> None:
        while (request_id := self._pending.get()) is not None:
            with self._lock:
                kept = self._kept.get(request_id)
                events = kept.events if kept is not None else None
            if kept is None or events is None:
                continue  # dropped meanwhile
            try:
                packed = zlib.compress(encode(events), 1)
            except Exception:  # the trace stays readable as events; the next one is packed
                log.exception("packing the trace of request %r failed", request_id)
                continue
            with self._lock:
                if self._kept.get(request_id) is kept:
                    kept.packed, kept.events = packed, None
