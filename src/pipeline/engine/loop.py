"""The engine: one autoregressive step over many requests and backend slots (docs/design.md §4
and §6; walked through in docs/engine_step.md).

Owns :class:`Engine` (the scheduler and the step) and :class:`EngineConfig`. Each step it

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
   reasoning budget: :mod:`pipeline.contracts.forcing`) → stoppers → detokenizer → delta; a request
   that goes on keeps y_t as its pending token, which the
   next step's forward writes into the cache (cache length m + t) — the docs/design.md §4 order;
   the blocks that filled up are then published to the prefix cache.

The KV memory rules (admission by free blocks, growth, preemption, publication, rollback,
release) are :mod:`pipeline.engine.paging`'s; a request's records (spec, decode state, text state,
trace) are :class:`~pipeline.engine.job.Job`'s.

Request-level work before the queue (render, tokenize, validation) happens in
:class:`~pipeline.pipe.Pipeline` on the caller's thread.

Containment. A device fault (:func:`~pipeline.errors.device_fault`: a CUDA error that poisons
the device context) raises out of :meth:`Engine.step`: nothing after it can be trusted. Any other backend
exception fails the requests of that call (only the named slots for a
:class:`~pipeline.errors.SlotError`); a selector that raises, or returns something that is not
a token id of the vocabulary, fails the requests of its group; an exception while one request
takes its token fails that request alone. Failing a request can itself raise (a corrupt job
state): then its handle is completed with a bare failure, so the caller still gets an answer.

Who drives the step is :mod:`pipeline.runtime`'s: a thread of this process
(:class:`~pipeline.runtime.thread.ThreadEngine`: the queue of submissions and calls, the loop,
stalls, abandon, fresh engines), or that thread in a child process
(:class:`~pipeline.runtime.parent.ProcessEngine`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import torch

from pipeline.engine.api import Strategies
from pipeline.engine.blocks import PrefixMatch
from pipeline.engine.commit import Committer, cache_state, logits_records
from pipeline.engine.handle import RequestState
from pipeline.engine.job import Job
from pipeline.engine.pacing import Pacer
from pipeline.engine.paging import KVMemory, Paging, SlotMemory
from pipeline.errors import (
    CapacityError, DeviceFault, InvalidValueError, SlotError, device_fault,
)
from pipeline.contracts.model import (
    Backend, CacheInspector, CacheLayout, LayerTaps, ModelCall, PagedBackend, PrefillChunk,
    split_outputs,
)
from pipeline.contracts.output import FinishReason


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


@attrs.frozen
class _Plan:
    decode: list[Job]
    prefill: list[tuple[Job, PrefillChunk]]


class Engine:
    """The requests in the engine and one step over them at a time (:meth:`step`).

    One thread drives it (:mod:`pipeline.runtime`): it alone touches the backend and the
    jobs' decode state. ``abandoned`` may be set from another thread (the step in progress then
    touches its requests no more); ``phase``, and ``queue`` and ``active`` under ``lock``, may
    be read from any.
    """

    def __init__(self, backend: Backend, strategies: Strategies,
                 config: EngineConfig | None = None, decodable_vocab: int | None = None,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.backend = backend
        self.decodable_vocab = decodable_vocab
        """Ids at or above this the tokenizer cannot decode (a model vocabulary padded beyond
        the tokenizer's, as Qwen's 151,936 for 151,669 ids): never selected. None: all."""
        self.config = config or EngineConfig()
        if self.config.token_budget <= backend.num_slots:
            raise InvalidValueError("token_budget", self.config.token_budget,
                                    f"must exceed the backend's {backend.num_slots} slots")
        self.strategy = strategies
        """The strategy for a processor order (built once per distinct order)."""
        self.clock = clock
        """Nanoseconds: the one clock of deadlines, queue limits, pacing and stalls."""
        ratio = self.config.step_latency_ratio
        self._pacer = Pacer(ratio) if ratio is not None else None
        # Checked once: a runtime Protocol isinstance is too slow for the per-token path.
        self._inspector = backend if isinstance(backend, CacheInspector) else None
        self.memory: KVMemory = (Paging(backend, backend.snapshot)
                                 if isinstance(backend, PagedBackend) else SlotMemory())
        self._committer = Committer(backend, self.memory, self._inspector)
        self.lock = threading.Lock()
        """Held to change ``queue`` and ``active``, and by another thread to read them."""
        self.queue: deque[Job] = deque()
        """Jobs waiting for a slot, in order (a preempted one at the head)."""
        self.active: list[Job] = []
        """Jobs holding a slot, in admission order."""
        self.held: set[int] = set()
        """Slots allocated and not yet released."""
        self.phase = "idle"
        """What the step in progress is doing (the stall watchdog names it)."""
        self.abandoned = False

    def step(self) -> None:
        """One step: settle → admit → plan → forward → commit → publish (the pacer learns its
        time on the clock, and its shape: decoding sequences, prefilled tokens)."""
        started = self.clock()
        self.phase = "settling"
        self._settle()
        self.phase = "admitting"
        self._admit()
        self.phase = "planning"
        plan = self._plan()
        if not plan.decode and not plan.prefill:
            return
        plan = self._make_room(plan)
        self.phase = "the model's forward"
        ready = self._forward(plan)
        if self.abandoned:  # its requests were failed meanwhile: touch them no more
            return
        self.phase = "selection and commit"
        for ended in self._committer.update(ready) if ready else ():
            if ended.error is not None:
                self.fail(ended.job, ended.error)
            else:
                self.release(ended.job)
        self.phase = "publishing blocks"
        memory = self.memory
        for job in list(self.active):
            self._guarded(job, "publishing blocks", lambda: memory.publish(job))
        if self._pacer is not None:
            self._pacer.observe((self.clock() - started) / 1e9, len(plan.decode),
                                sum(len(c.token_ids) for _, c in plan.prefill))

    def _guarded(self, job: Job, what: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` for ``job``; if it raises, fail that job alone. True when it ran."""
        try:
            fn()
        except Exception as exc:  # this request's state is broken, not the others'
            self.fail(job, f"{what} failed: {exc!r}")
            return False
        return True

    def _settle(self) -> None:
        """Cancellations, deadlines and queue time-outs, in every non-terminal state."""
        now = self.clock()
        for job in list(self.queue) + list(self.active):
            self._guarded(job, "settling", lambda: self._settle_one(job, now))

    def _settle_one(self, job: Job, now: int) -> None:
        if job.handle.cancel_requested:
            self.finish(job, FinishReason.CANCELLED, "cancel requested")
        elif job.deadline_passed(now):
            self.finish(job, FinishReason.DEADLINE, "deadline")
        elif job.state is RequestState.QUEUED and job.queue_timed_out(now):
            self.fail(job, "queue timeout: no slot became free in time")

    def _admit(self) -> None:
        """Queued jobs in FIFO order get a free slot and, over a paged backend, the blocks
        of what they prefill (the prefix cache supplies what it holds); the head of the queue
        waits while either is short."""
        while self.queue and len(self.active) < self.backend.num_slots:
            job = self.queue[0]
            try:
                hit = self.memory.admit(job, job.prefill_ids, reserve=len(self.active))
            except CapacityError as exc:  # more than the whole pool: it never fits
                self.fail(job, str(exc))
                continue
            if hit is None:
                return
            try:
                slot = self.backend.allocate()
            except CapacityError:
                self.memory.free(job)
                return
            self.held.add(slot)
            self.queue.popleft()
            with self.lock:
                self.active.append(job)
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
        strategy = self.strategy(job.config.processor_order)
        job.strategy, job.decode_state = strategy, strategy.start(job.row(), job.forcing())

    def _plan(self) -> _Plan:
        """Every decoding job's strategy plans its call first; prefill chunks, in admission
        order, share what is left of the token budget."""
        decode = []
        budget = self.config.token_budget
        for job in [j for j in self.active if j.state is RequestState.DECODING]:
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
        for job in list(self.active):
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
            calls[job] = ModelCall.planned(job.slot_id, job.cache_len, p, self.memory.table(job))
        chunks = dict(plan.prefill)
        for job, chunk in plan.prefill:
            calls[job] = ModelCall.chunk(chunk, self.memory.table(job))
        done = run_calls(self.fail, list(calls), lambda jobs: self._run(jobs, calls, chunks),
                         calls)
        fresh = [(job, rows) for job, rows in done if len(rows)]
        records = dict(zip((j for j, _ in fresh), self._logits_records(fresh)))
        ready = []
        for job, rows in done:
            if job in chunks:
                chunk = chunks[job]
                ran = self._guarded(job, "recording prefill", lambda: job.prefilled(
                    chunk, cache_state(self.backend, self._inspector, job.slot_id), records[job][0] if job in records else None))
            else:
                ran = self._guarded(job, "recording decode", lambda: job.decoded(
                    cache_state(self.backend, self._inspector, job.slot_id), records[job]))
            if ran and len(rows):
                if self.decodable_vocab is not None and self.decodable_vocab < rows.shape[1]:
                    with torch.inference_mode():  # the backend's rows may be inference tensors
                        rows[:, self.decodable_vocab:] = float("-inf")  # padding: never chosen
                ready.append((job, rows))
        return ready

    def _run(self, jobs: list[Job], calls: dict[Job, ModelCall],
             chunks: dict[Job, PrefillChunk]) -> torch.Tensor:
        """``backend.forward`` of ``jobs``' calls; the layer taps of those that record them
        (``Recording.TAPS``) go to their recorders while it runs."""
        tapping = [job for job in jobs if job.recorder.taps]
        if not tapping or not isinstance(self.backend, LayerTaps):
            return self.backend.forward([calls[j] for j in jobs])
        for job in tapping:  # the step whose logits the call's last row (its last output) is
            last = calls[job].outputs[-1] if calls[job].outputs else 0
            job.recorder.tapping(1 if job in chunks else len(job.output_ids) + 1 + last)

        def receive(call: int, name: str, hidden: torch.Tensor) -> None:
            recorder = jobs[call].recorder
            if recorder.taps:
                recorder.tap(name, hidden)

        self.backend.set_tap(receive)
        try:
            return self.backend.forward([calls[j] for j in jobs])
        finally:
            self.backend.set_tap(None)

    def _make_room(self, plan: _Plan) -> _Plan:
        """Grow each writing decode call's table to its positions (:meth:`Paging.make_room`);
        the jobs paging preempted are requeued, those it could not grow fail, and both leave
        the plan."""
        needs = [(job, job.cache_len + len(job.plan.token_ids)) for job in plan.decode
                 if job.plan is not None and job.plan.write]
        room = self.memory.make_room(needs, list(self.active))
        for job, blocks in room.preempted:
            self._preempt(job, blocks)
        for job, why in room.starved:
            self.fail(job, why)
        dropped = room.dropped
        return _Plan([j for j in plan.decode if j not in dropped],
                     [(j, c) for j, c in plan.prefill if j not in dropped])

    def _preempt(self, job: Job, blocks: int) -> None:
        """Take the slot back from ``job``, whose ``blocks`` KV blocks paging freed
        (preemption by recompute): it returns to the head of the queue with its committed
        output and strategy state, and on readmission prefills its prompt and output again
        (the prefix cache may still hold them)."""
        self.backend.release(job.slot_id)
        self.held.discard(job.slot_id)
        with self.lock:
            self.active.remove(job)
            self.queue.appendleft(job)
        job.preempted(blocks)

    _logits_records = staticmethod(logits_records)
    """Each fresh job's raw-logits records (a class attribute, so a benchmark can time it)."""

    # --- endings ---------------------------------------------------------------------------

    def finish(self, job: Job, reason: FinishReason, detail: str) -> None:
        """End ``job`` outside the token path (cancel, deadline, close) and release it."""
        try:
            job.finish(reason, detail)
        except Exception as exc:
            job.abort(f"ending the request ({reason.value}) failed: {exc!r}")
        self.release(job)

    def fail(self, job: Job, error: str) -> None:
        """End ``job`` failed with ``error`` and release it."""
        try:
            job.fail(error)
        except Exception as exc:  # the job's own state is broken: end it bare
            job.abort(f"{error}; recording the failure failed: {exc!r}")
        self.release(job)

    def release(self, job: Job) -> None:
        """Take ``job`` out of the schedule, free its strategy state, blocks and slot, and
        complete its handle (whatever raises, the caller gets an answer)."""
        with self.lock:
            if job in self.queue:
                self.queue.remove(job)
            if job in self.active:
                self.active.remove(job)
        try:
            job.end_strategy()
            try:
                self.memory.free(job)
            except Exception as exc:  # the request is over either way; record it
                with contextlib.suppress(Exception):
                    job.recorder.emit("engine", "blocks.free_failed", {"error": repr(exc)})
            if job.slot is not None:
                try:
                    self.backend.release(job.slot_id)
                    self.held.discard(job.slot_id)
                except Exception as exc:  # the request is over either way; record it
                    with contextlib.suppress(Exception):
                        job.recorder.emit("engine", "resources.release_failed",
                                        {"error": repr(exc)})
            job.released()
        except Exception as exc:
            job.abort(f"releasing the request failed: {exc!r}")
        finally:  # even a BaseException (the loop then stops) leaves no caller waiting
            if not job.handle.done():
                job.abort("the request ended without a completion")


def run_calls(fail: Callable[[Job, str], None], jobs: list[Job],
          fn: Callable[[list[Job]], torch.Tensor], calls: dict[Job, ModelCall]
          ) -> list[tuple[Job, torch.Tensor]]:
    """Run a backend call over ``jobs``; pair each job with its rows of the logits (``fail``
ends a job the call failed).

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
                fail(job, f"backend error: {exc.cause!r}")
            jobs = rest if faulty else []
            continue
        except Exception as exc:
            if device_fault(exc):  # the loop ends: every request fails, on_stop runs
                raise DeviceFault(f"device fault in the model's forward: {exc!r}") from exc
            for job in jobs:
                fail(job, f"backend error: {exc!r}")
            return []
        mine = [calls[j] for j in jobs]
        wanted = sum(len(c.outputs) for c in mine)
        if logits.shape[0] != wanted:
            for job in jobs:
                fail(job, f"backend error: {logits.shape[0]} logits rows for "
                                f"{wanted} wanted outputs")
            return []
        return list(zip(jobs, split_outputs(mine, logits)))
    return []


