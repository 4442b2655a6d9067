"""The engine in a child process, started and watched by this one.

Owns :class:`ProcessEngine`, :class:`RemoteBackend` and the child's side. A
:class:`~pipeline.engine.loop.Engine` on a thread cannot outlive what kills its process: a
native crash in a kernel, the out-of-memory killer, a wedged device call that no thread can
interrupt. A ``ProcessEngine`` runs the model and the scheduler — a whole pipeline built from
an :class:`EngineRecipe` — in a child process (a fresh interpreter: :class:`_Child`), while this
process keeps the request side (render, tokenize, validate: a pipeline over a
:class:`RemoteBackend` that only answers the model's figures). It provides
:class:`~pipeline.engine.api.EngineAPI`, so a :class:`~pipeline.pipe.Pipeline` and the HTTP
gateway's supervision use it as they use the thread engine.

**Wire.** One socket pair of tuples pickled by value (:func:`_put`). To the child: ``("submit", spec, events)`` (the
:class:`~pipeline.engine.job_spec.JobSpec`, plain data, and the trace so far), ``("cancel",
request_id)``, ``("call", call_id, fn)`` (:meth:`ProcessEngine.call`: ``fn`` is pickled, and a
:class:`RemoteBackend` inside it arrives as the child's real backend), ``("close",)``. From the
child: ``("ready", facts)`` or ``("failed", reason)`` once at start, then ``("delta",
request_id, delta)``, ``("done", request_id, completion, state)``, ``("result", call_id, ok,
value)`` and ``("stopped", why)`` when its engine loop dies. Liveness figures (steps begun, the
start of the step in progress, requests active and queued) sit in a shared array the child
rewrites every :data:`PUBLISH_S`, so the stall watchdog reads them without a round trip.

**Death.** When the pipe closes without a ``close`` (the child was killed — SIGKILL, the
out-of-memory killer — or crashed, or its engine loop died), every request in flight ends at
once: a final delta with ``finish_reason`` error, then a failed completion whose error begins
``the engine stopped:`` and names how the process ended (its signal or exit status), with the
text and tokens that had reached this process and a ``generation.finished`` event closing its
trace. Waiting calls fail with :class:`~pipeline.errors.EngineClosed`; new work is refused
with it; ``on_stop`` is called (the gateway then has ``/health`` say ``restarting`` and starts
a :meth:`ProcessEngine.fresh` one). :meth:`ProcessEngine.abandon` (a stalled step) kills the
child, which a thread engine cannot do.

Example::

    engine = ProcessEngine.start(EngineRecipe("smollm2", BackendOptions(num_slots=4)))
    pipe = engine.pipeline()              # request side here, model and scheduler there
    print(pipe.generate("Hello", max_tokens=8).text)
    pipe.close()                          # closes the child too
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.loop import ENGINE_DOWN, Stall
from pipeline.errors import BackendError, EngineClosed
from pipeline.events import Event, Tracer
from pipeline.options import BackendOptions
from pipeline.protocols import ModelCall, ModelInfo
from pipeline.types import Completion, Delta, FinishReason, Timings, Usage

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pipeline.engine.job import Job
    from pipeline.pipe import Pipeline
    from pipeline.protocols import Backend, Strategy

T = TypeVar("T")
log = logging.getLogger("pipeline.engine")

PUBLISH_S = 0.01
"""How often the child rewrites its liveness figures."""
START_TIMEOUT_S = 600.0
"""How long :meth:`ProcessEngine.start` waits for the child to load its model."""
_STEPS, _STARTED, _ACTIVE, _QUEUED = range(4)


@attrs.frozen
class EngineRecipe:
    """What the child builds: ``build(model, options=options, **build_args)`` (``model``
    None: the default model). Plain data, pickled to the child."""

    model: str | Path | None
    options: BackendOptions = attrs.field(factory=BackendOptions)
    build_args: dict[str, Any] = attrs.field(factory=dict)


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
    """A request in the child, as this process knows it: its job and what reached here."""

    job: Job
    ids: list[int] = attrs.field(factory=list)
    text: list[str] = attrs.field(factory=list)
    cancel_sent: bool = False


class ProcessEngine:
    """An engine whose model and scheduler run in a child process (module docstring).

    Build with :meth:`start` (blocks until the child has loaded its model; raises
    :class:`~pipeline.errors.BackendError` naming why it could not). Every method is safe from
    any thread."""

    def __init__(self, recipe: EngineRecipe, process: _Child, conn: Connection, shared: Any,
                 facts: _Facts, strategies: Callable[[tuple[str, ...] | None], Strategy] | None
                 = None) -> None:
        self.recipe = recipe
        self.pid = facts.pid
        """The child process's id."""
        self.backend: Backend = remote_backend(facts)
        self.failure: str | None = None
        self.on_stop: Callable[[str], None] | None = None
        self._process, self._conn, self._shared = process, conn, shared
        self._strategies = strategies
        self._strategy_cache: dict[tuple[str, ...] | None, Strategy] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._abandoned: str | None = None
        self._reader = threading.Thread(target=self._read, name="pipeline-engine-process",
                                        daemon=True)
        self._reader.start()

    # --- starting ------------------------------------------------------------------------------

    @classmethod
    def start(cls, recipe: EngineRecipe, timeout: float = START_TIMEOUT_S) -> ProcessEngine:
        """Start a child that builds ``recipe`` and wait until it is ready."""
        child = _Child.spawn()
        try:
            _put(child.conn, recipe)
            if not child.conn.poll(timeout):
                raise BackendError(f"the engine process did not load its model in "
                                   f"{timeout:.0f} s")
            message = _get(child.conn)
        except (EOFError, OSError) as exc:
            child.join(5)
            raise BackendError("the engine process ended while loading its model "
                               f"({_exit(child.exitcode)})") from exc
        except BackendError:
            child.kill()
            child.join(5)
            raise
        if message[0] != "ready":
            child.join(5)
            raise BackendError(f"the engine process could not load its model: {message[1]}")
        return cls(recipe, child, child.conn, child.shared, message[1])

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
        """Send ``job``'s spec and trace so far to the child."""
        rid = job.request.request_id
        with self._lock:
            self._check_open()
            self._flights[rid] = _Flight(job)
        self._send(("submit", job.spec, job.tracer.events))

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the child's engine thread between two steps
        (:meth:`~pipeline.engine.loop.Engine.call`); ``fn`` must pickle."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._check_open()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send(("call", call_id, fn))
        return future

    def wake(self) -> None:
        """Forward the cancellations asked since the last look."""
        with self._lock:
            asked = [f for f in self._flights.values()
                     if f.job.handle.cancel_requested and not f.cancel_sent]
            for flight in asked:
                flight.cancel_sent = True
        for flight in asked:
            with contextlib.suppress(OSError, ValueError):  # a dead child: _read ends it
                self._send(("cancel", flight.job.request.request_id))

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
        return int(self._shared[_STEPS])

    @property
    def active_slots(self) -> int:
        return int(self._shared[_ACTIVE])

    @property
    def queue_depth(self) -> int:
        return int(self._shared[_QUEUED])

    def stall(self) -> Stall | None:
        """The child's step in progress, timed by this process's clock (the same monotonic
        clock on one machine)."""
        started = int(self._shared[_STARTED])
        if not started:
            return None
        with self._lock:
            ids = tuple(self._flights)
        return Stall(int(self._shared[_STEPS]), (time.monotonic_ns() - started) / 1e9,
                     "the engine process", ids)

    def abandon(self, why: str) -> None:
        """Kill the child (a stalled step): its requests fail with ``why``."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self._abandoned = why
        log.error("killing the engine process %d: %s", self.pid, why)
        with contextlib.suppress(OSError):
            self._process.kill()

    def fresh(self) -> ProcessEngine:
        """A new child from the same recipe, with this engine's strategies and ``on_stop``."""
        self._process.join(5)
        engine = ProcessEngine.start(self.recipe)
        engine._strategies, engine.on_stop = self._strategies, self.on_stop
        return engine

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to cancel what is left and end; kill it if it has not in ``timeout``."""
        with self._lock:
            self._closing = True
        with contextlib.suppress(OSError, ValueError):
            self._send(("close",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)

    # --- the parent's reader --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineClosed(f"the engine stopped ({self.failure}); a fresh one must be "
                               "started")
        if self._closing:
            raise EngineClosed("the engine is closed")

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            _put(self._conn, message)

    def _read(self) -> None:
        why: str | None = None
        try:
            while True:
                message = _get(self._conn)
                kind = message[0]
                if kind == "delta":
                    self._delta(message[1], message[2])
                elif kind == "done":
                    self._done(message[1], message[2], message[3])
                elif kind == "result":
                    self._result(message[1], message[2], message[3])
                elif kind == "stopped":
                    why = message[1]
        except (EOFError, OSError):
            pass
        except Exception as exc:  # an unreadable message: the child cannot be trusted
            why = f"unreadable message from the engine process: {exc!r}"
            with contextlib.suppress(OSError):
                self._process.kill()
        self._died(why)

    def _delta(self, rid: str, delta: Delta) -> None:
        with self._lock:
            flight = self._flights.get(rid)
            if flight is not None:
                flight.ids.extend(delta.token_ids)
                flight.text.append(delta.text)
        if flight is not None:
            flight.job.handle._push(delta)

    def _done(self, rid: str, completion: Completion, state: str) -> None:
        with self._lock:
            flight = self._flights.pop(rid, None)
        if flight is None:
            return
        tracer = flight.job.tracer
        tracer.adopt(completion.trace)
        flight.job.handle._complete(completion, RequestState(state))

    def _result(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _died(self, why: str | None) -> None:
        self._process.join(5)
        closing = self._closing
        if self._abandoned is not None:
            why = self._abandoned
        elif why is None:
            why = ("the engine is closed" if closing
                   else f"the engine process {_exit(self._process.exitcode)}")
        with self._lock:
            if not closing:
                self.failure = why
            flights = list(self._flights.values())
            calls = list(self._calls.values())
            self._flights.clear()
            self._calls.clear()
        if not closing:
            log.error("the engine process %d stopped: %s", self.pid, why)
        for future in calls:
            if not future.done():
                future.set_exception(EngineClosed(f"{ENGINE_DOWN}: {why}"))
        for flight in flights:
            _fail(flight, f"{ENGINE_DOWN}: {why}")
        if not closing and self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:
                log.exception("the engine's on_stop failed")


def _fail(flight: _Flight, error: str) -> None:
    """End a request the dead child held: what reached this process, and the error."""
    job = flight.job
    ids = tuple(flight.ids)
    text = "".join(flight.text)
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


def _put(conn: Connection, message: Any) -> None:
    """Send ``message`` pickled by value (plain :mod:`pickle`: a tensor travels as its data,
    never as a handle to shared memory the other process could not open)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _get(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class _Child:
    """The child process: ``python -c`` importing this module (never the parent's main
    script, which a bare script without a main guard would run again), with the parent's
    import path, one end of a socket pair as its :class:`Connection`, and a small shared
    file mapped by both for the liveness figures."""

    def __init__(self, popen: subprocess.Popen[bytes], conn: Connection, shared: Any,
                 keep: Any) -> None:
        self.popen, self.conn, self.shared, self._keep = popen, conn, shared, keep
        self.pid = popen.pid

    @classmethod
    def spawn(cls) -> _Child:
        from multiprocessing.connection import Connection

        here, there = socket.socketpair()
        figures = tempfile.TemporaryFile()
        figures.truncate(8 * 4)
        boot = (f"import sys; sys.path[:0] = {sys.path!r}; "
                "from pipeline.engine.process import _child_entry; "
                f"_child_entry({there.fileno()}, {figures.fileno()})")
        popen = subprocess.Popen([sys.executable, "-c", boot],
                                 pass_fds=(there.fileno(), figures.fileno()))
        there.close()
        mapped = mmap.mmap(figures.fileno(), 8 * 4)
        conn = Connection(here.detach())
        return cls(popen, conn, memoryview(mapped).cast("q"), (figures, mapped))

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.popen.kill()

    def join(self, timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)


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
    descriptors, then the recipe as the first message."""
    from multiprocessing.connection import Connection

    conn = Connection(conn_fd)
    shared = memoryview(mmap.mmap(figures_fd, 8 * 4)).cast("q")
    try:
        recipe = _get(conn)
    except (EOFError, OSError):
        return
    _child_main(conn, recipe, shared)


def _child_main(conn: Connection, recipe: EngineRecipe, shared: Any) -> None:
    """The child: build the recipe, report ready, then serve the parent until it says close
    or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's
    send_lock = threading.Lock()

    def send(message: tuple[Any, ...]) -> None:
        with send_lock:
            _put(conn, message)

    try:
        from pipeline.builder import build

        pipe = build(recipe.model, options=recipe.options, **recipe.build_args)
        engine = pipe.engine
        if engine is None:
            raise BackendError("the recipe builds no model backend")
    except Exception as exc:
        send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    backend = engine.backend
    _CHILD["backend"] = backend
    hidden = getattr(backend, "hidden_size", None)
    describe = getattr(backend, "model_info", None)
    send(("ready", _Facts(backend.vocab_size, backend.num_slots, backend.max_context,
                          backend.snapshot, getattr(backend, "batch_invariant", None),
                          describe() if callable(describe) else None,
                          hidden if isinstance(hidden, int) else None, os.getpid())))

    def stopped(why: str) -> None:  # the engine loop died: say why, then end this process
        with contextlib.suppress(OSError, ValueError):
            send(("stopped", why))
        os._exit(3)

    engine.on_stop = stopped
    done = threading.Event()
    threading.Thread(target=_publish, args=(engine, shared, done), daemon=True).start()
    handles: dict[str, RequestHandle] = {}
    try:
        while True:
            try:
                message = _get(conn)
            except (EOFError, OSError):  # the parent is gone
                break
            kind = message[0]
            if kind == "submit":
                _child_submit(pipe, engine, message[1], message[2], handles, send)
            elif kind == "cancel":
                handle = handles.get(message[1])
                if handle is not None:
                    handle.cancel()
            elif kind == "call":
                _child_call(engine, message[1], message[2], send)
            elif kind == "close":
                break
    finally:
        done.set()
        engine.close()


def _child_submit(pipe: Pipeline, engine: Any, spec: Any, events: Sequence[Event],
                  handles: dict[str, RequestHandle], send: Callable[[tuple[Any, ...]], None]
                  ) -> None:
    rid = spec.request.request_id
    handle = RequestHandle(rid, engine.wake)
    handles[rid] = handle

    def on_delta(delta: Delta) -> None:
        send(("delta", rid, delta))

    def on_done(completion: Completion) -> None:
        handles.pop(rid, None)
        send(("done", rid, completion, handle.state.value))

    handle.add_listener(on_delta)
    handle.add_done_callback(on_done)
    try:
        engine.submit(pipe.job(spec, Tracer.resume(events), handle))
    except Exception as exc:  # refused here: the parent's request fails with why
        handles.pop(rid, None)
        completion = Completion(rid, "", (), FinishReason.ERROR, Usage(len(spec.prompt), 0),
                                tuple(events), Timings(0.0, None, 0.0), error=repr(exc))
        handle._abort(completion)


def _child_call(engine: Any, call_id: int, fn: Callable[[], Any],
                send: Callable[[tuple[Any, ...]], None]) -> None:
    def answer(future: concurrent.futures.Future[Any]) -> None:
        exc = future.exception()
        try:
            send(("result", call_id, exc is None, exc if exc is not None else future.result()))
        except Exception as err:  # an unpicklable result or exception: say so instead
            send(("result", call_id, False, BackendError(f"the call's answer cannot be "
                                                          f"sent back: {err!r}")))

    try:
        engine.call(fn).add_done_callback(answer)
    except Exception as exc:
        send(("result", call_id, False, exc))


def _publish(engine: Any, shared: Any, done: threading.Event) -> None:
    """Rewrite the liveness figures every :data:`PUBLISH_S` until ``done``."""
    while not done.wait(PUBLISH_S):
        stall = engine.stall()
        shared[_STARTED] = (time.monotonic_ns() - int(stall.running_s * 1e9)
                            if stall is not None else 0)
        shared[_STEPS] = engine.steps
        shared[_ACTIVE] = engine.active_slots
        shared[_QUEUED] = engine.queue_depth
