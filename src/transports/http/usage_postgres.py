"""The usage store's PostgreSQL database, for replicas that share one: :class:`PostgresUsage`.

Owns the PostgreSQL side of :class:`~transports.http.usage.UsageDatabase`, through psycopg 3
(the PostgreSQL project's recommended driver; the ``postgres`` extra installs it). The table is
the SQLite store's, column for column (``usage``, created if missing); a batch is one
transaction, and a record whose ``request_id`` is there already replaces it (``INSERT ... ON
CONFLICT (request_id) DO UPDATE``), so a retried batch never doubles a row. Every replica's
:class:`~transports.http.usage.UsageStore` keeps its own supervision (spill, backoff, health)
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
from transports.http.usage import OneConnection, UsageRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT PRIMARY KEY, model TEXT NOT NULL, endpoint TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL, completion_tokens BIGINT NOT NULL,
    cached_tokens BIGINT NOT NULL, finish_reason TEXT NOT NULL, error TEXT,
    queued_s DOUBLE PRECISION NOT NULL, first_token_s DOUBLE PRECISION,
    total_s DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION NOT NULL,
    api_keys TEXT NOT NULL DEFAULT ''
)"""
COLUMNS = tuple(a.name for a in attrs.fields(UsageRecord))
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


def shown(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    user = f"{parts.username}@" if parts.username else ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, f"{user}{host}{port}", parts.path, parts.query, ""))


def check_url(url: str) -> str:
    """``url`` if it is a PostgreSQL URL, else :class:`~pipeline.errors.InvalidValueError`
    naming the field."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("postgresql", "postgres"):
        raise InvalidValueError("usage_database", url, "must be a postgresql:// URL (or None "
                                "for the SQLite database in the data directory)")
    return url


class PostgresUsage(OneConnection):
    """A :class:`~transports.http.usage.UsageDatabase` on a PostgreSQL server at ``url``
    (a ``postgresql://`` URL or libpq connection string). Connects, and creates the table,
    at construction: an unreachable server is an error before serving. ``connect_timeout_s``
    bounds each connection attempt."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        self.url, self.connect_timeout_s = check_url(url), connect_timeout_s
        self.name = shown(url)
        self._connect()

    def _connect(self) -> Any:
        psycopg = _psycopg()
        db = psycopg.connect(self.url, connect_timeout=max(1, int(self.connect_timeout_s)))
        try:
            with db.transaction():
                db.execute(SCHEMA)
        except BaseException:
            db.close()
            raise
        self._db = db
        return db

    def write(self, records: Sequence[UsageRecord]) -> None:
        db = self._db if self._db is not None else self._connect()
        with db.transaction(), db.cursor() as cur:
            cur.executemany(INSERT, [attrs.astuple(r) for r in records])



def read_records(url: str) -> list[UsageRecord]:
    """Every record in a PostgreSQL usage database (for reports and tests)."""
    with _psycopg().connect(url) as db:
        rows = db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage").fetchall()
    return [UsageRecord(*row) for row in rows]
