"""The engine: one thread driving many requests over backend slots (docs/design.md §4 and §6).

Owns the scheduler and the step loop. Each step it

1. settles cancellations and expired queue waits (any state; slots are freed at once),
2. admits queued requests to free slots (FIFO) and to KV memory for what they prefill
   (:class:`~pipeline.engine.paging.KVMemory`: over a
   :class:`~pipeline.contracts.model.PagedBackend` the blocks after what the prefix cache holds;
   over a backend that keeps its own memory, the trivial
   :class:`~pipeline.engine.paging.SlotMemory`),
3. plans the step under ``token_budget``: every decoding request's strategy plans its call
   first (a long prompt never starves decoding), then prefill chunks of at most
   ``max_prefill_chunk`` tokens for prefilling requests in admission order with what is left
   and, while requests decode, no more than the pacer allows so the step stays within
   ``step_latency_ratio`` of a decode-only step (:mod:`pipeline.engine.pacing`),
4. has KV memory grow each writing call's block table
   (:meth:`~pipeline.engine.paging.Paging.make_room`: when blocks run out the most recently admitted
   other request gives its blocks back, and the engine takes its slot and requeues it:
   preemption by recompute), then
   makes one batched ``backend.forward`` for that plan: every decode token and every prefill
   chunk is a :class:`~pipeline.contracts.model.ModelCall` of the same call (logits wanted at a
   decode token and at a prompt's last chunk's last token; the block table with each),
5. for every request with fresh logits z_t (:class:`~pipeline.engine.commit.Committer`): its
   strategy's processor chain → selector (overridden by a ``forced_prefix`` or a spent
   reasoning budget: :mod:`pipeline.engine.forcing`) → stoppers → detokenizer → delta; a request
   that goes on keeps y_t as its pending token, which the
   next step's forward writes into the cache (cache length m + t) — the docs/design.md §4 order;
   the blocks that filled up are then published to the prefix cache.

The KV memory rules (admission by free blocks, growth, preemption, publication, rollback,
release) are :mod:`pipeline.engine.paging`'s; a request's records (spec, decode state, text state,
trace) are :class:`~pipeline.engine.job.Job`'s.

Request-level work before the queue (render, tokenize, validation) happens in
:class:`~pipeline.pipe.Pipeline` on the caller's thread.

Containment. A device fault (:func:`device_fault`: a CUDA error that poisons the device
context) ends the loop as below: nothing after it can be trusted. Any other backend exception
fails the requests of that call (only the named slots for a
:class:`~pipeline.errors.SlotError`); a selector that raises, or returns something that is not
a token id of the vocabulary, fails the requests of its group; an exception while one request
takes its token fails that request alone; an exception anywhere else in a step fails the
requests of that step. Failing a request can itself raise (a corrupt job state): then its
handle is completed with a bare failure, so the caller still gets an answer. Should the loop
thread end all the same (a ``BaseException``), it completes every handle it holds, refuses new
work with :class:`~pipeline.errors.EngineClosed` naming why (``failure``), and calls
``on_stop``; :meth:`Engine.fresh` gives a new engine over the same backend.

Stalls. A step that does not return (a wedged kernel, a grammar that never ends, a deadlock)
holds every request of the engine. :meth:`Engine.stall` says how long the step in progress
has run, its number, its phase and its requests; a supervisor (the HTTP gateway's) that finds
it over its limit calls :meth:`Engine.abandon`: every request held fails at once with the
reason, new work is refused, and ``on_stop`` is called as for a dead loop. The stuck thread
cannot be killed: when its step returns it frees what its requests held and ends without
touching them again, and only then can :meth:`Engine.fresh` start a new engine over the
backend (before that it raises :class:`~pipeline.errors.StepStillRunning`).
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
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import torch

from pipeline.errors import (
    CapacityError, DeviceFault, EngineClosed, InvalidValueError, SlotError, StepStillRunning,
)
from pipeline.events import Tracer
from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.blocks import BlockStats, PrefixMatch
from pipeline.engine.job import Job
from pipeline.engine.pacing import Pacer
from pipeline.engine.paging import KVMemory, Paging, SlotMemory
from pipeline.contracts.model import (
    Backend, CacheInspector, CacheLayout, ModelCall, PagedBackend, PrefillChunk, split_outputs,
)
from pipeline.contracts.strategy import Strategy
from pipeline.engine.commit import Committer, cache_state, logits_records
from pipeline.contracts.output import FinishReason

StrategyFactory = Callable[[tuple[str, ...] | None], Strategy]
T = TypeVar("T")
MAX_CALLS = 256
"""The most :meth:`Engine.call`\\ s waiting at once."""
log = logging.getLogger("pipeline.engine")


@attrs.frozen
class EngineConfig:
    """Scheduling knobs. ``token_budget`` (tokens per step) and ``max_prefill_chunk``
    (tokens of one prompt per step) are hard caps; ``token_budget`` must exceed the
    backend's slot count so prefill always makes progress beside a full decode batch.
    ``step_latency_ratio`` bounds latency: a step that prefills beside decoding requests is
    sized to take about that multiple of a decode-only step (:mod:`pipeline.engine.pacing`);
    None turns pacing off (token caps only)."""

    token_budget: int = attrs.field(default=512)
    max_prefill_chunk: int = attrs.field(default=512)
    idle_wait_s: float = 0.5
    step_latency_ratio: float | None = attrs.field(default=1.5)

    @step_latency_ratio.validator
    def _ratio(self, _: attrs.Attribute[float | None], value: float | None) -> None:
        if value is not None and not (1.0 < value <= 1e6):
            raise InvalidValueError("step_latency_ratio", value, "must be > 1 (or None)")

    @token_budget.validator
    def _budget(self, _: attrs.Attribute[int], value: int) -> None:
        if value < 2:
            raise InvalidValueError("token_budget", value, "must be >= 2")

    @max_prefill_chunk.validator
    def _chunk(self, _: attrs.Attribute[int], value: int) -> None:
        if value < 1:
            raise InvalidValueError("max_prefill_chunk", value, "must be >= 1")


ENGINE_DOWN = "the engine stopped"
"""How the error of every request an engine failed as a whole begins (its loop died or its
step stalled): the request was not at fault, and a retry on a fresh engine may succeed."""


@attrs.frozen
class Stall:
    """The step in progress: its number, how long it has run, what it is doing and for
    which requests."""

    step: int
    running_s: float
    phase: str
    request_ids: tuple[str, ...]

    def describe(self) -> str:
        """One line for ``/health``, the failed requests' errors and their usage rows: the
        step, how long, doing what, and how many requests — never which: a request id is its
        own client's, and these lines reach every client (``/health`` needs no key)."""
        return f"{self.what()} ({len(self.request_ids)} requests)"

    def describe_for_log(self) -> str:
        """:meth:`describe` with the first four request ids, for the operator's log."""
        ids = ", ".join(self.request_ids[:4]) + (" ..." if len(self.request_ids) > 4 else "")
        return f"{self.what()} ({len(self.request_ids)} requests: {ids})"

    def what(self) -> str:
        """What is stuck and for how long, without the requests."""
        return f"step {self.step} has run {self.running_s:.1f} s in {self.phase}"


@attrs.frozen
class _Plan:
    decode: list[Job]
    prefill: list[tuple[Job, PrefillChunk]]


class Engine:
    """Runs submitted :class:`Job`\\s to completion on a background thread.

    ``submit``, ``call`` and ``close`` may be called from any thread. The engine thread alone
    touches the backend (``call`` runs other work on it between steps) and the jobs' decode
    state.
    """

    def __init__(self, backend: Backend, strategies: StrategyFactory,
                 config: EngineConfig | None = None,
                 on_stop: Callable[[str], None] | None = None,
                 decodable_vocab: int | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.backend = backend
        self.decodable_vocab = decodable_vocab
        """Ids at or above this the tokenizer cannot decode (a model vocabulary padded beyond
        the tokenizer's, as Qwen's 151,936 for 151,669 ids): never selected. None: all."""
        self.on_stop = on_stop
        """Called once, on the engine thread, if the loop ends other than by ``close``."""
        self.on_step: Callable[[int, int], None] | None = None
        """Called on the engine thread with ``(steps begun, clock reading)`` as a step starts
        and ``(steps begun, 0)`` as it ends: a watcher in another process learns of a step
        from its first instant (:mod:`pipeline.engine.process`)."""
        self.failure: str | None = None
        """Why the loop thread ended other than by ``close`` (None while it runs)."""
        self.config = config or EngineConfig()
        if self.config.token_budget <= backend.num_slots:
            raise InvalidValueError("token_budget", self.config.token_budget,
                                    f"must exceed the backend's {backend.num_slots} slots")
        self._strategies = strategies
        ratio = self.config.step_latency_ratio
        self._pacer = Pacer(ratio) if ratio is not None else None
        # Checked once: a runtime Protocol isinstance is too slow for the per-token path.
        self._inspector = backend if isinstance(backend, CacheInspector) else None
        self._memory: KVMemory = (Paging(backend, backend.snapshot)
                                  if isinstance(backend, PagedBackend) else SlotMemory())
        self._committer = Committer(backend, self._memory, self._inspector)
        self._strategy_cache: dict[tuple[str, ...] | None, Strategy] = {}
        self._cv = threading.Condition()
        self._incoming: list[Job] = []
        self._calls: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        self._held: set[int] = set()  # slots allocated and not yet released
        self._closed = False
        self._clock = clock
        self._steps = 0
        self._step_started: int | None = None  # clock reading while a step runs
        self._phase = "idle"
        self._abandoned = False
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

    # --- public ----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises :class:`EngineClosed` after ``close``."""
        with self._cv:
            if self.failure is not None:
                raise EngineClosed(f"the engine stopped after an internal error "
                                   f"({self.failure}); a fresh one must be started")
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._incoming.append(job)
            self._cv.notify()

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between two steps (any thread may ask): the way
        to use the backend beside the engine's own calls (embeddings' forwards), since it is
        not thread-safe. One call runs per step, so a long series of them interleaves with
        decoding; an exception ``fn`` raises goes to the future. A call is not a step: the
        stall watchdog does not time it and the pacer does not learn from it, so its caller
        bounds its size. At most :data:`MAX_CALLS` wait at once (more is a
        :class:`CapacityError`). Raises
        :class:`EngineClosed` as :meth:`submit` does; calls still waiting when the engine
        stops or is abandoned fail with it. A call cancelled before it starts never runs."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cv:
            if len(self._calls) >= MAX_CALLS:
                raise CapacityError(f"{MAX_CALLS} calls already wait for the engine")
            if self.failure is not None:
                raise EngineClosed(f"the engine stopped after an internal error "
                                   f"({self.failure}); a fresh one must be started")
            if self._closed:
                raise EngineClosed("the engine is closed")
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    def wake(self) -> None:
        """Make the loop look at its requests now (cancellation calls this)."""
        with self._cv:
            self._cv.notify()

    def strategy(self, order: tuple[str, ...] | None) -> Strategy:
        """The strategy for a processor order (built once per distinct order)."""
        if order not in self._strategy_cache:
            self._strategy_cache[order] = self._strategies(order)
        return self._strategy_cache[order]

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

    def fresh(self, clock: Callable[[], int] | None = None) -> Engine:
        """A new engine over the same backend, strategies, config and ``on_stop`` (and
        ``clock``, unless another is given), after this one stopped. Slots this engine still
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
        for slot in sorted(self._held):
            with contextlib.suppress(Exception):
                self.backend.release(slot)
        self._held.clear()
        return Engine(self.backend, self._strategies, self.config, self.on_stop,
                      self.decodable_vocab, clock or self._clock)

    def stall(self) -> Stall | None:
        """The step in progress now (None between steps and while idle). Any thread."""
        started = self._step_started
        if started is None:
            return None
        with self._cv:
            ids = tuple(j.request.request_id for j in self._active)
        return Stall(self._steps, (self._clock() - started) / 1e9, self._phase, ids)

    def abandon(self, why: str) -> None:
        """Give up on a stalled step (any thread): fail every request held with ``why``,
        refuse new work and call ``on_stop``, as for a loop that died. The stuck thread
        frees its requests' resources if its step ever returns, then ends."""
        with self._cv:
            if self.failure is not None or self._closed:
                return
            self.failure, self._abandoned = why, True
            jobs = list(self._incoming) + list(self._queue) + list(self._active)
            self._queue.extend(self._incoming)
            self._incoming.clear()
        self._refuse_calls(why)
        log.error("abandoning the engine: %s", why)
        for job in jobs:
            job.abort(f"{ENGINE_DOWN}: {why}")
        if self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:  # the supervisor's failure must not hide the stall
                log.exception("the engine's on_stop failed")

    @property
    def kv_blocks(self) -> BlockStats | None:
        """The block manager's counters over a paged backend (None: the backend keeps its
        memory). Read on another thread they are a snapshot that may be a step old."""
        return self._memory.stats

    @property
    def active_slots(self) -> int:
        """Requests holding a slot now."""
        with self._cv:
            return len(self._active)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        with self._cv:
            return len(self._queue) + len(self._incoming)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is left, stop the thread, and wait for it."""
        atexit.unregister(self._close_at_exit)
        with self._cv:
            self._closed = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # the loop must not end silently: say why, free all
            log.critical("the engine loop stopped", exc_info=exc)
            self._stopped(f"{type(exc).__name__}: {exc}")

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._incoming or self._active or self._queue
                           or self._calls):
                    self._cv.wait()
                if not (self._active or self._queue or self._incoming):
                    if self._closed:
                        self._refuse_calls("the engine is closed")
                        return
                closing = self._closed
                incoming, self._incoming = self._incoming, []
                self._queue.extend(incoming)
                call = self._calls.popleft() if self._calls and not closing else None
            if closing:
                self._refuse_calls("the engine is closed")
                self._cancel_all()
                continue
            try:
                self._steps += 1
                if call is not None:  # before the step's clock: neither stall nor pacing time
                    _run_call(*call)
                self._step_started = started = self._clock()
                if self.on_step is not None:
                    self.on_step(self._steps, started)
                shape = self._step()
                if shape is not None and self._pacer is not None:
                    self._pacer.observe((self._clock() - started) / 1e9, *shape)
            except DeviceFault:  # the device cannot be trusted again: the loop ends
                raise
            except Exception as exc:  # a bug in a stage: fail what is in flight, keep going
                if not self._abandoned:
                    self._recover(exc)
            finally:
                self._step_started, self._phase = None, "idle"
                if self.on_step is not None:
                    self.on_step(self._steps, 0)
            if self._abandoned:
                self._free_abandoned()
                return
            self._idle_wait()

    def _recover(self, exc: Exception) -> None:
        """After an unexpected error: fail every active job, finish any half-ended one.
        Never raises: each job's ending is contained on its own."""
        for job in list(self._active):
            self._fail(job, f"engine step failed: {exc!r}")
        for job in list(self._queue):
            if job.state.terminal:
                self._release(job)

    def _free_abandoned(self) -> None:
        """The abandoned step returned: free every slot and block its requests held (their
        callers were answered by :meth:`abandon`), so a fresh engine gets the backend whole."""
        with self._cv:
            jobs = list(self._queue) + list(self._active)
        for job in jobs:
            with contextlib.suppress(Exception):
                self._release(job)
        log.warning("the abandoned engine's step %d returned; its resources are free",
                    self._steps)

    def _refuse_calls(self, why: str) -> None:
        """Fail every :meth:`call` still waiting with :class:`EngineClosed`."""
        with self._cv:
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineClosed(f"the engine stopped: {why}"))

    def _stopped(self, why: str) -> None:
        """The loop is ending abnormally: refuse new work, end every job it holds. Whatever
        raises here (even a ``BaseException`` again), every handle is completed and
        ``on_stop`` is called."""
        with self._cv:
            self.failure = why
            jobs = list(self._incoming) + list(self._queue) + list(self._active)
            self._incoming.clear()
        with contextlib.suppress(BaseException):
            self._refuse_calls(why)
        try:
            for job in jobs:
                try:
                    self._fail(job, f"{ENGINE_DOWN}: {why}")
                except BaseException as exc:  # the backend keeps failing: end the job bare
                    job.abort(f"{ENGINE_DOWN}: {why}; then {exc!r}")
        finally:
            if self.on_stop is not None:
                with contextlib.suppress(BaseException):  # nothing more to do on this thread
                    self.on_stop(why)

    def _idle_wait(self) -> None:
        """Sleep only when nothing can progress (all queued behind a full backend)."""
        if self._active or not self._queue:
            return
        with self._cv:
            self._cv.wait(self.config.idle_wait_s)

    def _cancel_all(self) -> None:
        with self._cv:
            jobs = list(self._queue) + list(self._active)
        for job in jobs:
            self._finish(job, FinishReason.CANCELLED, "engine closed")

    def _step(self) -> tuple[int, int] | None:
        """One step; returns its shape (decoding sequences, prefilled tokens) for pacing."""
        self._phase = "settling"
        self._settle()
        self._phase = "admitting"
        self._admit()
        self._phase = "planning"
        plan = self._plan()
        if not plan.decode and not plan.prefill:
            return None
        plan = self._make_room(plan)
        self._phase = "the model's forward"
        ready = self._forward(plan)
        if self._abandoned:  # its requests were failed meanwhile: touch them no more
            return None
        self._phase = "selection and commit"
        for ended in self._committer.update(ready) if ready else ():
            if ended.error is not None:
                self._fail(ended.job, ended.error)
            else:
                self._release(ended.job)
        self._phase = "publishing blocks"
        memory = self._memory
        for job in list(self._active):
            self._guarded(job, "publishing blocks", lambda: memory.publish(job))
        return len(plan.decode), sum(len(c.token_ids) for _, c in plan.prefill)

    def _guarded(self, job: Job, what: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` for ``job``; if it raises, fail that job alone. True when it ran."""
        try:
            fn()
        except Exception as exc:  # this request's state is broken, not the others'
            self._fail(job, f"{what} failed: {exc!r}")
            return False
        return True

    def _settle(self) -> None:
        """Cancellations, deadlines and queue time-outs, in every non-terminal state."""
        now = time.monotonic_ns()
        for job in list(self._queue) + list(self._active):
            self._guarded(job, "settling", lambda: self._settle_one(job, now))

    def _settle_one(self, job: Job, now: int) -> None:
        if job.handle.cancel_requested:
            self._finish(job, FinishReason.CANCELLED, "cancel requested")
        elif job.deadline_passed(now):
            self._finish(job, FinishReason.DEADLINE, "deadline")
        elif job.state is RequestState.QUEUED and job.queue_timed_out(now):
            self._fail(job, "queue timeout: no slot became free in time")

    def _admit(self) -> None:
        """Queued jobs in FIFO order get a free slot and, over a paged backend, the blocks
        of what they prefill (the prefix cache supplies what it holds); the head of the queue
        waits while either is short."""
        while self._queue and len(self._active) < self.backend.num_slots:
            job = self._queue[0]
            try:
                hit = self._memory.admit(job, job.prefill_ids, reserve=len(self._active))
            except CapacityError as exc:  # more than the whole pool: it never fits
                self._fail(job, str(exc))
                continue
            if hit is None:
                return
            try:
                slot = self.backend.allocate()
            except CapacityError:
                self._memory.free(job)
                return
            self._held.add(slot)
            self._queue.popleft()
            with self._cv:
                self._active.append(job)
            job.slot = slot  # held from now on: a failed start releases it
            self._guarded(job, "starting", lambda: self._start(job, slot, hit))

    def _start(self, job: Job, slot: int, hit: PrefixMatch) -> None:
        """Prefill begins (after the positions the prefix cache holds); the job's strategy
        (by its processor order) starts its loop state, which a preempted job keeps."""
        job.start_prefill(slot)
        if hit.cached_tokens:
            job.prefix_hit(hit.cached_tokens, len(hit.blocks))
        if job.resumed:
            return
        strategy = self.strategy(job.processor_order)
        job.strategy, job.decode_state = strategy, strategy.start(job.row(), job.forcing())

    def _plan(self) -> _Plan:
        """Every decoding job's strategy plans its call first; prefill chunks, in admission
        order, share what is left of the token budget."""
        decode = []
        budget = self.config.token_budget
        for job in [j for j in self._active if j.state is RequestState.DECODING]:
            def plan() -> None:
                assert job.strategy is not None
                job.plan = job.strategy.plan(job.decode_state)
            if self._guarded(job, "planning", plan):
                assert job.plan is not None
                decode.append(job)
                budget -= len(job.plan.token_ids)
        allowance = self._pacer.allowance(bool(decode)) if self._pacer is not None else None
        if allowance is not None:
            budget = min(budget, allowance)
        prefill: list[tuple[Job, PrefillChunk]] = []
        for job in list(self._active):
            if budget <= 0:
                break
            if job.state is RequestState.PREFILLING:
                chunk: list[PrefillChunk] = []
                limit = min(budget, self.config.max_prefill_chunk)
                if self._guarded(job, "planning", lambda: chunk.append(job.next_chunk(limit))):
                    prefill.append((job, chunk[0]))
                    budget -= len(chunk[0].token_ids)
        return _Plan(decode, prefill)

    def _forward(self, plan: _Plan) -> list[tuple[Job, torch.Tensor]]:
        """One batched model call for the step's planned calls and prefill chunks; records
        each job's progress and returns the jobs with fresh logits (decoding jobs, and jobs
        whose last prompt chunk ran) with their rows ``[len(outputs), V]``."""
        calls: dict[Job, ModelCall] = {}
        for job in plan.decode:
            p = job.plan
            assert p is not None
            calls[job] = ModelCall.planned(job.slot_id, job.cache_len, p, self._table(job))
        chunks = dict(plan.prefill)
        for job, chunk in plan.prefill:
            calls[job] = ModelCall.chunk(chunk, self._table(job))
        done = self._call(list(calls), lambda jobs: self.backend.forward([calls[j] for j in jobs]),
                          calls)
        fresh = [(job, rows) for job, rows in done if len(rows)]
        records = dict(zip((j for j, _ in fresh), self._logits_records(fresh)))
        ready = []
        for job, rows in done:
            if job in chunks:
                chunk = chunks[job]
                ran = self._guarded(job, "recording prefill", lambda: job.prefilled(
                    chunk, self._cache(job), records[job][0] if job in records else None))
            else:
                ran = self._guarded(job, "recording decode", lambda: job.decoded(
                    self._cache(job), records[job]))
            if ran and len(rows):
                if self.decodable_vocab is not None and self.decodable_vocab < rows.shape[1]:
                    with torch.inference_mode():  # the backend's rows may be inference tensors
                        rows[:, self.decodable_vocab:] = float("-inf")  # padding: never chosen
                ready.append((job, rows))
        return ready

    def _table(self, job: Job) -> tuple[int, ...] | None:
        """The job's block table over a paged backend (None: the backend keeps its memory)."""
        return self._memory.table(job)

    def _make_room(self, plan: _Plan) -> _Plan:
        """Grow each writing decode call's table to its positions (:meth:`Paging.make_room`);
        the jobs paging preempted are requeued, those it could not grow fail, and both leave
        the plan."""
        needs = [(job, job.cache_len + len(job.plan.token_ids)) for job in plan.decode
                 if job.plan is not None and job.plan.write]
        room = self._memory.make_room(needs, list(self._active))
        for job, blocks in room.preempted:
            self._preempt(job, blocks)
        for job, why in room.starved:
            self._fail(job, why)
        dropped = room.dropped
        return _Plan([j for j in plan.decode if j not in dropped],
                     [(j, c) for j, c in plan.prefill if j not in dropped])

    def _preempt(self, job: Job, blocks: int) -> None:
        """Take the slot back from ``job``, whose ``blocks`` KV blocks paging freed
        (preemption by recompute): it returns to the head of the queue with its committed
        output and strategy state, and on readmission prefills its prompt and output again
        (the prefix cache may still hold them)."""
        self.backend.release(job.slot_id)
        self._held.discard(job.slot_id)
        with self._cv:
            self._active.remove(job)
            self._queue.appendleft(job)
        job.preempted(blocks)

    def _cache(self, job: Job) -> tuple[int, CacheLayout | None]:
        """The slot's cache length, and its per-layer lengths when the backend reports them."""
        return cache_state(self.backend, self._inspector, job.slot_id)

    _logits_records = staticmethod(logits_records)
    """Each fresh job's raw-logits records (a class attribute, so a benchmark can time it)."""

    def _call(self, jobs: list[Job], fn: Callable[[list[Job]], torch.Tensor],
              calls: dict[Job, ModelCall]) -> list[tuple[Job, torch.Tensor]]:
        """Run a backend call over ``jobs``; pair each job with its rows of the logits.

        A :class:`SlotError` fails the named slots' jobs and the call is retried for the
        others (whose caches the contract says are intact); any other exception fails all.
        """
        while jobs:
            try:
                logits = fn(jobs)
            except SlotError as exc:
                faulty = [j for j in jobs if j.slot_id in set(exc.slots)]
                rest = [j for j in jobs if j not in faulty]
                for job in faulty or rest:  # a SlotError naming no slot here fails them all
                    self._fail(job, f"backend error: {exc.cause!r}")
                jobs = rest if faulty else []
                continue
            except Exception as exc:
                if device_fault(exc):  # the loop ends: every request fails, on_stop runs
                    raise DeviceFault(f"device fault in the model's forward: {exc!r}") from exc
                for job in jobs:
                    self._fail(job, f"backend error: {exc!r}")
                return []
            mine = [calls[j] for j in jobs]
            wanted = sum(len(c.outputs) for c in mine)
            if logits.shape[0] != wanted:
                for job in jobs:
                    self._fail(job, f"backend error: {logits.shape[0]} logits rows for "
                                    f"{wanted} wanted outputs")
                return []
            return list(zip(jobs, split_outputs(mine, logits)))
        return []

    # --- endings ---------------------------------------------------------------------------

    def _finish(self, job: Job, reason: FinishReason, detail: str) -> None:
        try:
            job.finish(reason, detail)
        except Exception as exc:
            job.abort(f"ending the request ({reason.value}) failed: {exc!r}")
        self._release(job)

    def _fail(self, job: Job, error: str) -> None:
        try:
            job.fail(error)
        except Exception as exc:  # the job's own state is broken: end it bare
            job.abort(f"{error}; recording the failure failed: {exc!r}")
        self._release(job)

    @staticmethod
    def _finish_strategy(job: Job) -> None:
        """Let the job's strategy free what its loop state holds (once; a failure is
        recorded, the request is over either way)."""
        strategy, state = job.strategy, job.decode_state
        if strategy is None or state is None:
            return
        job.decode_state = None
        try:
            strategy.finish(state)
        except Exception as exc:
            with contextlib.suppress(Exception):
                job.tracer.emit("engine", "strategy.finish_failed", {"error": repr(exc)})

    def _release(self, job: Job) -> None:
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
            if job in self._active:
                self._active.remove(job)
        try:
            self._finish_strategy(job)
            try:
                self._memory.free(job)
            except Exception as exc:  # the request is over either way; record it
                with contextlib.suppress(Exception):
                    job.tracer.emit("engine", "blocks.free_failed", {"error": repr(exc)})
            if job.slot is not None:
                try:
                    self.backend.release(job.slot_id)
                    self._held.discard(job.slot_id)
                except Exception as exc:  # the request is over either way; record it
                    with contextlib.suppress(Exception):
                        job.tracer.emit("engine", "resources.release_failed",
                                        {"error": repr(exc)})
            job.released()
        except Exception as exc:
            job.abort(f"releasing the request failed: {exc!r}")
        finally:  # even a BaseException (the loop then stops) leaves no caller waiting
            if not job.handle.done():
                job.abort("the request ended without a completion")


__all__ = ["ENGINE_DOWN", "Engine", "EngineConfig", "RequestHandle", "RequestState", "Stall",
           "Tracer"]


def _run_call(fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
    """Run one :meth:`Engine.call` (unless it was cancelled), its outcome to ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as exc:  # the caller's failure, not the engine's
        future.set_exception(exc)
        if device_fault(exc):  # unless the device broke under it
            raise DeviceFault(f"device fault in an engine call: {exc!r}") from exc


_DEVICE_FAULTS = ("CUDA error", "device-side assert", "illegal memory access",
                  "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device (or the host) running out of memory: a step's failure,
    not the device's (the next step may fit)."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` says the device is unusable (:class:`~pipeline.errors.DeviceFault`):
    torch's ``AcceleratorError``, or a runtime error naming a CUDA fault. Running out of device
    memory is not one (the next step may fit). A backend may raise ``DeviceFault`` itself (a
    parallel group that lost a rank)."""
    if isinstance(exc, DeviceFault):
        return True
    if out_of_memory(exc):
        return False
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_FAULTS)
