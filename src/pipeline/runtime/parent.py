"""The engine in a child process, started and watched by this one: the parent's side.

Owns :class:`ProcessEngine`, :class:`Unresponsive` and :class:`Child` (the process); the
child's side is :mod:`pipeline.runtime.child`, what crosses between them
:mod:`pipeline.runtime.wire` (one socket pair of messages pickled by value). A
:class:`~pipeline.runtime.thread.ThreadEngine` cannot outlive what kills its process: a native
crash in a kernel, the out-of-memory killer, a wedged device call that no thread can
interrupt. A ``ProcessEngine`` runs the model and the scheduler — a whole pipeline built from
an :class:`~pipeline.runtime.wire.EngineRecipe` — in a child process (a fresh interpreter:
:class:`Child`), while this process keeps the request side (render, tokenize, validate: a
pipeline over a :class:`~pipeline.runtime.wire.RemoteBackend` that only answers the model's
figures). It provides
:class:`~pipeline.engine.api.EngineAPI`, so a :class:`~pipeline.pipe.Pipeline` and the HTTP
gateway's supervision use it as they use the thread engine.

**Liveness.** Figures sit in a small file both processes map, read without a round trip: the
child's engine thread writes a step's number and start as it begins and ends
(``ThreadEngine.on_step``); a publisher thread, every
:data:`~pipeline.runtime.child.PUBLISH_S`, a heartbeat and the
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
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, TypeVar

import attrs

from pipeline.engine import api
from pipeline.engine.api import ENGINE_DOWN, Stall, Strategies
from pipeline.engine.handle import RequestState
from pipeline.errors import (
    BackendError, CapacityError, EngineClosed, InvalidValueError, StepStillRunning,
)
from pipeline.events import digest_ids, digest_text
from pipeline.output_parts import joined
from pipeline.runtime.wire import (
    ACTIVE, BEAT, FIGURES_SIZE, QUEUED, STARTED, STEPS, TAKEN, EngineRecipe, Facts, dumps,
    exit_words, loads, remote_backend,
)
from pipeline.contracts.output import Completion, Delta, FinishReason, Part, Timings, Usage

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pipeline.engine.job import Job
    from pipeline.pipe import Pipeline
    from pipeline.contracts.model import Backend
    from pipeline.contracts.strategy import Strategy
    from pipeline.runtime.ranks import Followers

T = TypeVar("T")
log = logging.getLogger("pipeline.engine")

START_TIMEOUT_S = 600.0
"""How long :meth:`ProcessEngine.start` waits for the child to load its model."""
QUIET_S = 0.5
"""How long the child may go unheard — no heartbeat, or work sent and not taken up — before
:meth:`ProcessEngine.stall` reports it (its publisher beats every
:data:`~pipeline.runtime.child.PUBLISH_S`)."""
DEADLINE_GRACE_S = 1.0
"""How long past a request's deadline this process waits for the child to end it before
ending it here (a child that answers ends it itself, at its next step, with all it wrote)."""
_DEADLINE_LOOK_S = 0.1
"""The longest the reader thread waits for a message before it looks at the deadlines."""

@attrs.frozen
class Unresponsive(Stall):
    """A child unheard between steps (:meth:`ProcessEngine.stall`): ``running_s`` is how long,
    ``phase`` what it has not done. The watchdog abandons it as it does a stalled step."""

    def what(self) -> str:
        return f"the engine process {self.phase} for {self.running_s:.1f} s"


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

    def __init__(self, recipe: EngineRecipe, process: Child, conn: Connection, shared: Any,
                 facts: Facts, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.recipe = recipe
        self.pid = facts.pid
        """The child process's id."""
        self.backend: Backend = remote_backend(facts)
        self.failure: str | None = None
        self.on_stop: Callable[[str], None] | None = None
        self._process, self._conn, self._shared = process, conn, shared
        self.strategies: Strategies | None = None
        """The request side's strategies (:meth:`pipeline`), for the checks at submit."""
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._keys = itertools.count()
        self._deadlines: list[tuple[int, int]] = []  # a heap of (when this process ends it, key)
        self._closing = False
        self._clock = clock
        now = clock()
        self._beat = (int(shared[BEAT]), now)      # the child's heartbeat, and when it changed
        self._sent, self._waiting_since = 0, now    # messages sent; when the oldest untaken was
        self._taken = (int(shared[TAKEN]), now)    # messages the child took, and when that moved
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
        child = Child.spawn(recipe)
        try:
            try:
                child.conn.send_bytes(dumps(recipe))
                child.wait_loaded(timeout)
                message = loads(child.conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise BackendError("the engine process ended while loading its model "
                                   f"({exit_words(child.exitcode)})") from exc
            if message[0] != "ready":
                raise BackendError(f"the engine process could not load its model: "
                                   f"{message[1]}")
        except BackendError:
            child.kill()
            child.join(5)
            child.release()
            raise
        engine = cls(recipe, child, child.conn, child.shared, message[1], clock)
        if child.followers is not None:  # a lost rank, even while idle, is the engine's loss
            child.followers.watch(lambda rank, code: engine.abandon(
                f"rank {rank} of the parallel group {exit_words(code)}"))
        return engine

    def pipeline(self) -> Pipeline:
        """The request side over this engine: ``build(model, backend=<this engine's
        RemoteBackend>, ...)`` with the recipe's arguments, its engine replaced by this one
        (whose strategies it takes, for the checks a request meets at submit)."""
        from pipeline.builder import build
        from pipeline.model_paths import DEFAULT_MODEL
        from pipeline.runtime.thread import ThreadEngine

        r = self.recipe
        model = r.model if r.model is not None else DEFAULT_MODEL
        pipe = build(model, options=r.options, backend=self.backend, **r.build_args)
        local = pipe.engine
        assert isinstance(local, ThreadEngine)
        local.close()
        self.strategies = local.engine.strategy
        pipe.engine = self
        return pipe

    # --- EngineAPI -----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Send ``job``'s spec and trace so far to the child. Raises
        :class:`~pipeline.errors.InvalidValueError` for a request that cannot cross to
        another process (a ``template_kwargs`` value that is not plain data, say) and
        :class:`~pipeline.errors.EngineClosed` once the engine stopped."""
        try:
            payload = dumps((job.spec, job.recorder.tracer.events))
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
        (:meth:`~pipeline.runtime.thread.ThreadEngine.call`); ``fn`` must pickle (a module-level
        function or a ``functools.partial`` of one; a :class:`RemoteBackend` in it becomes
        the child's backend). At most :data:`~pipeline.engine.api.MAX_CALLS` wait at once
        (more is a :class:`~pipeline.errors.CapacityError`); a call cancelled before it
        starts never runs."""
        try:
            payload = dumps(fn)
        except Exception as exc:
            raise InvalidValueError("fn", fn, "cannot be sent to the engine process (a "
                                    f"module-level function or a partial of one): {exc!r}"
                                    ) from exc
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            if len(self._calls) >= api.MAX_CALLS:
                raise CapacityError(f"{api.MAX_CALLS} calls already wait for the engine")
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
        if self.strategies is None:
            raise BackendError("this engine has no request side: use ProcessEngine.pipeline()")
        return self.strategies(order)

    @property
    def alive(self) -> bool:
        """True while the child runs and takes work."""
        return self._process.is_alive() and self.failure is None and not self._closing

    @property
    def steps(self) -> int:
        """Steps the child's engine has begun."""
        return self._figure(STEPS)

    @property
    def active_slots(self) -> int:
        """Requests holding a slot in the child (0 once it stopped)."""
        return self._figure(ACTIVE) if self.alive else 0

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot in the child (0 once it stopped)."""
        return self._figure(QUEUED) if self.alive else 0

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
            steps, started = int(self._shared[STEPS]), int(self._shared[STARTED])
            beat, taken = int(self._shared[BEAT]), int(self._shared[TAKEN])
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
        engine.strategies, engine.on_stop = self.strategies, self.on_stop
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
        taken, now = int(self._shared[TAKEN]), self._clock()
        if taken != self._taken[0]:
            self._taken = (taken, now)
        if taken >= self._sent:
            self._waiting_since = now
        self._sent += 1
        self._outbox.put(dumps(message))

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
                    kind, key, extra, payload = loads(self._conn.recv_bytes())
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
                delta: Delta = loads(payload)
            except Exception as exc:
                self._fail_one(key, f"a delta could not be read from the engine process: "
                                    f"{exc!r}")
                return
            flight.job.handle.push(delta)
        elif kind == "done":
            with self._lock:
                flight = self._flights.pop(key, None)
            if flight is None or flight.ended:
                return
            try:
                completion: Completion = loads(payload)
            except Exception as exc:
                _end_here(flight, FinishReason.ERROR, "the completion could not be read from "
                          f"the engine process: {exc!r}")
                return
            try:
                flight.job.recorder.tracer.adopt(completion.trace)
            except Exception:  # a sink's failure must not keep the caller waiting
                log.exception("handing the engine process's trace events to the sinks failed")
            flight.job.handle.complete(completion, RequestState(extra))
        elif kind == "result":
            with self._lock:
                future = self._calls.pop(key, None)
            if future is None or not future.set_running_or_notify_cancel():
                return
            try:
                value = loads(payload)
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
        the child ending it, as the child would (:func:`_end_here`), and tell the
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
            _end_here(flight, FinishReason.DEADLINE)

    def _fail_one(self, key: int, error: str) -> None:
        with self._lock:
            flight = self._flights.pop(key, None)
            if flight is not None and self.failure is None:
                self._send(("cancel", key, b""))
        if flight is not None:
            _end_here(flight, FinishReason.ERROR, error)

    def _stop(self, why: str) -> bool:
        """Stop taking work and fail everything in flight with ``why``; run ``on_stop``.
        False when already stopped or closing (nothing is done twice)."""
        with self._lock:
            if self.failure is not None or self._closing:
                return False
            self.failure = why
        self._end_all(f"{ENGINE_DOWN}: {why}")
        if self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:
                log.exception("the engine's on_stop failed")
        return True

    def _end_all(self, error: str) -> None:
        """Fail every request and call in flight with ``error``."""
        with self._lock:
            flights, self._flights = list(self._flights.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(error))
        for flight in flights:
            _end_here(flight, FinishReason.ERROR, error)

    def _died(self, why: str | None) -> None:
        """The pipe ended: the child is gone (or killed just now). Its descriptors here are
        closed (:meth:`_release`) before anything is failed."""
        self._process.join(5)
        self._outbox.put(None)
        self._release()
        if self._closing:  # close(): what the child did not answer ends as closed
            self._end_all("the engine is closed")
            return
        why = why or f"the engine process {exit_words(self._process.exitcode)}"
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


def _end_here(flight: _Flight, reason: FinishReason, error: str | None = None) -> None:
    """End here a request the child held, with the text and tokens that reached this
    process: failed with ``error`` (the child died; not one already ended at its deadline),
    or at its deadline as the engine ends one (:meth:`~pipeline.engine.loop.Engine.finish`):
    a final delta and a completion with ``finish_reason`` deadline and ``stop_reason``
    ``"deadline"``, no error, state finished."""
    if error is not None and flight.ended:
        return
    job, handle = flight.job, flight.job.handle
    pushed = handle.pushed()
    ids = tuple(t for d in pushed for t in d.token_ids)
    text = "".join(d.text for d in pushed)
    state = RequestState.FAILED if error is not None else RequestState.FINISHED
    payload: dict[str, Any] = {"reason": reason.value, "detail": error or "deadline",
                               "completion_tokens": len(ids)}
    if error is None:
        payload.update(output_digest=digest_ids(ids), text_digest=digest_text(text))
    try:
        job.recorder.emit("engine", "generation.finished", {**payload, "state": state.value},
                          job.spec.last_event)
    except Exception:  # a sink's failure must not keep the caller waiting
        log.exception("tracing a request ended here raised")
    parts: list[Part] = []
    joined(parts, [p for d in pushed for p in d.parts] if error is None else [])
    logprobs = tuple(lp for d in pushed for lp in d.logprobs)
    elapsed = (time.monotonic_ns() - job.spec.accepted_ns) / 1e9
    completion = Completion(
        request_id=job.request.request_id, text=text, token_ids=ids, finish_reason=reason,
        usage=Usage(len(job.spec.prompt.input_ids), len(ids)), trace=job.recorder.tracer.events,
        timings=Timings(elapsed, None, elapsed), stop_reason=None if error else "deadline",
        logprobs=logprobs if error is None and job.config.logprobs else None,
        parts=tuple(parts), error=error)
    if not (pushed and pushed[-1].final):
        handle.push(Delta(handle.request_id, len(pushed), "", finish_reason=reason))
    handle.complete(completion, state)


class Child:
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
    def spawn(cls, recipe: EngineRecipe | None = None) -> Child:
        """The child; for a recipe of several ranks, rank 0 of a fresh group (a new port),
        its followers started first."""
        from multiprocessing.connection import Connection

        from pipeline.runtime.ranks import Followers, free_port, group_env

        followers, env = None, None
        if recipe is not None and recipe.ranks > 1:
            port = free_port()
            followers = Followers.spawn(dumps(recipe), recipe.ranks, port)
            env = group_env(0, recipe.ranks, port)
        here, there = socket.socketpair()
        figures = tempfile.TemporaryFile()
        try:
            figures.truncate(FIGURES_SIZE)
            boot = (f"import sys; sys.path[:0] = {sys.path!r}; "
                    "from pipeline.runtime.child import entry; "
                    f"entry({there.fileno()}, {figures.fileno()})")
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
        mapped = mmap.mmap(figures.fileno(), FIGURES_SIZE)
        return cls(popen, Connection(here.detach()), figures, mapped, followers)

    def wait_loaded(self, timeout: float) -> None:
        """Wait for the child's first answer (ready or failed); a
        :class:`~pipeline.errors.BackendError` when none comes in ``timeout`` or a follower
        rank ends first (its error is in this process's standard error)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(0.5, max(0.0, deadline - time.monotonic()))):
            lost = self.followers.exited() if self.followers is not None else None
            if lost is not None:
                raise BackendError(f"rank {lost[0]} of the parallel group {exit_words(lost[1])} "
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
