"""The engine driven by a thread of this process, and its supervision.

Owns :class:`ThreadEngine`, which provides :class:`~pipeline.engine.api.EngineAPI` over one
:class:`~pipeline.engine.loop.Engine`: a daemon thread that takes what was submitted, runs one
:meth:`~ThreadEngine.call` between steps and then a step, and sleeps when nothing
can progress. Around the step it keeps the supervision: the call queue, the step's number,
start and phase for the stall watchdog (:meth:`ThreadEngine.stall`), :meth:`ThreadEngine.abandon`,
a loop that dies, :meth:`ThreadEngine.fresh` and closing at interpreter exit.

Containment. A device fault (:func:`~pipeline.errors.device_fault`) ends the loop:
nothing after it can be trusted. An exception anywhere else in a step fails the requests of
that step (the step contains narrower failures itself). Should the loop thread end all the
same (a ``BaseException``), it completes every handle it holds, refuses new work with
:class:`~pipeline.errors.EngineClosed` naming why (``failure``), and calls ``on_stop``;
:meth:`ThreadEngine.fresh` gives a new engine over the same backend.

Stalls. A step that does not return (a wedged kernel, a grammar that never ends, a deadlock)
holds every request of the engine. :meth:`ThreadEngine.stall` says how long the step in
progress has run (on the engine's clock), its number, its phase and its requests; a supervisor
(the HTTP gateway's) that finds it over its limit calls :meth:`ThreadEngine.abandon`: every
request held fails at once with the reason, new work is refused, and ``on_stop`` is called as
for a dead loop. The stuck thread cannot be killed: when its step returns it frees what its
requests held and ends without touching them again, and only then can
:meth:`ThreadEngine.fresh` start a new engine over the backend (before that it raises
:class:`~pipeline.errors.StepStillRunning`).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.engine import api
from pipeline.engine.api import ENGINE_DOWN, Stall, Strategies, StrategyFactory
from pipeline.engine.blocks import BlockStats
from pipeline.engine.job import Job
from pipeline.engine.loop import Engine, EngineConfig
from pipeline.errors import device_fault
from pipeline.errors import CapacityError, DeviceFault, EngineClosed, StepStillRunning
from pipeline.contracts.model import Backend
from pipeline.contracts.strategy import Strategy
from pipeline.contracts.output import FinishReason

T = TypeVar("T")
log = logging.getLogger("pipeline.engine")


class ThreadEngine:
    """Runs submitted :class:`Job`\\s to completion on a background thread.

    ``submit``, ``call`` and ``close`` may be called from any thread. The engine thread alone
    touches the backend (``call`` runs other work on it between steps) and the jobs' decode
    state.
    """

    def __init__(self, backend: Backend, strategies: StrategyFactory | Strategies,
                 config: EngineConfig | None = None,
                 on_stop: Callable[[str], None] | None = None,
                 decodable_vocab: int | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        made = strategies if isinstance(strategies, Strategies) else Strategies(strategies)
        self.engine = Engine(backend, made, config, decodable_vocab, clock)
        """The step this thread drives."""
        self.backend = backend
        self.on_stop = on_stop
        """Called once, on the engine thread, if the loop ends other than by ``close``."""
        self.on_step: Callable[[int, int], None] | None = None
        """Called on the engine thread with ``(steps begun, clock reading)`` as a step starts
        and ``(steps begun, 0)`` as it ends: a watcher in another process learns of a step
        from its first instant (:mod:`pipeline.runtime.child`)."""
        self.failure: str | None = None
        """Why the loop thread ended other than by ``close`` (None while it runs)."""
        self._cv = threading.Condition()
        self._incoming: list[Job] = []
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._closed = False
        self._steps = 0
        self._step_started: int | None = None  # clock reading while a step runs
        self._thread = threading.Thread(target=self._loop, name="pipeline-engine", daemon=True)
        self._thread.start()
        # A script that ends without closing its pipeline must not leave this thread inside
        # torch while the interpreter finalizes (the C++ runtime then aborts the process):
        # close at exit, holding the engine only weakly so it can still be collected.
        ref = weakref.ref(self)

        def close_at_exit() -> None:
            engine = ref()
            if engine is not None:
                engine.close(timeout=5.0)

        self._close_at_exit = close_at_exit
        atexit.register(close_at_exit)

    # --- what the step's engine answers --------------------------------------------------------

    @property
    def decodable_vocab(self) -> int | None:
        return self.engine.decodable_vocab

    @property
    def kv_blocks(self) -> BlockStats | None:
        """The block manager's counters over a paged backend (None: the backend keeps its
        memory). Read on another thread they are a snapshot that may be a step old."""
        return self.engine.memory.stats

    def strategy(self, order: tuple[str, ...] | None) -> Strategy:
        """The strategy for a processor order (built once per distinct order)."""
        return self.engine.strategy(order)

    # --- EngineAPI -------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`EngineClosed` after ``close``."""
        with self._cv:
            self._check_open()
            self._incoming.append(job)
            self._cv.notify()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between two steps (any thread may ask): the way
        to use the backend beside the engine's own calls (embeddings' forwards), since it is
        not thread-safe. One call runs per step, so a long series of them interleaves with
        decoding; an exception ``fn`` raises goes to the future. A call is not a step: the
        stall watchdog does not time it and the pacer does not learn from it, so its caller
        bounds its size. At most :data:`~pipeline.engine.api.MAX_CALLS` wait at once (more is
        a :class:`CapacityError`). Raises :class:`EngineClosed` as :meth:`submit` does; calls
        still waiting when the engine stops or is abandoned fail with it. A call cancelled
        before it starts never runs."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if len(self._calls) >= api.MAX_CALLS:
                raise CapacityError(f"{api.MAX_CALLS} calls already wait for the engine")
            self._check_open()
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def wake(self) -> None:
        """Make the loop look at its requests now (cancellation calls this)."""
        with self._cv:
            self._cv.notify()

    @property
    def alive(self) -> bool:
        """True while the loop thread runs and the engine takes work."""
        return self._thread.is_alive() and self.failure is None and not self._closed

    @property
    def steps(self) -> int:
        """Steps begun so far."""
        return self._steps

    @property
    def stepping(self) -> bool:
        """True while the loop thread runs (an abandoned one too, until its step returns)."""
        return self._thread.is_alive()

    @property
    def active_slots(self) -> int:
        """Requests holding a slot now."""
        return len(self.engine.active)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        with self._cv:
            return len(self.engine.queue) + len(self._incoming)

    def fresh(self, clock: Callable[[], int] | None = None) -> ThreadEngine:
        """A new engine over the same backend, strategies, config and ``on_stop`` (and
        clock, unless another is given), after this one stopped. Slots this engine still
        holds (a release that failed as it died) are released first, so the fresh engine has
        the backend's every slot. Raises :class:`~pipeline.errors.StepStillRunning` while an
        abandoned step runs, and :class:`~pipeline.errors.DeviceFault` when the backend says
        it is ``broken`` (it cannot be used again)."""
        if self._thread.is_alive():  # first: a release now would race the stuck step
            raise StepStillRunning(f"the abandoned engine's step {self._steps} has not "
                                   "returned yet; a fresh engine would share its backend")
        broken = getattr(self.backend, "broken", None)
        if broken:  # a backend that knows it cannot be used again (a parallel group that
            raise DeviceFault(broken)  # lost a rank): no fresh engine, the model stays down
        old = self.engine
        for slot in sorted(old.held):
            with contextlib.suppress(Exception):
                self.backend.release(slot)
        old.held.clear()
        return ThreadEngine(self.backend, old.strategy, old.config, self.on_stop,
                            old.decodable_vocab, clock or old.clock)

    def stall(self) -> Stall | None:
        """The step in progress now (None between steps and while idle). Any thread."""
        started = self._step_started
        if started is None:
            return None
        with self.engine.lock:
            ids = tuple(j.request.request_id for j in self.engine.active)
        return Stall(self._steps, (self.engine.clock() - started) / 1e9, self.engine.phase, ids)

    def abandon(self, why: str) -> None:
        """Give up on a stalled step (any thread): fail every request held with ``why``,
        refuse new work and call ``on_stop``, as for a loop that died. The stuck thread
        frees its requests' resources if its step ever returns, then ends."""
        with self._cv:
            if self.failure is not None or self._closed:
                return
            self.failure, self.engine.abandoned = why, True
            self._take_incoming()
            jobs = self._jobs()
        self._refuse_calls(why)
        log.error("abandoning the engine: %s", why)
        for job in jobs:
            job.abort(f"{ENGINE_DOWN}: {why}")
        self._call_on_stop(why)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is left, stop the thread, and wait for it."""
        atexit.unregister(self._close_at_exit)
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the loop --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineClosed(f"the engine stopped after an internal error "
                               f"({self.failure}); a fresh one must be started")
        if self._closed:
            raise EngineClosed("the engine is closed")

    def _take_incoming(self) -> None:
        """Queue what was submitted (holding ``_cv``)."""
        incoming, self._incoming = self._incoming, []
        with self.engine.lock:
            self.engine.queue.extend(incoming)

    def _jobs(self) -> list[Job]:
        """Every job the engine holds: queued, then active."""
        with self.engine.lock:
            return list(self.engine.queue) + list(self.engine.active)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the loop must not end silently: say why, free all
            log.critical("the engine loop stopped", exc_info=exc)
            self._stopped(f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._closed or self._incoming or engine.active or engine.queue
                           or self._calls):
                    self._cv.wait()
                if self._closed and not (engine.active or engine.queue or self._incoming):
                    self._refuse_calls("the engine is closed")
                    return
                closing = self._closed
                self._take_incoming()
                call = self._calls.popleft() if self._calls and not closing else None
            if closing:
                self._refuse_calls("the engine is closed")
                for job in self._jobs():
                    engine.finish(job, FinishReason.CANCELLED, "engine closed")
                continue
            try:
                self._steps += 1
                if call is not None:  # before the step's clock: neither stall nor pacing time
                    _run_call(*call)
                self._step_started = started = engine.clock()
                if self.on_step is not None:
                    self.on_step(self._steps, started)
                engine.step()
            except DeviceFault:  # the device cannot be trusted again: the loop ends
                raise
            except Exception as exc:  # a bug in a stage: fail what is in flight, keep going
                if not engine.abandoned:
                    self._recover(exc)
            finally:
                self._step_started, engine.phase = None, "idle"
                if self.on_step is not None:
                    self.on_step(self._steps, 0)
            if engine.abandoned:  # its callers were answered by abandon(): free what it held
                for job in self._jobs():
                    with contextlib.suppress(Exception):
                        engine.release(job)
                log.warning("the abandoned engine's step %d returned; its resources are "
                            "free", self._steps)
                return
            if engine.queue and not engine.active:  # sleep only when nothing can progress
                with self._cv:
                    self._cv.wait(engine.config.idle_wait_s)

    def _recover(self, exc: Exception) -> None:
        """After an unexpected error: fail every active job, finish any half-ended one.
        Never raises: each job's ending is contained on its own."""
        for job in list(self.engine.active):
            self.engine.fail(job, f"engine step failed: {exc!r}")
        for job in list(self.engine.queue):
            if job.state.terminal:
                self.engine.release(job)

    def _refuse_calls(self, why: str) -> None:
        """Fail every :meth:`call` still waiting with :class:`EngineClosed`."""
        with self._cv:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(f"the engine stopped: {why}"))

    def _call_on_stop(self, why: str) -> None:
        if self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:  # the supervisor's failure must not hide the stop
                log.exception("the engine's on_stop failed")

    def _stopped(self, why: str) -> None:
        """The loop is ending abnormally: refuse new work, end every job it holds. Whatever
        raises here (even a ``BaseException`` again), every handle is completed and
        ``on_stop`` is called."""
        with self._cv:
            self.failure = why
            jobs = list(self._incoming) + self._jobs()
            self._incoming.clear()
        with contextlib.suppress(BaseException):
            self._refuse_calls(why)
        try:
            for job in jobs:
                try:
                    self.engine.fail(job, f"{ENGINE_DOWN}: {why}")
                except BaseException as exc:  # the backend keeps failing: end the job bare
                    job.abort(f"{ENGINE_DOWN}: {why}; then {exc!r}")
        finally:
            with contextlib.suppress(BaseException):  # nothing more to do on this thread
                self._call_on_stop(why)


def _run_call(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
    """Run one :meth:`ThreadEngine.call` (unless it was cancelled), its outcome to ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as exc:  # the caller's failure, not the engine's
        future.set_exception(exc)
        if device_fault(exc):  # unless the device broke under it
            raise DeviceFault(f"device fault in an engine call: {exc!r}") from exc
