"""The durable usage store: one row per finished, cancelled or failed request.

Owns :class:`UsageRecord`, :class:`UsageStore`, the :class:`UsageDatabase` protocol and its
SQLite implementation. By default the database lives in the server's data directory, in WAL
mode with ``synchronous=FULL``: a record is on disk when its transaction
commits, so a server killed with SIGKILL keeps every record it had committed. One writer thread
owns the connection and commits records in batches; ``append`` takes a callback that runs once
with ``True`` when the record is durable, or ``False`` when it could not be made durable yet.
The HTTP handlers wait for that callback (with a bound of their own) before a response's last
byte, so a response never outruns its row in the ordinary case and never waits without bound
in the bad one. Replicas that share one store write to PostgreSQL instead
(:mod:`transports.http.accounting.usage_postgres`), under the same supervision.

Supervision. The writer never dies of a write error. When a batch cannot be committed (the
database locked by another process past ``busy_timeout_s``, a full or read-only disk, an I/O
error) it logs the cause at ERROR once per outage, answers the batch's callbacks with
``False``, keeps the records in a spill queue of at most ``spill_limit`` (the oldest are dropped
beyond that, each drop counted and logged), closes the connection and retries with exponential
backoff (``backoff_s``, doubling up to ``max_backoff_s``). The first write that succeeds commits
the spill before the new records and logs the recovery. :meth:`UsageStore.health` says whether
the store is down, since when and why; the server's ``/health`` is 503 while it is, and
``/metrics`` counts durable, spilled and dropped records. At :meth:`UsageStore.close` a spill
that still cannot reach the database is appended to ``usage-spill.jsonl`` beside it (or, when
even that fails, logged record by record at ERROR), so no record vanishes silently.

A request that asks for several choices (``n``, or a batched completions prompt) is one row
under the response's id, with the usage its response reports (each prompt once, the
completions summed) and its choices' finish reasons joined by commas. ``api_keys`` holds the
sha256 fingerprints of the keys the request was made with (comma-joined, sorted; empty when the
server has no keys), so usage can be attributed to a key without storing it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from pipeline.contracts.output import Completion, Usage

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    cached_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, error TEXT,
    queued_s REAL NOT NULL, first_token_s REAL, total_s REAL NOT NULL, finished_at REAL NOT NULL,
    api_keys TEXT NOT NULL DEFAULT ''
)"""
COLUMNS = ("request_id", "model", "endpoint", "prompt_tokens", "completion_tokens",
            "cached_tokens", "finish_reason", "error", "queued_s", "first_token_s", "total_s",
            "finished_at", "api_keys")
"""The table's columns, in :class:`UsageRecord`'s field order (both stores write them)."""
_INSERT = f"INSERT OR REPLACE INTO usage ({', '.join(COLUMNS)}) VALUES ({','.join('?' * 13)})"
SPILL_FILE = "usage-spill.jsonl"
WRITE_STALL_S = 10.0
"""A write in flight longer than this makes the store's health say it is down."""
log = logging.getLogger("pipeline.serve")


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
    api_keys: str = ""

    @classmethod
    def of(cls, completion: Completion, model: str, endpoint: str) -> UsageRecord:
        """The record of a completion served as ``model`` on ``endpoint``."""
        return cls.of_choices(completion.request_id, [completion], completion.usage, model,
                              endpoint)

    @classmethod
    def of_choices(cls, request_id: str, completions: Sequence[Completion], usage: Usage,
                   model: str, endpoint: str,
                   owners: frozenset[str] = frozenset()) -> UsageRecord:
        """One request's record over the completions of its choices: ``usage`` as the
        response reports it; ``finish_reason`` the choices' reasons joined by commas, in
        choice order; the first error; the longest wait and total, the first first token;
        ``owners`` the fingerprints of the request's keys."""
        firsts = [c.timings.first_token_s for c in completions
                  if c.timings.first_token_s is not None]
        return cls(request_id, model, endpoint, usage.prompt_tokens, usage.completion_tokens,
                   usage.cached_tokens, ",".join(c.finish_reason.value for c in completions),
                   next((c.error for c in completions if c.error is not None), None),
                   max(c.timings.queued_s for c in completions), min(firsts, default=None),
                   max(c.timings.total_s for c in completions), time.time(),
                   ",".join(sorted(owners)))


Done = Callable[[bool], None]
"""Called once per record on the writer thread: ``True`` once durable, ``False`` when spilled."""


@attrs.frozen
class StoreHealth:
    """The writer's state: ``down`` is why the last write failed (None while writes succeed),
    ``down_for_s`` since when; the counters are totals since the store opened."""

    down: str | None
    down_for_s: float
    spill_depth: int
    durable: int
    spilled: int
    dropped: int


class UsageDatabase(Protocol):
    """Where the records go: one transaction a batch. ``name`` is what logs call it (never a
    password); ``write`` commits ``records`` (a record whose ``request_id`` is there already
    replaces it) or raises; ``reset`` drops a connection that failed (the next ``write``
    opens a fresh one); ``close`` ends it. Called from the writer thread only."""

    name: str

    def write(self, records: Sequence[UsageRecord]) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


class OneConnection:
    """A :class:`UsageDatabase`'s one connection (``_db``): ``reset`` drops it, quietly (it
    failed already), ``close`` too; the next ``write`` opens a fresh one."""

    _db: Any = None

    def reset(self) -> None:
        if self._db is not None:
            with contextlib.suppress(Exception):
                self._db.close()
            self._db = None

    def close(self) -> None:
        self.reset()


class SqliteUsage(OneConnection):
    """The default :class:`UsageDatabase`: ``usage.sqlite3`` in the data directory (WAL, full
    sync, ``busy_timeout_s`` for another process's lock). Opened at construction."""

    def __init__(self, path: Path, busy_timeout_s: float) -> None:
        self.path, self.busy_timeout_s, self.name = path, busy_timeout_s, path.name
        self._db: sqlite3.Connection | None = connect(path, busy_timeout_s)

    def write(self, records: Sequence[UsageRecord]) -> None:
        if self._db is None:
            self._db = connect(self.path, self.busy_timeout_s)
        self._db.executemany(_INSERT, [attrs.astuple(r) for r in records])
        self._db.commit()


class UsageStore:
    """Appends :class:`UsageRecord`\\s to ``<data_dir>/usage.sqlite3`` (or to ``database``,
    e.g. a :class:`~transports.http.accounting.usage_postgres.PostgresUsage` that replicas share) from a
    supervised writer thread. Opening fails at once (the caller learns of an unusable data
    directory or database before serving); every later failure is retried, never raised. The
    spill file goes to ``data_dir`` whatever the database."""

    def __init__(self, data_dir: str | Path, *, busy_timeout_s: float = 1.0,
                 spill_limit: int = 10_000, backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 database: UsageDatabase | None = None) -> None:
        self.path = Path(data_dir) / "usage.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s, self.spill_limit = busy_timeout_s, spill_limit
        self._backoff = (backoff_s, max_backoff_s)
        self._clock = clock
        self._queue: queue.SimpleQueue[tuple[UsageRecord, Done | None] | None] = (
            queue.SimpleQueue())
        self._spill: collections.deque[UsageRecord] = collections.deque()
        self._down: tuple[str, float] | None = None
        self._counts = {"durable": 0, "spilled": 0, "dropped": 0}
        self._writing_since: float | None = None
        self._db: UsageDatabase = (database if database is not None
                                   else SqliteUsage(self.path, busy_timeout_s))
        self._thread = threading.Thread(target=self._run, daemon=True, name="usage-store")
        self._thread.start()

    def append(self, record: UsageRecord, on_done: Done | None = None) -> None:
        """Queue ``record``; ``on_done`` runs once on the writer thread (see :data:`Done`)."""
        self._queue.put((record, on_done))

    def health(self) -> StoreHealth:
        """A snapshot of the writer's state (safe from any thread). A write that has not
        returned for :data:`WRITE_STALL_S` counts as down (a database that stopped answering
        without closing the connection)."""
        down = self._down
        since = self._writing_since
        if down is None and since is not None and self._clock() - since > WRITE_STALL_S:
            down = (f"a write to {self._db.name} has not returned for "
                    f"{self._clock() - since:.0f} s", since)
        return StoreHealth(down[0] if down else None,
                           self._clock() - down[1] if down else 0.0, len(self._spill),
                           **self._counts)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (one last try for the spill), then stop the writer."""
        self._queue.put(None)
        self._thread.join(timeout)

    # --- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        delay = self._backoff[0]
        while True:
            items, stopping = self._take(delay if self._spill else None)
            if self._write(items):
                delay = self._backoff[0]
            else:
                delay = min(delay * 2, self._backoff[1])
            if stopping:
                self._last_resort()
                with contextlib.suppress(Exception):
                    self._db.close()
                return

    def _take(self, wait: float | None) -> tuple[list[tuple[UsageRecord, Done | None]], bool]:
        """What is queued: block for the first (at most ``wait`` seconds while a spill waits
        for its retry), then up to 255 more without waiting. True when asked to stop."""
        try:
            first = self._queue.get(timeout=wait)
        except queue.Empty:
            return [], False
        batch = [first]
        while not self._queue.empty() and len(batch) < 256:
            batch.append(self._queue.get())
        return [item for item in batch if item is not None], None in batch

    def _write(self, items: list[tuple[UsageRecord, Done | None]]) -> bool:
        """Commit the spill and ``items`` in one transaction; True when that succeeded (or
        there was nothing to write). Never raises."""
        records = list(self._spill) + [record for record, _ in items]
        if not records:
            return True
        self._writing_since = self._clock()
        try:
            self._db.write(records)
        except Exception as exc:  # a database error, OSError, or a bug: retried, never fatal
            self._failed(exc, items)
            return False
        finally:
            self._writing_since = None
        if self._down is not None:
            log.warning("usage store: writing again after %.1f s down; %d spilled records "
                        "written", self._clock() - self._down[1], len(self._spill))
            self._down = None
        self._counts["durable"] += len(records)
        self._spill.clear()
        _answer(items, True)
        return True

    def _failed(self, exc: Exception, items: list[tuple[UsageRecord, Done | None]]) -> None:
        why = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):  # a broken connection is reopened on the next try
            self._db.reset()
        if self._down is None:
            log.error("usage store: cannot write to %s (%s); records are kept in memory "
                      "(at most %d) and retried with backoff", self._db.name, why,
                      self.spill_limit)
            self._down = (why, self._clock())
        else:
            self._down = (why, self._down[1])
        self._counts["spilled"] += len(items)
        self._spill.extend(record for record, _ in items)
        overflow = len(self._spill) - self.spill_limit
        if overflow > 0:
            lost = [self._spill.popleft() for _ in range(overflow)]
            self._counts["dropped"] += overflow
            log.error("usage store: spill full, %d oldest records dropped: %s", overflow,
                      ", ".join(r.request_id for r in lost))
        _answer(items, False)

    def _last_resort(self) -> None:
        """At close: a spill the database would not take goes to a JSONL file beside it, or,
        when that fails too, to the log, one record a line."""
        if not self._spill:
            return
        lines = [json.dumps(attrs.asdict(r)) for r in self._spill]
        try:
            with open(self.path.parent / SPILL_FILE, "a", encoding="utf-8") as out:
                out.write("".join(line + "\n" for line in lines))
            log.error("usage store: %d records could not be written to the database; they "
                      "are in %s", len(lines), SPILL_FILE)
        except OSError as exc:
            log.error("usage store: %d records could be written nowhere (%s); here they are:",
                      len(lines), exc)
            for line in lines:
                log.error("usage record: %s", line)


def _answer(items: list[tuple[UsageRecord, Done | None]], durable: bool) -> None:
    for _, done in items:
        if done is not None:
            try:
                done(durable)
            except Exception:  # a waiter's failure is its own; the writer goes on
                log.exception("usage store: a record's callback failed")


def connect(path: str | Path, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    """Open (creating if needed, adding columns a database of an older schema lacks) a usage
    database in WAL mode with full sync, waiting at most ``busy_timeout_s`` for a lock."""
    db = sqlite3.connect(str(path), timeout=busy_timeout_s, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(SCHEMA)
        have = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
        if "api_keys" not in have:
            db.execute("ALTER TABLE usage ADD COLUMN api_keys TEXT NOT NULL DEFAULT ''")
        db.commit()
    except BaseException:
        db.close()
        raise
    return db


def read_records(path: str | Path) -> list[UsageRecord]:
    """Every record in a usage database (for reports and tests)."""
    db = sqlite3.connect(str(path))
    try:
        rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage").fetchall()
    finally:
        db.close()
    return [UsageRecord(*row) for row in rows]
