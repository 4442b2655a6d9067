"""The durable usage store: one SQLite row per finished, cancelled or failed request.

Owns :class:`UsageRecord` and :class:`UsageStore`. The database lives in the server's data
directory, in WAL mode with ``synchronous=FULL``: a record is on disk when its transaction
commits, so a server killed with SIGKILL keeps every record it had committed. One writer thread
owns the connection and commits records in batches; ``append`` takes a callback that runs once
the record is durable, and the HTTP handlers wait for it before sending a response's last byte.

A request that asks for several choices (``n``, or a batched completions prompt) is one row
under the response's id, with the usage its response reports (each prompt once, the
completions summed) and its choices' finish reasons joined by commas.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from pipeline.types import Completion, Usage

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, error TEXT,
    queued_s REAL NOT NULL, first_token_s REAL, total_s REAL NOT NULL, finished_at REAL NOT NULL
)"""
_COLUMNS = ("request_id", "model", "endpoint", "prompt_tokens", "completion_tokens",
            "cached_tokens", "finish_reason", "error", "queued_s", "first_token_s", "total_s",
            "finished_at")


@attrs.frozen
class UsageRecord:
    """What a request used and how long it took (seconds; ``finished_at`` is Unix time)."""

    request_id: str
    model: str
    endpoint: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: str
    error: str | None
    queued_s: float
    first_token_s: float | None
    total_s: float
    finished_at: float

    @classmethod
    def of(cls, completion: Completion, model: str, endpoint: str) -> UsageRecord:
        """The record of a completion served as ``model`` on ``endpoint``."""
        return cls.of_choices(completion.request_id, [completion], completion.usage, model,
                              endpoint)

    @classmethod
    def of_choices(cls, request_id: str, completions: Sequence[Completion], usage: Usage,
                   model: str, endpoint: str) -> UsageRecord:
        """One request's record over the completions of its choices: ``usage`` as the
        response reports it; ``finish_reason`` the choices' reasons joined by commas, in
        choice order; the first error; the longest wait and total, the first first token."""
        firsts = [c.timings.first_token_s for c in completions
                  if c.timings.first_token_s is not None]
        return cls(request_id, model, endpoint, usage.prompt_tokens, usage.completion_tokens,
                   usage.cached_tokens, ",".join(c.finish_reason.value for c in completions),
                   next((c.error for c in completions if c.error is not None), None),
                   max(c.timings.queued_s for c in completions), min(firsts, default=None),
                   max(c.timings.total_s for c in completions), time.time())


Durable = Callable[[], None]
_STOP = None


class UsageStore:
    """Appends :class:`UsageRecord`\\s to ``<data_dir>/usage.sqlite3`` from a writer thread."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / "usage.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._queue: queue.SimpleQueue[tuple[UsageRecord, Durable | None] | None] = (
            queue.SimpleQueue())
        ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True,
                                        name="usage-store")
        self._thread.start()
        ready.wait()
        if self._error is not None:
            raise self._error

    def append(self, record: UsageRecord, on_durable: Durable | None = None) -> None:
        """Queue ``record``; ``on_durable`` runs on the writer thread after it commits."""
        self._queue.put((record, on_durable))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _run(self, ready: threading.Event) -> None:
        try:
            db = connect(self.path)
        except BaseException as exc:  # reported to the constructor's caller
            self._error = exc
            ready.set()
            return
        ready.set()
        with db:
            while self._write_batch(db):
                pass
        db.close()

    def _write_batch(self, db: sqlite3.Connection) -> bool:
        batch = [self._queue.get()]
        while not self._queue.empty() and len(batch) < 256:
            batch.append(self._queue.get())
        items = [item for item in batch if item is not None]
        if items:
            db.executemany(f"INSERT OR REPLACE INTO usage VALUES ({','.join('?' * 12)})",
                           [attrs.astuple(record) for record, _ in items])
            db.commit()
            for _, done in items:
                if done is not None:
                    done()
        return len(items) == len(batch)


def connect(path: str | Path) -> sqlite3.Connection:
    """Open (creating if needed) a usage database in WAL mode with full sync."""
    db = sqlite3.connect(str(path), check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute(SCHEMA)
    db.commit()
    return db


def read_records(path: str | Path) -> list[UsageRecord]:
    """Every record in a usage database (for reports and tests)."""
    db = sqlite3.connect(str(path))
    try:
        rows = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM usage").fetchall()
    finally:
        db.close()
    return [UsageRecord(*row) for row in rows]
