"""The durable write-ahead record of tool calls that crossed the commit boundary.

Owns the :class:`Ledger` Protocol, :class:`Entry` (one record under an idempotency key),
:class:`Resolution` (what an in-doubt call is settled with), :func:`resolve`, and two
ledgers: :class:`JsonlLedger`, an append-only JSON-lines file that threads and processes
share safely, and :class:`MemoryLedger` for tests and one-process runs.

A key's call moves ``committed`` → ``executed`` | ``failed``, and each transition is checked
where it is written. ``committed`` is written only by :meth:`Ledger.claim`, an atomic
check-and-set: of every attempt under one key — threads, processes, ledgers opened twice on
one file — exactly one claims it and may execute the call. The claimant *holds* the key until
it records the outcome; an attempt that finds the key held waits for that outcome and
returns it. A key whose latest state is ``committed`` and that nobody holds (its holder died
between the commit and the outcome) is *in doubt*: the call may have had its effect, so it is
never executed again; an outcome recorded with ``resolved_by`` set (an operator's word, or
the executor's own lookup) settles it, and only over a commit nobody holds. A compensation is
a record of its own (``compensated``), kept beside the call's outcome, which it never
replaces.

:class:`JsonlLedger` takes an exclusive ``fcntl.flock`` on the file around every
check-and-set, first reading what other processes appended since its last read, and fsyncs
each record before returning. A claimed key is held by an ``flock`` on a small file of its
own in the folder ``<ledger>.inflight`` beside the ledger; the operating system releases it
when the holder dies, which is how a waiter tells a call in flight from a call in doubt.
POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.events import sync_folder

STATES = ("committed", "executed", "failed", "compensated")
OUTCOMES = ("executed", "failed")
"""The states that end a call (its outcome)."""


@attrs.frozen
class Entry:
    """One record under an idempotency key: the call's (``committed``, then ``executed``
    with its result or ``failed`` with its error) or its compensation's (``compensated``,
    whose ``result`` is what the compensation returned). ``resolved_by`` names who settled an
    in-doubt call (``operator``, ``lookup``); it is None on a call's own outcome.
    ``trace_id`` is the trace of the attempt that committed the call, if it had one."""

    key: str
    state: str = attrs.field(validator=attrs.validators.in_(STATES))
    call_id: str | None
    name: str
    arguments: str
    result: Any = None
    error: str | None = None
    resolved_by: str | None = None
    trace_id: str | None = None


@attrs.frozen
class Resolution:
    """What became of an in-doubt call, as an operator or the executor's lookup found out:
    ``executed`` with the result the model will read, or ``failed`` with why."""

    state: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    result: Any = None
    error: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.state == "failed") != (self.error is not None):
            raise InvalidValueError("error", self.error, "a failed resolution says why, an "
                                    "executed one has no error")

    @classmethod
    def executed(cls, result: Any) -> Resolution:
        """The call had its effect; ``result`` is what it returned."""
        return cls("executed", result)

    @classmethod
    def failed(cls, error: str) -> Resolution:
        """The call failed, or never had its effect; ``error`` says so."""
        return cls("failed", error=error)


@runtime_checkable
class Ledger(Protocol):
    """Where commits are recorded durably, keyed by idempotency key.

    Lifecycle of a key: :meth:`claim` writes its ``committed`` entry when no attempt has,
    atomically for everyone sharing the ledger, and returns None: the caller now holds the
    key and ends the hold by recording the outcome (``executed`` or ``failed``, through
    :meth:`record`) or by :meth:`release` (the call is then in doubt). Any other attempt's
    :meth:`claim` writes nothing and returns the key's entry, waiting first while a holder
    is alive, so a ``committed`` entry it returns is in doubt. :meth:`record` returns only
    once the record is durable and raises :class:`~pipeline.errors.InvalidValueError` for a
    transition the key's records do not allow (a second outcome, a resolution of a call in
    flight, a compensation of a call that did not execute). :meth:`get` gives the call's
    latest entry, :meth:`compensation` its compensation's. Implementations are thread-safe.

    Example::

        ledger = JsonlLedger("tools.jsonl")
        if ledger.claim(Entry(key, "committed", "call_1", "send_email", "{}")) is None:
            result = mailer.send(...)  # only the claimant gets here, once per key
            ledger.record(Entry(key, "executed", "call_1", "send_email", "{}", result))
        assert ledger.get(key).state == "executed"
    """

    def claim(self, entry: Entry) -> Entry | None:
        """Record ``entry`` (``committed``) and hold its key if nothing is recorded under it
        (None); else the key's entry, once no live holder is still working on it."""
        ...

    def record(self, entry: Entry) -> None:
        """Append ``entry`` durably, after checking the transition; an outcome ends the
        hold."""
        ...

    def release(self, key: str) -> None:
        """Give up the hold on ``key`` without an outcome: the call is in doubt."""
        ...

    def get(self, key: str) -> Entry | None:
        """The latest entry of the call under ``key`` (never its compensation)."""
        ...

    def compensation(self, key: str) -> Entry | None:
        """The compensation recorded under ``key``, if any."""
        ...


def resolve(ledger: Ledger, key: str, outcome: Resolution, by: str = "operator") -> Entry:
    """Settle the in-doubt call under ``key`` with ``outcome``: its recorded outcome from
    now on, as if the call had recorded it (``resolved_by=by``). Refused for a key with no
    commit or with an outcome already; waits while the call is still in flight, and is then
    refused."""
    entry = ledger.get(key)
    if entry is None or entry.state != "committed":
        raise InvalidValueError("key", key, "no call in doubt is recorded under it (state: "
                                f"{entry.state if entry else 'none'})")
    settled = attrs.evolve(entry, state=outcome.state, result=outcome.result,
                           error=outcome.error, resolved_by=by)
    ledger.record(settled)
    return settled


def _claimable(entry: Entry) -> None:
    if entry.state != "committed":
        raise InvalidValueError("entry.state", entry.state, "a claim records a commit")


def _check(entry: Entry, call: Entry | None, compensation: Entry | None) -> None:
    """Raise unless ``entry`` may follow what is recorded under its key."""
    if entry.state == "committed":
        allowed, rule = call is None, "a key is committed once (claim it to find out)"
    elif entry.state == "compensated":
        allowed = call is not None and call.state == "executed" and compensation is None
        rule = "only an executed call is compensated, and once"
    else:
        allowed = call is not None and call.state == "committed"
        rule = "an outcome is recorded once, over a commit"
    if not allowed:
        now = call.state if call is not None else "nothing recorded"
        raise InvalidValueError("key", entry.key, f"cannot record {entry.state} ({now}): "
                                f"{rule}")


class MemoryLedger:
    """A ledger in memory (durable only as long as the process)."""

    def __init__(self) -> None:
        self._calls: dict[str, Entry] = {}
        self._compensations: dict[str, Entry] = {}
        self._held: set[str] = set()
        self._changed = threading.Condition()

    def claim(self, entry: Entry) -> Entry | None:
        """Record ``entry`` and hold its key if the key is new; else its entry."""
        _claimable(entry)
        with self._changed:
            self._changed.wait_for(lambda: entry.key not in self._held)
            earlier = self._calls.get(entry.key)
            if earlier is None:
                self._calls[entry.key] = entry
                self._held.add(entry.key)
            return earlier

    def record(self, entry: Entry) -> None:
        """Keep ``entry`` (checked) as its key's latest call or compensation record."""
        with self._changed:
            if entry.resolved_by is not None:  # a resolution waits out a call in flight
                self._changed.wait_for(lambda: entry.key not in self._held)
            _check(entry, self._calls.get(entry.key), self._compensations.get(entry.key))
            if entry.state == "compensated":
                self._compensations[entry.key] = entry
                return
            self._calls[entry.key] = entry
            if entry.state in OUTCOMES:
                self._held.discard(entry.key)
                self._changed.notify_all()

    def release(self, key: str) -> None:
        """End the hold on ``key`` (its call is in doubt)."""
        with self._changed:
            self._held.discard(key)
            self._changed.notify_all()

    def get(self, key: str) -> Entry | None:
        """The latest call entry under ``key``."""
        with self._changed:
            return self._calls.get(key)

    def compensation(self, key: str) -> Entry | None:
        """The compensation under ``key``."""
        with self._changed:
            return self._compensations.get(key)


def _entry(data: Mapping[str, Any]) -> Entry:
    return Entry(str(data["key"]), str(data["state"]), data.get("call_id"), str(data["name"]),
                 str(data["arguments"]), data.get("result"), data.get("error"),
                 data.get("resolved_by"), data.get("trace_id"))


class JsonlLedger:
    """An append-only JSON-lines file, locked for every check-and-set and fsynced at each
    record. A torn last line (a writer that died mid-write) never counted: it is cut off
    under the lock; damage anywhere else is an :class:`~pipeline.errors.ArtifactError`.
    :meth:`close` releases the hold on any key claimed and not recorded."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.inflight = self.path.with_name(self.path.name + ".inflight")
        self._lock = threading.Lock()  # flock excludes other files; this, other threads
        self._calls: dict[str, Entry] = {}
        self._compensations: dict[str, Entry] = {}
        self._read = 0  # bytes of the file taken in
        self._lines = 0
        self._held: dict[str, int] = {}  # key -> descriptor of its flocked key file
        self._fd = -1  # the file, open only while locked
        created = not self.path.exists()
        with self._locked():
            pass  # creates the file, takes it in
        if created:
            sync_folder(self.path.parent)  # so the file itself survives a power loss

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This thread alone, this file alone, with every record appended so far read.
        The file is opened for each use (closing it releases the flock), so a ledger holds
        no descriptor between calls."""
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd
                self._take_in()
                yield
            finally:
                self._fd = -1
                os.close(fd)

    def _take_in(self) -> None:
        """Read what was appended since the last read (by anyone)."""
        fd = self._fd
        size = os.fstat(fd).st_size
        if size < self._read:  # cut or replaced by hand: read it again from the start
            self._calls, self._compensations, self._read, self._lines = {}, {}, 0, 0
        if size == self._read:
            return
        data = os.pread(fd, size - self._read, self._read)
        end = data.rfind(b"\n") + 1
        for line in data[:end].split(b"\n")[:-1]:
            self._lines += 1
            if line.strip():
                self._apply(self._parse(line, self._lines))
        tail = data[end:]
        if tail:
            try:  # we hold the lock, so its writer died mid-write
                entry = _entry(json.loads(tail))
            except (ValueError, KeyError, TypeError):
                os.ftruncate(fd, self._read + end)
            else:  # whole but for its newline
                self._write_all(b"\n")
                os.fsync(fd)
                self._lines += 1
                self._apply(entry)
                end += len(tail) + 1
        self._read += end

    def _parse(self, line: bytes, number: int) -> Entry:
        try:
            return _entry(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"tool ledger {self.path.name}, line {number}: not a record "
                                f"({exc})") from exc

    def _apply(self, entry: Entry) -> None:
        if entry.state == "compensated":
            self._compensations[entry.key] = entry
        else:
            self._calls[entry.key] = entry

    def _append(self, entry: Entry) -> None:
        line = json.dumps({**attrs.asdict(entry), "unix_ns": time.time_ns()},
                          ensure_ascii=False, default=str).encode("utf-8") + b"\n"
        self.write_record(line)
        self._read += len(line)
        self._lines += 1
        self._apply(entry)

    def write_record(self, line: bytes) -> None:
        """Append one record's line and make it durable (fsync), under the ledger's lock:
        the one place a record waits on the disk. A subclass may wrap it (to simulate a slow
        disk, or a crash between two records)."""
        self._write_all(line)
        os.fsync(self._fd)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def claim(self, entry: Entry) -> Entry | None:
        """Record ``entry`` and hold its key if the key is new; else its entry, after
        waiting for a live holder (in any process) to record the outcome."""
        _claimable(entry)
        waited = False
        while True:
            with self._locked():
                earlier = self._calls.get(entry.key)
                if earlier is None:
                    self._hold(entry.key)
                    try:
                        self._append(entry)
                    except BaseException:
                        self._let_go(entry.key)
                        raise
                    return None
                if earlier.state != "committed" or waited:
                    return earlier
            self._await_holder(entry.key)  # outside the lock: the holder needs it to record
            waited = True

    def record(self, entry: Entry) -> None:
        """Append ``entry`` (checked) and fsync; an outcome ends this ledger's hold on the
        key, and a resolution first waits out a call still in flight."""
        if entry.resolved_by is not None:
            self._await_holder(entry.key)
        with self._locked():
            _check(entry, self._calls.get(entry.key), self._compensations.get(entry.key))
            self._append(entry)
            if entry.state in OUTCOMES:
                self._let_go(entry.key)
                if entry.resolved_by is not None:  # the dead holder's key file
                    with contextlib.suppress(FileNotFoundError):
                        self._key_file(entry.key).unlink()

    def release(self, key: str) -> None:
        """End this ledger's hold on ``key`` (its call is in doubt)."""
        with self._lock:
            self._let_go(key)

    def get(self, key: str) -> Entry | None:
        """The latest call entry under ``key``, as every process has recorded it."""
        with self._locked():
            return self._calls.get(key)

    def compensation(self, key: str) -> Entry | None:
        """The compensation under ``key``."""
        with self._locked():
            return self._compensations.get(key)

    def history(self) -> list[dict[str, Any]]:
        """Every record in the file, in order (for audits and tests)."""
        with self._locked():
            data = os.pread(self._fd, self._read, 0)
        return [json.loads(line) for line in data.split(b"\n") if line.strip()]

    def close(self) -> None:
        """Release every hold (calls claimed and not recorded are then in doubt)."""
        with self._lock:
            for key in list(self._held):
                self._let_go(key)

    def _key_file(self, key: str) -> Path:
        return self.inflight / hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]

    def _hold(self, key: str) -> None:
        """Take the key's own lock before its commit is visible, so whoever reads the
        commit finds it held while this process lives."""
        self.inflight.mkdir(exist_ok=True)
        fd = os.open(self._key_file(key), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._held[key] = fd

    def _let_go(self, key: str) -> None:
        fd = self._held.pop(key, None)
        if fd is not None:
            with contextlib.suppress(FileNotFoundError):
                self._key_file(key).unlink()
            os.close(fd)

    def _await_holder(self, key: str) -> None:
        """Return once no one holds ``key``: at once when none does, or when its holder
        records the outcome, releases it, or dies."""
        try:
            fd = os.open(self._key_file(key), os.O_RDWR)
        except FileNotFoundError:  # made before a commit and removed after the outcome
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)

