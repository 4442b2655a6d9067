"""The durable write-ahead record of tool calls that crossed the commit boundary.

Owns the :class:`Ledger` Protocol, :class:`Entry` (one call's latest state under its
idempotency key) and two ledgers: :class:`JsonlLedger`, an append-only JSON-lines file
written with ``fsync`` before each step proceeds (so a crash never forgets a commit), and
:class:`MemoryLedger` for tests and one-process runs. The boundary writes ``committed``
*before* it executes, then ``executed`` (with the result) or ``failed``; compensation adds
``compensated``. A key whose latest state is ``committed`` with no outcome is *in doubt*:
the call may have had its effect, so it is never executed again. A ledger file belongs to
one process at a time (there is no file locking).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from pipeline.errors import ArtifactError

STATES = ("committed", "executed", "failed", "compensated")


@attrs.frozen
class Entry:
    """The latest record of one idempotency key."""

    key: str
    state: str
    call_id: str | None
    name: str
    arguments: str
    result: Any = None
    error: str | None = None


@runtime_checkable
class Ledger(Protocol):
    """Where commits are recorded durably, keyed by idempotency key.

    ``record`` returns only once the record is durable. ``get`` gives a key's latest entry.
    Implementations are thread-safe.

    Example::

        ledger = JsonlLedger("tools.jsonl")
        ledger.record(Entry(key, "committed", "call_1", "send_email", "{}"))
        assert ledger.get(key).state == "committed"
    """

    def record(self, entry: Entry) -> None:
        """Append ``entry`` durably."""
        ...

    def get(self, key: str) -> Entry | None:
        """The latest entry under ``key``."""
        ...


class MemoryLedger:
    """A ledger in memory (durable only as long as the process)."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()

    def record(self, entry: Entry) -> None:
        """Keep ``entry`` as its key's latest."""
        with self._lock:
            self._entries[entry.key] = entry

    def get(self, key: str) -> Entry | None:
        """The latest entry under ``key``."""
        with self._lock:
            return self._entries.get(key)


def _entry(data: Mapping[str, Any]) -> Entry:
    if data["state"] not in STATES:
        raise ValueError(f"unknown state {data['state']!r}")
    return Entry(str(data["key"]), str(data["state"]), data.get("call_id"), str(data["name"]),
                 str(data["arguments"]), data.get("result"), data.get("error"))


class JsonlLedger:
    """An append-only JSON-lines file; each record is flushed and fsynced before
    :meth:`record` returns. A torn last line (a crash mid-write) never counted: it is cut
    off on opening; damage anywhere else is an :class:`~pipeline.errors.ArtifactError`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries = self._load()

    def _load(self) -> dict[str, Entry]:
        if not self.path.exists():
            return {}
        entries: dict[str, Entry] = {}
        lines = self.path.read_bytes().split(b"\n")
        at = 0
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    entry = _entry(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    if number < len(lines):
                        raise ArtifactError(f"tool ledger {self.path.name}, line {number}: "
                                            f"not a record ({exc})") from exc
                    os.truncate(self.path, at)
                    break
                entries[entry.key] = entry
            at += len(line) + 1
        return entries

    def record(self, entry: Entry) -> None:
        """Append ``entry`` and fsync the file."""
        line = json.dumps({**attrs.asdict(entry), "unix_ns": time.time_ns()},
                          ensure_ascii=False, default=str)
        with self._lock:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._entries[entry.key] = entry

    def get(self, key: str) -> Entry | None:
        """The latest entry under ``key``."""
        with self._lock:
            return self._entries.get(key)

    def history(self) -> list[dict[str, Any]]:
        """Every record in the file, in order (for audits and tests)."""
        with self.path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
