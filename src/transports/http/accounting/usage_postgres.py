"""The usage store's PostgreSQL database, for replicas that share one: :class:`PostgresUsage`.

Owns the PostgreSQL side of :class:`~transports.http.accounting.usage.UsageDatabase`, through psycopg 3
(the PostgreSQL project's recommended driver; the ``postgres`` extra installs it). The table is
the SQLite store's, column for column (``usage``, created if missing); a batch is one
transaction, and a record whose ``request_id`` is there already replaces it (``INSERT ... ON
CONFLICT (request_id) DO UPDATE``), so a retried batch never doubles a row. Every replica's
:class:`~transports.http.accounting.usage.UsageStore` keeps its own supervision (spill, backoff, health)
over the shared database.

``pipeline serve --usage-db postgresql://user@host/db`` (``ServerConfig.usage_database``)
selects it; the URL's password is never logged (``name`` is the URL without it).

Example::

    store = UsageStore(data_dir, database=PostgresUsage("postgresql://pipeline@db/usage"))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import attrs

from pipeline.errors import InvalidValueError
from transports.http.accounting.usage import COLUMNS, OneConnection, UsageRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL, finish_reason TEXT NOT NULL, error TEXT,
    queued_s DOUBLE PRECISION NOT NULL, first_token_s DOUBLE PRECISION,
    total_s DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL,
    api_keys TEXT NOT NULL DEFAULT ''
)"""
INSERT = (f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join(['%s'] * len(COLUMNS))})"
          f" ON CONFLICT (request_id) DO UPDATE SET "
          + ", ".join(f"{c} = EXCLUDED.{c}" for c in COLUMNS[1:]))


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:
        raise InvalidValueError("usage_database", "postgresql://...", "needs the psycopg "
                                "package: pip install 'explicit-pipeline[postgres]'") from exc
    return psycopg


HIDDEN = "(not shown: it may hold a password)"


def shown(url: str) -> str:
    """``url`` without its password (in the user part or as a ``password`` parameter), for
    logs and errors; :data:`HIDDEN` for what cannot be taken apart safely."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        query = "&".join(q for q in parts.query.split("&")
                         if q and not q.lower().startswith("password="))
        return urlunsplit((parts.scheme, f"{user}@{netloc[2]}" if user else netloc[2],
                           parts.path, query, ""))
    except Exception:
        return HIDDEN


def check_url(url: str) -> str:
    """``url`` if it is a ``postgresql://`` URL, else :class:`~pipeline.errors.InvalidValueError`
    naming the field (never echoing the value, which may hold a password)."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("postgresql", "postgres"):
        raise InvalidValueError("usage_database", HIDDEN, "must be a postgresql:// URL (or "
                                "None for the SQLite database in the data directory)")
    return url


TIMEOUTS = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3, "tcp_user_timeout": 30_000,
            "options": "-c statement_timeout=30000 -c idle_in_transaction_session_timeout=60000"}
"""libpq settings that bound a write: TCP keepalives and a user timeout (a server or network
that went away is noticed in about 30 s), and the server's own statement and idle-transaction
timeouts (a write that waits on a lock). A server whose process is frozen while its machine
answers TCP is not noticed by any of them; the store's health reports a write in flight too
long (:meth:`~transports.http.accounting.usage.UsageStore.health`)."""
LOCK = 727270
"""The advisory lock key that serializes the table's creation between replicas starting
together (two concurrent ``CREATE TABLE IF NOT EXISTS`` can collide in PostgreSQL)."""


class PostgresUsage(OneConnection):
    """A :class:`~transports.http.accounting.usage.UsageDatabase` on a PostgreSQL server at ``url`` (a
    ``postgresql://`` URL). Connects, and creates the table, at construction: an unreachable
    server is an error before serving (naming the URL without its password).
    ``connect_timeout_s`` bounds each connection attempt; :data:`TIMEOUTS` bound a write."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self.url, self.connect_timeout_s = check_url(url), connect_timeout_s
        self.name = shown(url)
        self._connect()

    def _connect(self) -> Any:
        psycopg = _psycopg()
        try:
            db = psycopg.connect(self.url, connect_timeout=max(1, int(self.connect_timeout_s)),
                                 **TIMEOUTS)
        except psycopg.Error as exc:  # libpq may echo part of the URL: say what, not that
            raise InvalidValueError("usage_database", self.name, "cannot connect "
                                    f"({type(exc).__name__}): check that the server runs and "
                                    "takes this user and database") from None
        try:
            with db.transaction():
                db.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK,))
                db.execute(SCHEMA)
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def write(self, records: Sequence[UsageRecord]) -> None:
        db = self._db if self._db is not None else self._connect()
        with db.transaction(), db.cursor() as cur:
            cur.executemany(INSERT, [_storable(r) for r in records])


def _storable(record: UsageRecord) -> tuple[Any, ...]:
    """The record's columns, with NUL characters (which a PostgreSQL text column refuses, and
    which would hold the whole spill back) written as the two characters ``\\0``."""
    return tuple(v.replace("\x00", "\\0") if isinstance(v, str) else v
                 for v in attrs.astuple(record))



def read_records(url: str) -> list[UsageRecord]:
    """Every record in a PostgreSQL usage database (for reports and tests)."""
    with _psycopg().connect(url) as db:
        rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage").fetchall()
    return [UsageRecord(*row) for row in rows]
