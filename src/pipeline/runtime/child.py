"""The engine process's side: build the recipe, report ready, serve the parent.

Owns :func:`entry` (how the child starts: ``python -c`` importing this module, never the
parent's main script), :func:`serve` and :class:`Served` (the requests and calls the parent
sent, by its keys) and :func:`publish` (the heartbeat and request counts in the shared figures
file). The parent's side, and what the child promises it, is :mod:`pipeline.runtime.parent`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import mmap
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.errors import BackendError
from pipeline.events import Tracer
from pipeline.runtime.thread import ThreadEngine
from pipeline.runtime.wire import (
    ACTIVE, BEAT, FIGURES_SIZE, QUEUED, SERVED, STARTED, STEPS, TAKEN, EngineRecipe, Facts, dumps,
    loads, portable,
)
from pipeline.contracts.model import LayerTaps
from pipeline.contracts.output import Completion, Delta, FinishReason, Timings, Usage

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pipeline.pipe import Pipeline

log = logging.getLogger("pipeline.engine")
PUBLISH_S = 0.01
"""How often the child beats and rewrites its counts of requests active and queued."""




def entry(conn_fd: int, figures_fd: int) -> None:
    """The child's start (:class:`~pipeline.runtime.parent.Child`): its connection and
    figures from their file descriptors (kept from any process it starts, so its death closes
    the pipe), then the recipe as the first message."""
    from multiprocessing.connection import Connection

    for fd in (conn_fd, figures_fd):
        os.set_inheritable(fd, False)
    conn = Connection(conn_fd)
    shared = memoryview(mmap.mmap(figures_fd, FIGURES_SIZE)).cast("q")
    try:
        recipe = loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    serve(conn, recipe, shared)


def serve(conn: Connection, recipe: EngineRecipe, shared: Any) -> None:
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
        if not isinstance(engine, ThreadEngine):
            raise BackendError("the recipe builds no model backend")
    except Exception as exc:
        conn.send_bytes(dumps(("failed", f"{type(exc).__name__}: {exc}")))
        return
    backend = engine.backend
    SERVED["backend"] = backend
    hidden = getattr(backend, "hidden_size", None)
    describe = getattr(backend, "model_info", None)
    conn.send_bytes(dumps(("ready", Facts(
        backend.vocab_size, backend.num_slots, backend.max_context, backend.snapshot,
        getattr(backend, "batch_invariant", None), describe() if callable(describe) else None,
        hidden if isinstance(hidden, int) else None, os.getpid(),
        backend.tap_names() if isinstance(backend, LayerTaps) else None))))
    served = Served(pipe, engine, conn)

    def stopped(why: str) -> None:  # the engine loop died: say why, then end this process
        with contextlib.suppress(Exception):
            served.send("stopped", 0, why)
        os._exit(3)

    def step(steps: int, started: int) -> None:  # on the engine thread, at a step's edges
        shared[STEPS], shared[STARTED] = steps, started

    engine.on_stop, engine.on_step = stopped, step
    done = threading.Event()
    threading.Thread(target=publish, args=(engine, shared, done), daemon=True).start()
    try:
        while True:
            try:
                kind, key, payload = loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent is gone
                break
            if kind == "close":
                break
            try:
                served.handle(kind, key, payload)
            except Exception:  # contained: the parent hears of it through that request
                log.exception("the engine process could not handle a %r message", kind)
            shared[TAKEN] += 1  # taken up: the parent times what is not (stall)
    finally:
        done.set()
        engine.close()


class Served:
    """The child's side of the requests and calls it was sent, by the parent's keys."""

    def __init__(self, pipe: Pipeline, engine: ThreadEngine, conn: Connection) -> None:
        self.pipe, self.engine, self.conn = pipe, engine, conn
        self.lock = threading.Lock()
        self.handles: dict[int, RequestHandle] = {}
        self.calls: dict[int, concurrent.futures.Future[Any]] = {}

    def send(self, kind: str, key: int, extra: str = "", payload: bytes = b"") -> None:
        data = dumps((kind, key, extra, payload))
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
            spec, events = loads(payload)
        except Exception as exc:
            failed = Completion("", "", (), FinishReason.ERROR, Usage(0, 0), (),
                                Timings(0.0, None, 0.0), error=f"the engine process could "
                                f"not read the request: {exc!r}")
            self.send("done", key, RequestState.FAILED.value, dumps(failed))
            return
        handle = RequestHandle(spec.request.request_id, self.engine.wake)
        self.handles[key] = handle

        def on_delta(delta: Delta) -> None:
            self.send("delta", key, "", dumps(delta))

        def on_done(completion: Completion) -> None:
            self.handles.pop(key, None)
            self.send("done", key, handle.state.value, dumps(completion))

        handle.add_listener(on_delta)
        handle.add_done_callback(on_done)
        try:
            self.engine.submit(self.pipe.job(spec, Tracer.resume(events), handle))
        except Exception as exc:  # refused here: the parent's request fails with why
            handle.fail(Completion(spec.request.request_id, "", (), FinishReason.ERROR,
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
                    self.send("result", key, "ok", dumps(future.result()))
                    return
                except Exception as err:  # an answer that cannot be pickled
                    exc = BackendError(f"the call's answer cannot be sent back: {err!r}")
            self.send("result", key, "error", dumps(portable(exc)))

        try:
            fn = loads(payload)
            future = self.engine.call(fn)
        except Exception as exc:
            self.send("result", key, "error", dumps(portable(exc)))
            return
        self.calls[key] = future
        future.add_done_callback(answer)


def publish(engine: ThreadEngine, shared: Any, done: threading.Event) -> None:
    """Every :data:`PUBLISH_S` until ``done``: a heartbeat (a count the parent watches move)
    and the request counts (the step figures are the engine thread's own:
    ``ThreadEngine.on_step``)."""
    while not done.wait(PUBLISH_S):
        shared[BEAT] += 1
        with contextlib.suppress(Exception):
            shared[ACTIVE] = engine.active_slots
            shared[QUEUED] = engine.queue_depth
