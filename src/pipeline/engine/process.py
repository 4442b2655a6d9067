"""The engine in a child process, started and watched by this one.

Owns :class:`ProcessEngine`, :class:`RemoteBackend`, :class:`Unresponsive` and the child's
side. A :class:`~pipeline.engine.loop.Engine` on a thread cannot outlive what kills its
process: a native crash in a kernel, the out-of-memory killer, a wedged device call that no
thread can interrupt. A ``ProcessEngine`` runs the model and the scheduler — a whole
pipeline built from an :class:`EngineRecipe` — in a child process (a fresh interpreter:
:class:`_Child`), while this process keeps the request side (render, tokenize, validate: a
pipeline over a :class:`RemoteBackend` that only answers the model's figures). It provides
:class:`~pipeline.engine.api.EngineAPI`, so a :class:`~pipeline.pipe.Pipeline` and the HTTP
gateway's supervision use it as they use the thread engine.

**Wire.** One socket pair of messages pickled by value (:func:`_dumps`: a tensor travels as
its data). To the child, ``(kind, key, payload)``: ``submit`` (the
:class:`~pipeline.engine.job_spec.JobSpec`, plain data, and the trace so far), ``cancel``,
``call`` (:meth:`ProcessEngine.call`'s function; a :class:`RemoteBackend` inside it arrives as
the child's real backend), ``uncall`` (a call cancelled before it ran) and ``close``. From the
child, after ``("ready", facts)`` or ``("failed", reason)``: ``(kind, key, extra, payload)``,
``delta``, ``done`` (with the request's final state), ``result`` (``ok`` or ``error``) and
``stopped`` (why its engine loop died). ``key`` is this process's number for the request or
call, never the caller's request id (two requests may share one). A payload is pickled on its
own, so one that cannot be read fails its request or call alone; the child's exceptions come
back whole (:class:`~pipeline.errors.PipelineError` pickles; others become a
:class:`~pipeline.errors.BackendError` naming them). Messages to the child are pickled on the
caller's thread (what cannot cross is an :class:`~pipeline.errors.InvalidValueError` there)
and written by a writer thread, so no caller — an event loop cancelling a request, ``close`` —
ever blocks on a frozen child.

**Liveness.** Figures sit in a small file both processes map, read without a round trip: the
child's engine thread writes a step's number and start as it begins and ends
(``Engine.on_step``); a publisher thread, every :data:`PUBLISH_S`, a heartbeat and the
requests active and queued; the receiving thread how many messages it has taken up.
:meth:`ProcessEngine.stall` turns them into a verdict for the stall watchdog: a step in
progress and how long it has run (a step wedged from its first instant is seen), or, between
steps, an :class:`Unresponsive` child — one whose heartbeat has not moved (stopped by
SIGSTOP or a cgroup freeze, lost in a swap storm) or that has not taken up a message sent to
it (wedged outside a step) for longer than :data:`QUIET_S`, idle or not. The watchdog then
abandons it as it does a stalled step. Request deadlines are kept here as well as in the
child: a request the child has not ended :data:`DEADLINE_GRACE_S` after its deadline ends here
as the child would end it (``finish_reason`` deadline, with what reached this process), and
the child is told to cancel it.

**Death.** When the pipe ends without a ``close`` (the child was killed — SIGKILL, the
out-of-memory killer — or crashed, or its engine loop died, e.g. on a
:class:`~pipeline.errors.DeviceFault`), every request in flight ends at once: a final delta
with ``finish_reason`` error, then a failed completion whose error begins ``the engine
stopped:`` and names how the process ended (its signal or exit status), with the text and
tokens that had reached this process and a ``generation.finished`` event closing its trace.
Waiting calls fail with :class:`~pipeline.errors.EngineClosed`; new work is refused with it;
``on_stop`` is called (the gateway then has ``/health`` say ``restarting`` and starts a
:meth:`ProcessEngine.fresh` one). :meth:`ProcessEngine.abandon` (a stalled step) does all of
that at once and kills the child with SIGKILL (which acts on a stopped process too), which a
thread engine cannot do; ``fresh`` raises :class:`~pipeline.errors.StepStillRunning` until the
old child has exited. A dead child's descriptors here — the socket and the figures file and
its map — are closed as the reader thread sees it die, not when the collector finds the
engine. The child ends when this process does (its end of the pipe closes; the child's
descriptors are not inherited by anything it starts).

Example::

    engine = ProcessEngine.start(EngineRecipe("smollm2", BackendOptions(num_slots=4)))
    pipe = engine.pipeline()              # request side here, model and scheduler there
    print(pipe.generate("Hello", max_tokens=8).text)
    pipe.close()                          # closes the child too
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import logging
import mmap
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.loop import ENGINE_DOWN, MAX_CALLS, Engine, Stall
from pipeline.errors import (
    BackendError, CapacityError, EngineClosed, InvalidValueError, StepStillRunning,
)
from pipeline.events import Event, Tracer, digest_ids, digest_text
from pipeline.options import BackendOptions
from pipeline.output_parts import joined
from pipeline.contracts.model import ModelCall, ModelInfo
from pipeline.contracts.output import Completion, Delta, FinishReason, Part, Timings, Usage

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pipeline.engine.job import Job
    from pipeline.engine.ranks import Followers
    from pipeline.pipe import Pipeline
    from pipeline.contracts.model import Backend
    from pipeline.contracts.strategy import Strategy

T = TypeVar("T")
log = logging.getLogger("pipeline.engine")

PUBLISH_S = 0.01
"""How often the child beats and rewrites its counts of requests active and queued."""
START_TIMEOUT_S = 600.0
"""How long :meth:`ProcessEngine.start` waits for the child to load its model."""
QUIET_S = 0.5
"""How long the child may go unheard — no heartbeat, or work sent and not taken up — before
:meth:`ProcessEngine.stall` reports it (its publisher beats every :data:`PUBLISH_S`)."""
DEADLINE_GRACE_S = 1.0
"""How long past a request's deadline this process waits for the child to end it before
ending it here (a child that answers ends it itself, at its next step, with all it wrote)."""
_DEADLINE_LOOK_S = 0.1
"""The longest the reader thread waits for a message before it looks at the deadlines."""
_STEPS, _STARTED, _ACTIVE, _QUEUED, _BEAT, _TAKEN = range(6)
_FIGURES_SIZE = 8 * 6


@attrs.frozen
class Unresponsive(Stall):
    """A child unheard between steps (:meth:`ProcessEngine.stall`): ``running_s`` is how long,
    ``phase`` what it has not done. The watchdog abandons it as it does a stalled step."""

    def what(self) -> str:
        return f"the engine process {self.phase} for {self.running_s:.1f} s"


@attrs.frozen
class EngineRecipe:
    """What the child builds: ``build(model, options=options, **build_args)`` (``model``
    None: the default model), after running ``setup``. Pickled to the child."""

    model: str | Path | None
    options: BackendOptions = attrs.field(factory=BackendOptions)
    build_args: dict[str, Any] = attrs.field(factory=dict)
    setup: tuple[Callable[[], Any], ...] = ()
    """Run in the child before it builds (module-level functions: the server's caps on native
    memory caches, say, which are per process)."""
    ranks: int = attrs.field(default=1)
    """More than 1: the child is rank 0 of a parallel group of that many processes, the
    others started and watched beside it (:mod:`pipeline.engine.ranks`)."""

    @ranks.validator
    def _ranks(self, _: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidValueError("ranks", value, "must be a whole number of processes, 1 "
                                    "or more")


@attrs.frozen
class _Facts:
    """The child's backend's figures, sent once it is loaded."""

    vocab_size: int
    num_slots: int
    max_context: int
    snapshot: str
    batch_invariant: bool | None
    info: ModelInfo | None
    hidden_size: int | None
    pid: int


class RemoteBackend:
    """The backend's face in the parent: its figures (``vocab_size``, ``num_slots``,
    ``max_context``, ``snapshot``, ``batch_invariant``) and nothing that runs the model, which
    is in the child. Pickled (inside a :meth:`ProcessEngine.call`'s function), it arrives in
    the child as the real backend. :func:`remote_backend` adds what the child's backend can
    say: ``model_info()`` and, for an embedding model, ``hidden_size`` and ``hidden_states``
    (computed in the child through :meth:`ProcessEngine.call`)."""

    def __init__(self, facts: _Facts) -> None:
        self.vocab_size, self.num_slots = facts.vocab_size, facts.num_slots
        self.max_context, self.snapshot = facts.max_context, facts.snapshot
        self.batch_invariant = facts.batch_invariant
        self.facts = facts

    def __reduce__(self) -> tuple[Callable[[], Any], tuple[()]]:
        return _child_backend, ()

    def _elsewhere(self, *_: Any) -> Any:
        raise BackendError("the model runs in the engine process: this backend only answers "
                           "its figures")

    allocate = release = cache_length = truncate = _elsewhere

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        return self._elsewhere(calls)  # type: ignore[no-any-return]


class _Describes(RemoteBackend):
    def model_info(self) -> ModelInfo:
        """What the child's backend said about its model."""
        assert self.facts.info is not None
        return self.facts.info


class _Embeds(RemoteBackend):
    def __init__(self, facts: _Facts) -> None:
        super().__init__(facts)
        assert facts.hidden_size is not None
        self.hidden_size = facts.hidden_size

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self._elsewhere(token_ids)  # type: ignore[no-any-return]


def remote_backend(facts: _Facts) -> RemoteBackend:
    """A :class:`RemoteBackend` with the optional capabilities the child's backend has."""
    bases: tuple[type[RemoteBackend], ...] = tuple(
        base for base, has in ((_Embeds, facts.hidden_size is not None),
                               (_Describes, facts.info is not None)) if has)
    if not bases:
        return RemoteBackend(facts)
    made: type[RemoteBackend] = type("RemoteBackend", bases, {})
    return made(facts)


@attrs.define
class _Flight:
    """A request in the child, as this process knows it (what reached here is on its
    handle)."""

    job: Job
    cancel_sent: bool = False
    ended: bool = False
    """Ended here at its deadline; the child holds it until it says ``done``."""


class ProcessEngine:
    """An engine whose model and scheduler run in a child process (module docstring).

    Build with :meth:`start` (blocks until the child has loaded its model; raises
    :class:`~pipeline.errors.BackendError` naming why it could not). Every method is safe from
    any thread and none blocks on the child: messages to it are pickled on the caller's
    thread (a request that cannot be pickled is refused there) and written by a writer thread
    of their own, so a frozen child never holds an event loop or a cancelling caller."""

    def __init__(self, recipe: EngineRecipe, process: _Child, conn: Connection, shared: Any,
                 facts: _Facts, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.recipe = recipe
        self.pid = facts.pid
        """The child process's id."""
        self.backend: Backend = remote_backend(facts)
        self.failure: str | None = None
        self.on_stop: Callable[[str], None] | None = None
        self._process, self._conn, self._shared = process, conn, shared
        self._strategies: Callable[[tuple[str, ...] | None], Strategy] | None = None
        self._strategy_cache: dict[tuple[str, ...] | None, Strategy] = {}
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._keys = itertools.count()
        self._deadlines: list[tuple[int, int]] = []  # a heap of (when this process ends it, key)
        self._closing = False
        self._clock = clock
        now = clock()
        self._beat = (int(shared[_BEAT]), now)      # the child's heartbeat, and when it changed
        self._sent, self._waiting_since = 0, now    # messages sent; when the oldest untaken was
        self._taken = (int(shared[_TAKEN]), now)    # messages the child took, and when that moved
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="pipeline-engine-writer",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read, name="pipeline-engine-reader",
                                        daemon=True)
        self._writer.start()
        self._reader.start()

    # --- starting ------------------------------------------------------------------------------

    @classmethod
    def start(cls, recipe: EngineRecipe, timeout: float = START_TIMEOUT_S,
              clock: Callable[[], int] = time.monotonic_ns) -> ProcessEngine:
        """Start a child that builds ``recipe`` and wait until it is ready. ``clock``
        (nanoseconds) times how long the child has gone unheard (:meth:`stall`)."""
        child = _Child.spawn(recipe)
        try:
            child.conn.send_bytes(_dumps(recipe))
            child.wait_loaded(timeout)
            message = _loads(child.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            child.kill()
            child.join(5)
            child.release()
            raise BackendError("the engine process ended while loading its model "
                               f"({_exit(child.exitcode)})") from exc
        except BackendError:
            child.kill()
            child.join(5)
            child.release()
            raise
        if message[0] != "ready":
            child.join(5)
            child.release()
            raise BackendError(f"the engine process could not load its model: {message[1]}")
        engine = cls(recipe, child, child.conn, child.shared, message[1], clock)
        if child.followers is not None:  # a lost rank, even while idle, is the engine's loss
            child.followers.watch(lambda rank, code: engine.abandon(
                f"rank {rank} of the parallel group {_exit(code)}"))
        return engine

    def pipeline(self) -> Pipeline:
        """The request side over this engine: ``build(model, backend=<this engine's
        RemoteBackend>, ...)`` with the recipe's arguments, its engine replaced by this one
        (whose strategies it takes, for the checks a request meets at submit)."""
        from pipeline.builder import build
        from pipeline.model_paths import DEFAULT_MODEL

        r = self.recipe
        model = r.model if r.model is not None else DEFAULT_MODEL
        pipe = build(model, options=r.options, backend=self.backend, **r.build_args)
        local = pipe.engine
        assert local is not None
        local.close()
        self._strategies = local.strategy
        pipe.engine = self
        return pipe

    # --- EngineAPI -----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Send ``job``'s spec and trace so far to the child. Raises
        :class:`~pipeline.errors.InvalidValueError` for a request that cannot cross to
        another process (a ``template_kwargs`` value that is not plain data, say) and
        :class:`~pipeline.errors.EngineClosed` once the engine stopped."""
        try:
            payload = _dumps((job.spec, job.tracer.events))
        except Exception as exc:
            raise InvalidValueError("request", job.request.request_id, "cannot be sent to the "
                                    f"engine process: {exc}") from exc
        limit = job.request.runtime_limits.deadline_s
        with self._lock:
            self._check_open()
            key = next(self._keys)
            self._flights[key] = _Flight(job)
            self._send(("submit", key, payload))
            if limit is not None:  # kept here too: a frozen child enforces nothing
                due = job.spec.accepted_ns + int((limit + DEADLINE_GRACE_S) * 1e9)
                heapq.heappush(self._deadlines, (due, key))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the child's engine thread between two steps
        (:meth:`~pipeline.engine.loop.Engine.call`); ``fn`` must pickle (a module-level
        function or a ``functools.partial`` of one; a :class:`RemoteBackend` in it becomes
        the child's backend). At most :data:`~pipeline.engine.loop.MAX_CALLS` wait at once
        (more is a :class:`~pipeline.errors.CapacityError`); a call cancelled before it
        starts never runs."""
        try:
            payload = _dumps(fn)
        except Exception as exc:
            raise InvalidValueError("fn", fn, "cannot be sent to the engine process (a "
                                    f"module-level function or a partial of one): {exc!r}"
                                    ) from exc
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            if len(self._calls) >= MAX_CALLS:
                raise CapacityError(f"{MAX_CALLS} calls already wait for the engine")
            key = next(self._keys)
            self._calls[key] = future
            self._send(("call", key, payload))
        future.add_done_callback(lambda f: self._uncall(key) if f.cancelled() else None)
        return future

    def wake(self) -> None:
        """Forward the cancellations asked since the last look (never blocks)."""
        with self._lock:
            for key, flight in self._flights.items():
                if flight.job.handle.cancel_requested and not flight.cancel_sent:
                    flight.cancel_sent = True
                    self._send(("cancel", key, b""))

    def strategy(self, order: tuple[str, ...] | None) -> Strategy:
        """The strategy for ``order``, built here from the request side's stages."""
        if self._strategies is None:
            raise BackendError("this engine has no request side: use ProcessEngine.pipeline()")
        if order not in self._strategy_cache:
            self._strategy_cache[order] = self._strategies(order)
        return self._strategy_cache[order]

    @property
    def alive(self) -> bool:
        """True while the child runs and takes work."""
        return self._process.is_alive() and self.failure is None and not self._closing

    @property
    def steps(self) -> int:
        """Steps the child's engine has begun."""
        return self._figure(_STEPS)

    @property
    def active_slots(self) -> int:
        """Requests holding a slot in the child (0 once it stopped)."""
        return self._figure(_ACTIVE) if self.alive else 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot in the child (0 once it stopped)."""
        return self._figure(_QUEUED) if self.alive else 0

    def stall(self) -> Stall | None:
        """What holds the child up, if anything; None while it answers, and once stopped.

        A step in progress is timed from its start, which the child's engine thread writes
        itself on the monotonic clock both processes share, so a step wedged from its first
        instant is seen. Between steps the child is :class:`Unresponsive` once it has gone
        unheard longer than :data:`QUIET_S`, timed by this engine's ``clock``: its heartbeat
        has not moved (a frozen or stopped process), or a message sent to it has not been
        taken up (a receiver wedged outside a step) — whether or not it holds requests. Each
        look notes when the child's figures last moved, so the watchdog's looks (a few per
        stall timeout) are what time it."""
        if not self.alive:
            return None
        now = self._clock()
        with self._lock:
            steps, started = int(self._shared[_STEPS]), int(self._shared[_STARTED])
            beat, taken = int(self._shared[_BEAT]), int(self._shared[_TAKEN])
            if beat != self._beat[0]:
                self._beat = (beat, now)
            if taken != self._taken[0]:
                self._taken = (taken, now)
            ids = tuple(f.job.request.request_id for f in self._flights.values())
            silent = now - self._beat[1]
            untaken = now - max(self._waiting_since, self._taken[1]) if taken < self._sent else 0
        if started:
            return Stall(steps, (time.monotonic_ns() - started) / 1e9, "the engine process", ids)
        if max(silent, untaken) <= QUIET_S * 1e9:
            return None
        if silent >= untaken:
            return Unresponsive(steps, silent / 1e9, "has given no sign of life", ids)
        return Unresponsive(steps, untaken / 1e9, "has not taken up the work sent to it", ids)

    def abandon(self, why: str) -> None:
        """Give up on the child (a stalled step, an unresponsive child): its requests and
        calls fail with ``why`` at once, new work is refused, ``on_stop`` runs, and the child
        is killed (SIGKILL: a stopped process ends too)."""
        if not self._stop(why):
            return
        log.error("killing the engine process %d: %s", self.pid, why)
        self._process.kill()

    def fresh(self) -> ProcessEngine:
        """A new child from the same recipe, with this engine's strategies, ``on_stop`` and
        clock. Raises :class:`~pipeline.errors.StepStillRunning` while the old child has not
        exited (a process in an uninterruptible device call may hold its memory a while)."""
        self._process.kill()
        self._process.join(5)
        if self._process.is_alive():
            raise StepStillRunning(f"the engine process {self.pid} has not exited yet; a "
                                   "fresh one would compete for its memory")
        engine = ProcessEngine.start(self.recipe, clock=self._clock)
        engine._strategies, engine.on_stop = self._strategies, self.on_stop
        return engine

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to cancel what is left and end; kill it if it has not in ``timeout``."""
        with self._lock:
            self._closing = True
            self._send(("close", 0, b""))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._outbox.put(None)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)

    # --- the parent's threads -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineClosed(f"the engine stopped ({self.failure}); a fresh one must be "
                               "started")
        if self._closing:
            raise EngineClosed("the engine is closed")

    def _send(self, message: tuple[str, int, bytes]) -> None:
        """Queue ``message`` for the writer thread (the caller holds ``_lock``). The child
        counts what it takes up: a message sent when it had taken all starts the wait
        :meth:`stall` times."""
        taken, now = int(self._shared[_TAKEN]), self._clock()
        if taken != self._taken[0]:
            self._taken = (taken, now)
        if taken >= self._sent:
            self._waiting_since = now
        self._sent += 1
        self._outbox.put(_dumps(message))

    def _figure(self, index: int) -> int:
        with self._lock:  # never a figure of a file already let go: see _release
            return int(self._shared[index])

    def _uncall(self, key: int) -> None:
        with self._lock:
            if self._calls.pop(key, None) is not None and self.failure is None:
                self._send(("uncall", key, b""))

    def _write(self) -> None:
        """The writer thread: messages to the child, in order, until told to stop or the
        pipe breaks (the reader then sees the end and fails what is in flight)."""
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                return

    def _read(self) -> None:
        """The reader thread: the child's messages, until the pipe ends; between them, the
        deadlines the child has let pass (:meth:`_expire`)."""
        why: str | None = None
        try:
            while True:
                if self._conn.poll(_DEADLINE_LOOK_S):
                    kind, key, extra, payload = _loads(self._conn.recv_bytes())
                    if kind == "stopped":
                        why = extra
                    else:
                        self._dispatch(kind, key, extra, payload)
                if self._deadlines:
                    self._expire(time.monotonic_ns())
        except (EOFError, OSError):
            pass
        except Exception as exc:  # the framing itself broke: the child cannot be trusted
            why = f"unreadable message from the engine process: {exc!r}"
        self._process.kill()  # the pipe ended: whatever the child still does is unheard
        self._died(why)

    def _dispatch(self, kind: str, key: int, extra: str, payload: bytes) -> None:
        """One message; a payload that cannot be read fails only its request or call."""
        if kind == "delta":
            with self._lock:
                flight = self._flights.get(key)
            if flight is None:
                return
            try:
                delta: Delta = _loads(payload)
            except Exception as exc:
                self._fail_one(key, f"a delta could not be read from the engine process: "
                                    f"{exc!r}")
                return
            flight.job.handle._push(delta)
        elif kind == "done":
            with self._lock:
                flight = self._flights.pop(key, None)
            if flight is None or flight.ended:
                return
            try:
                completion: Completion = _loads(payload)
            except Exception as exc:
                _fail(flight, f"the completion could not be read from the engine process: "
                              f"{exc!r}")
                return
            try:
                flight.job.tracer.adopt(completion.trace)
            except Exception:  # a sink's failure must not keep the caller waiting
                log.exception("handing the engine process's trace events to the sinks failed")
            flight.job.handle._complete(completion, RequestState(extra))
        elif kind == "result":
            with self._lock:
                future = self._calls.pop(key, None)
            if future is None or not future.set_running_or_notify_cancel():
                return
            try:
                value = _loads(payload)
            except Exception as exc:
                future.set_exception(BackendError(f"the call's answer could not be read from "
                                                  f"the engine process: {exc!r}"))
                return
            if extra == "ok":
                future.set_result(value)
            else:
                future.set_exception(value)

    def _expire(self, now: int) -> None:
        """End here each request whose deadline passed :data:`DEADLINE_GRACE_S` ago without
        the child ending it, as the child would (:func:`_ended_by_deadline`), and tell the
        child to cancel it; the child holds it (and :meth:`stall` counts it) until it says
        ``done``."""
        ended = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, key = heapq.heappop(self._deadlines)
                flight = self._flights.get(key)
                if flight is None or flight.ended:
                    continue
                flight.ended = True
                if not flight.cancel_sent and self.failure is None:
                    flight.cancel_sent = True
                    self._send(("cancel", key, b""))
                ended.append(flight)
        for flight in ended:
            log.warning("request %s passed its deadline and the engine process %d did not "
                        "end it; ended here", flight.job.request.request_id, self.pid)
            _ended_by_deadline(flight)

    def _fail_one(self, key: int, error: str) -> None:
        with self._lock:
            flight = self._flights.pop(key, None)
            if flight is not None and self.failure is None:
                self._send(("cancel", key, b""))
        if flight is not None:
            _fail(flight, error)

    def _stop(self, why: str) -> bool:
        """Stop taking work and fail everything in flight with ``why``; run ``on_stop``.
        False when already stopped or closing (nothing is done twice)."""
        with self._lock:
            if self.failure is not None or self._closing:
                return False
            self.failure = why
            flights, self._flights = list(self._flights.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(f"{ENGINE_DOWN}: {why}"))
        for flight in flights:
            _fail(flight, f"{ENGINE_DOWN}: {why}")
        if self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:
                log.exception("the engine's on_stop failed")
        return True

    def _died(self, why: str | None) -> None:
        """The pipe ended: the child is gone (or killed just now). Its descriptors here are
        closed (:meth:`_release`) before anything is failed."""
        self._process.join(5)
        self._outbox.put(None)
        self._release()
        if self._closing:  # close(): what the child did not answer ends as closed
            with self._lock:
                flights, self._flights = list(self._flights.values()), {}
                calls, self._calls = list(self._calls.values()), {}
            for future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineClosed("the engine is closed"))
            for flight in flights:
                _fail(flight, "the engine is closed")
            return
        why = why or f"the engine process {_exit(self._process.exitcode)}"
        if self._stop(why):
            log.error("the engine process %d stopped: %s", self.pid, why)

    def _release(self) -> None:
        """Close this side's socket and figures file once the writer has let go (never a
        descriptor another thread may still write to: its number could be reused). The
        figures read afterwards are the last the child wrote."""
        self._writer.join(5)
        if self._writer.is_alive():
            log.warning("the engine process %d's writer thread did not end; its socket stays "
                        "open", self.pid)
            return
        with self._lock:
            self._shared = tuple(int(v) for v in self._shared)
        self._process.release()


def _fail(flight: _Flight, error: str) -> None:
    """End a request the dead child held: what reached this process, and the error (not
    one already ended here at its deadline)."""
    if flight.ended:
        return
    job = flight.job
    pushed = job.handle.pushed()
    ids = tuple(t for d in pushed for t in d.token_ids)
    text = "".join(d.text for d in pushed)
    tracer = job.tracer
    try:
        tracer.emit("engine", "generation.finished", {
            "reason": FinishReason.ERROR.value, "detail": error, "completion_tokens": len(ids),
            "state": RequestState.FAILED.value}, job.spec.last_event)
    except Exception:  # a sink's failure must not keep the caller waiting
        log.exception("tracing a failed request raised")
    elapsed = (time.monotonic_ns() - job.spec.accepted_ns) / 1e9
    completion = Completion(
        request_id=job.request.request_id, text=text, token_ids=ids,
        finish_reason=FinishReason.ERROR, usage=Usage(len(job.spec.prompt.input_ids), len(ids)),
        trace=tracer.events, timings=Timings(elapsed, None, elapsed), stop_reason=None,
        error=error)
    job.handle._abort(completion)


def _ended_by_deadline(flight: _Flight) -> None:
    """End a request at its deadline in this process, as the engine ends one
    (:meth:`~pipeline.engine.loop.Engine._settle`): a final delta and a completion with
    ``finish_reason`` deadline and ``stop_reason`` ``"deadline"``, no error, state finished,
    with the text and tokens that reached this process."""
    job = flight.job
    handle = job.handle
    pushed = handle.pushed()
    ids = tuple(t for d in pushed for t in d.token_ids)
    text = "".join(d.text for d in pushed)
    tracer = job.tracer
    try:
        tracer.emit("engine", "generation.finished", {
            "reason": FinishReason.DEADLINE.value, "detail": "deadline",
            "completion_tokens": len(ids), "output_digest": digest_ids(ids),
            "text_digest": digest_text(text), "state": RequestState.FINISHED.value},
            job.spec.last_event)
    except Exception:  # a sink's failure must not keep the caller waiting
        log.exception("tracing a request ended at its deadline raised")
    parts: list[Part] = []
    joined(parts, [p for d in pushed for p in d.parts])
    logprobs = tuple(lp for d in pushed for lp in d.logprobs)
    elapsed = (time.monotonic_ns() - job.spec.accepted_ns) / 1e9
    completion = Completion(
        request_id=job.request.request_id, text=text, token_ids=ids,
        finish_reason=FinishReason.DEADLINE, usage=Usage(len(job.spec.prompt.input_ids), len(ids)),
        trace=tracer.events, timings=Timings(elapsed, None, elapsed), stop_reason="deadline",
        logprobs=logprobs if job.request.generation_config.logprobs else None,
        parts=tuple(parts))
    if not (pushed and pushed[-1].final):
        handle._push(Delta(handle.request_id, len(pushed), "",
                           finish_reason=FinishReason.DEADLINE))
    handle._complete(completion, RequestState.FINISHED)


def _dumps(message: Any) -> bytes:
    """``message`` pickled by value (plain :mod:`pickle`: a tensor travels as its data, never
    as a handle to shared memory the other process could not open)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a :class:`BackendError` saying what
    it was (an exception whose constructor takes other arguments than its message)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return BackendError(f"{type(exc).__name__}: {exc}")


class _Child:
    """The child process: ``python -c`` importing this module (never the parent's main
    script, which a bare script without a main guard would run again), with the parent's
    import path, one end of a socket pair as its :class:`Connection`, and a small shared
    file mapped by both for the liveness figures."""

    def __init__(self, popen: subprocess.Popen[bytes], conn: Connection,
                 figures: IO[bytes], mapped: mmap.mmap, followers: Followers | None = None
                 ) -> None:
        self.popen, self.conn, self._figures, self._mapped = popen, conn, figures, mapped
        self.followers = followers
        """Ranks 1 … N−1 when the child is rank 0 of a parallel group, else None."""
        self.shared = memoryview(mapped).cast("q")
        self.pid = popen.pid

    @classmethod
    def spawn(cls, recipe: EngineRecipe | None = None) -> _Child:
        """The child; for a recipe of several ranks, rank 0 of a fresh group (a new port),
        its followers started first."""
        from multiprocessing.connection import Connection

        from pipeline.engine.ranks import Followers, free_port, group_env

        followers, env = None, None
        if recipe is not None and recipe.ranks > 1:
            port = free_port()
            followers = Followers.spawn(_dumps(recipe), recipe.ranks, port)
            env = group_env(0, recipe.ranks, port)
        here, there = socket.socketpair()
        figures = tempfile.TemporaryFile()
        try:
            figures.truncate(_FIGURES_SIZE)
            boot = (f"import sys; sys.path[:0] = {sys.path!r}; "
                    "from pipeline.engine.process import _child_entry; "
                    f"_child_entry({there.fileno()}, {figures.fileno()})")
            popen = subprocess.Popen([sys.executable, "-c", boot], env=env,
                                     pass_fds=(there.fileno(), figures.fileno()))
        except BaseException:
            here.close()
            figures.close()
            if followers is not None:
                followers.stop()
            raise
        finally:
            there.close()
        mapped = mmap.mmap(figures.fileno(), _FIGURES_SIZE)
        return cls(popen, Connection(here.detach()), figures, mapped, followers)

    def wait_loaded(self, timeout: float) -> None:
        """Wait for the child's first answer (ready or failed); a
        :class:`~pipeline.errors.BackendError` when none comes in ``timeout`` or a follower
        rank ends first (its error is in this process's standard error)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            lost = self.followers.exited() if self.followers is not None else None
            if lost is not None:
                raise BackendError(f"rank {lost[0]} of the parallel group {_exit(lost[1])} "
                                   "while loading its part of the model")
            if time.monotonic() >= deadline:
                raise BackendError(f"the engine process did not load its model in "
                                   f"{timeout:.0f} s")

    def release(self) -> None:
        """Close this side's descriptors: the socket, the figures' view, map and file (the
        Popen holds none: the child's standard streams are this process's own)."""
        self.conn.close()
        self.shared.release()
        self._mapped.close()
        self._figures.close()

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the child (a stopped process ends too), and its followers with it."""
        with contextlib.suppress(OSError):
            self.popen.kill()
        if self.followers is not None:
            self.followers.stop()

    def join(self, timeout: float) -> None:
        """Wait ``timeout`` at most for the child to end; its followers end with it (their
        call channel closes), or are killed."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if self.followers is not None and self.popen.poll() is not None:
            self.followers.stop(timeout)


def _exit(code: int | None) -> str:
    """How a child process ended, in words."""
    if code is None:
        return "did not end"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (by hand, or by the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{why}"
    return f"exited with status {code}"


# --- the child -----------------------------------------------------------------------------------

_CHILD: dict[str, Any] = {}


def _child_backend() -> Any:
    """The child's real backend (what a pickled :class:`RemoteBackend` becomes)."""
    return _CHILD["backend"]


def _child_entry(conn_fd: int, figures_fd: int) -> None:
    """The child's start (:class:`_Child`): its connection and figures from their file
    descriptors (kept from any process it starts, so its death closes the pipe), then the
    recipe as the first message."""
    from multiprocessing.connection import Connection

    for fd in (conn_fd, figures_fd):
        os.set_inheritable(fd, False)
    conn = Connection(conn_fd)
    shared = memoryview(mmap.mmap(figures_fd, _FIGURES_SIZE)).cast("q")
    try:
        recipe = _loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    _child_main(conn, recipe, shared)


def _child_main(conn: Connection, recipe: EngineRecipe, shared: Any) -> None:
    """The child: build the recipe, report ready, then serve the parent until it says close
    or goes away. Each message is handled on its own: one that cannot be read or run
    answers its request or call with the error and the child goes on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    try:
        from pipeline.builder import build

        for prepare in recipe.setup:
            prepare()
        pipe = build(recipe.model, options=recipe.options, **recipe.build_args)
        engine = pipe.engine
        if not isinstance(engine, Engine):
            raise BackendError("the recipe builds no model backend")
    except Exception as exc:
        conn.send_bytes(_dumps(("failed", f"{type(exc).__name__}: {exc}")))
        return
    backend = engine.backend
    _CHILD["backend"] = backend
    hidden = getattr(backend, "hidden_size", None)
    describe = getattr(backend, "model_info", None)
    conn.send_bytes(_dumps(("ready", _Facts(
        backend.vocab_size, backend.num_slots, backend.max_context, backend.snapshot,
        getattr(backend, "batch_invariant", None), describe() if callable(describe) else None,
        hidden if isinstance(hidden, int) else None, os.getpid()))))
    served = _Served(pipe, engine, conn)

    def stopped(why: str) -> None:  # the engine loop died: say why, then end this process
        with contextlib.suppress(Exception):
            served.send("stopped", 0, why)
        os._exit(3)

    def step(steps: int, started: int) -> None:  # on the engine thread, at a step's edges
        shared[_STEPS], shared[_STARTED] = steps, started

    engine.on_stop, engine.on_step = stopped, step
    done = threading.Event()
    threading.Thread(target=_publish, args=(engine, shared, done), daemon=True).start()
    try:
        while True:
            try:
                kind, key, payload = _loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone
                break
            if kind == "close":
                break
            try:
                served.handle(kind, key, payload)
            except Exception:  # contained: the parent hears of it through that request
                log.exception("the engine process could not handle a %r message", kind)
            shared[_TAKEN] += 1  # taken up: the parent times what is not (stall)
    finally:
        done.set()
        engine.close()


class _Served:
    """The child's side of the requests and calls it was sent, by the parent's keys."""

    def __init__(self, pipe: Pipeline, engine: Engine, conn: Connection) -> None:
        self.pipe, self.engine, self.conn = pipe, engine, conn
        self.lock = threading.Lock()
        self.handles: dict[int, RequestHandle] = {}
        self.calls: dict[int, concurrent.futures.Future[Any]] = {}

    def send(self, kind: str, key: int, extra: str = "", payload: bytes = b"") -> None:
        data = _dumps((kind, key, extra, payload))
        with self.lock:
            self.conn.send_bytes(data)

    def handle(self, kind: str, key: int, payload: bytes) -> None:
        if kind == "submit":
            self.submit(key, payload)
        elif kind == "cancel":
            handle = self.handles.get(key)
            if handle is not None:
                handle.cancel()
        elif kind == "call":
            self.call(key, payload)
        elif kind == "uncall":
            future = self.calls.pop(key, None)
            if future is not None:
                future.cancel()

    def submit(self, key: int, payload: bytes) -> None:
        try:
            spec, events = _loads(payload)
        except Exception as exc:
            failed = Completion("", "", (), FinishReason.ERROR, Usage(0, 0), (),
                                Timings(0.0, None, 0.0), error=f"the engine process could "
                                f"not read the request: {exc!r}")
            self.send("done", key, RequestState.FAILED.value, _dumps(failed))
            return
        handle = RequestHandle(spec.request.request_id, self.engine.wake)
        self.handles[key] = handle

        def on_delta(delta: Delta) -> None:
            self.send("delta", key, "", _dumps(delta))

        def on_done(completion: Completion) -> None:
            self.handles.pop(key, None)
            self.send("done", key, handle.state.value, _dumps(completion))

        handle.add_listener(on_delta)
        handle.add_done_callback(on_done)
        try:
            self.engine.submit(self.pipe.job(spec, Tracer.resume(events), handle))
        except Exception as exc:  # refused here: the parent's request fails with why
            handle._abort(Completion(spec.request.request_id, "", (), FinishReason.ERROR,
                                     Usage(len(spec.prompt), 0), tuple(events),
                                     Timings(0.0, None, 0.0), error=repr(exc)))

    def call(self, key: int, payload: bytes) -> None:
        def answer(future: concurrent.futures.Future[Any]) -> None:
            self.calls.pop(key, None)
            if future.cancelled():
                return
            exc = future.exception()
            if exc is None:
                try:
                    self.send("result", key, "ok", _dumps(future.result()))
                    return
                except Exception as err:  # an answer that cannot be pickled
                    exc = BackendError(f"the call's answer cannot be sent back: {err!r}")
            self.send("result", key, "error", _dumps(_portable(exc)))

        try:
            fn = _loads(payload)
            future = self.engine.call(fn)
        except Exception as exc:
            self.send("result", key, "error", _dumps(_portable(exc)))
            return
        self.calls[key] = future
        future.add_done_callback(answer)


def _publish(engine: Engine, shared: Any, done: threading.Event) -> None:
    """Every :data:`PUBLISH_S` until ``done``: a heartbeat (a count the parent watches move)
    and the request counts (the step figures are the engine thread's own:
    ``Engine.on_step``)."""
    while not done.wait(PUBLISH_S):
        shared[_BEAT] += 1
        with contextlib.suppress(Exception):
            shared[_ACTIVE] = engine.active_slots
            shared[_QUEUED] = engine.queue_depth
