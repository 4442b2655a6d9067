"""One request's life inside the engine: its scheduling state, beside its recorder, and what
reaches its caller.

Owns :class:`Job`, the engine-thread-only handle on a request in flight. A request is a few
small records (docs/design.md §6, second edition), which the job holds side by side:

- its **spec** (:class:`~pipeline.engine.job_spec.JobSpec`): the request, its tokenized prompt, the
  seed and ids; plain data, serializable;
- its **scheduling state** (this class): the request's state, slot, prefill progress, cache
  length, preemption, and the timings;
- its **decode state**: the strategy's loop state (``Job.decode_state``, owned by the strategy:
  ``start``, ``plan``, ``update``), and the committed tokens (``Job.output_ids``);
- its **recorder** (:class:`~pipeline.engine.recorder.Recorder`): the events of every
  transition (docs/design.md §7), so the trace of a finished job holds the minimal timeline
  in causal order;
- its **text** (:class:`~pipeline.engine.text_state.TextState`: stoppers, detokenizer, typed
  parts) between committed tokens and the deltas the job pushes to the caller's **handle**
  (:meth:`Job.push`: the released text typed once into parts, its ``tool.*`` and
  ``stream.delta`` events; text a stopper holds back rides on a later delta, and a verdict
  always closes the stream).

Only the engine calls these methods, from its own thread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from pipeline.contracts.request import Recording
from pipeline.events import Tracer
from pipeline.contracts.forcing import Forcing
from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.job_spec import JobSpec
from pipeline.engine.recorder import Recorder
from pipeline.contracts.decode import Row, TokenIds
from pipeline.contracts.model import CacheLayout, PrefillChunk
from pipeline.contracts.strategy import Plan, Strategy, Taken
from pipeline.contracts.text import StopVerdict
from pipeline.engine.text_state import TextState
from pipeline.contracts.output import Completion, FinishReason, Timings, TokenLogprob, Usage
from pipeline.room import window

_TERMINAL_STATE = {
    FinishReason.CANCELLED: RequestState.CANCELLED,
    FinishReason.ERROR: RequestState.FAILED,
}


class Job:
    """A request in the engine: its records and its place in the schedule. Mutable;
    touched only by the engine thread. ``text`` was started from ``spec`` (with the
    pipeline's detokenizer and stoppers); ``tracer`` continues the request's trace (the
    recorder holds it) and ``handle`` is the caller's side."""

    def __init__(self, spec: JobSpec, text: TextState, tracer: Tracer,
                 handle: RequestHandle) -> None:
        self.spec = spec
        self.request = spec.request
        self.config = spec.request.generation_config
        request = spec.request
        self.recorder = Recorder(tracer, spec.last_event, request.recording.content,
                                 taps=request.recording is Recording.TAPS,
                                 window=request.tap_tensors)
        self.text = text
        self.handle = handle
        self.state = RequestState.QUEUED
        self.slot: int | None = None
        self.prompt_ids = spec.prompt.input_ids
        self.done_prefill = 0
        self.cache_len = 0
        """Positions of the slot's cache this job has written (the next call starts here)."""
        self.cached_tokens = 0
        """Prompt positions the prefix cache supplied at the job's first admission."""
        self.resumed = False
        """Preempted while decoding: the next prefill recomputes the prompt and the committed
        output the cache held (but the pending token), and decoding goes on with the
        strategy's state."""
        self.cached_outputs = 0
        """Committed outputs the cache held when the job was last preempted while decoding."""
        self.strategy: Strategy | None = None
        self.decode_state: Any = None
        """The strategy's loop state for this request (set at :meth:`start_decoding`)."""
        self.plan: Plan | None = None
        """What the current step feeds the model, once planned."""
        self.output_ids: list[int] = []
        """Committed tokens, in order."""
        self.started_ns: int | None = None
        self.first_token_ns: int | None = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.error: str | None = None

    # --- small views -------------------------------------------------------------------------

    @property
    def slot_id(self) -> int:
        """The slot; only valid while the job holds one."""
        assert self.slot is not None, "job holds no slot"
        return self.slot

    def forcing(self) -> Forcing:
        """A fresh forced-token source for this request (required prefix, reasoning budget)."""
        return Forcing.for_request(self.config.forced_prefix, self.config.reasoning_budget_tokens,
                                   self.spec.think_markers, self.prompt_ids)

    def row(self) -> Row:
        """This job's committed decode state as processors and selectors see it."""
        return Row(self.request.request_id, self.config, self.prompt_ids,
                   TokenIds(self.output_ids), len(self.output_ids) + 1, self.spec.seed,
                   self.spec.eos_token_ids)

    def deadline_passed(self, now_ns: int) -> bool:
        """True when the request's deadline has passed."""
        limit = self.request.runtime_limits.deadline_s
        return limit is not None and now_ns - self.spec.accepted_ns > limit * 1e9

    def queue_timed_out(self, now_ns: int) -> bool:
        """True when the request waited for a slot longer than its queue limit."""
        limit = self.request.runtime_limits.queue_timeout_s
        return limit is not None and now_ns - self.spec.accepted_ns > limit * 1e9

    def _set(self, state: RequestState) -> None:
        self.state = state
        self.handle.set_state(state)

    # --- prefill -----------------------------------------------------------------------------

    def start_prefill(self, slot: int) -> None:
        """The job got ``slot``; prefill begins."""
        self.slot = slot
        self.started_ns = self.started_ns or time.monotonic_ns()  # first admission
        self._set(RequestState.PREFILLING)
        self.recorder.prefill_started(slot, len(self.prompt_ids),
                                      (self.started_ns - self.spec.accepted_ns) / 1e6,
                                      len(self.prefill_ids) if self.resumed else None)

    @property
    def prefill_ids(self) -> tuple[int, ...]:
        """What prefill puts in the cache: the prompt, and after a preemption the committed
        output the cache held then (all but the pending token, for autoregressive decoding;
        every committed token, for a strategy between blocks)."""
        if self.resumed:
            return (*self.prompt_ids, *self.output_ids[:self.cached_outputs])
        return tuple(self.prompt_ids)

    def prefix_hit(self, cached: int, blocks: int) -> None:
        """The prefix cache holds the first ``cached`` positions (``blocks`` blocks): prefill
        starts after them."""
        self.done_prefill = self.cache_len = cached
        if not self.resumed:
            self.cached_tokens = cached
        self.recorder.prefix_hit(cached, blocks)

    def preempted(self, blocks: int) -> None:
        """The engine took the job's slot and ``blocks`` KV blocks back to let others go on;
        it waits at the head of the queue and recomputes its cache when readmitted."""
        self.recorder.preempted(blocks, self.cache_len, len(self.output_ids))
        if self.state is RequestState.DECODING:  # (a resumed job's recompute keeps its own)
            self.cached_outputs = self.cache_len - len(self.prompt_ids)
        self.resumed = self.resumed or self.state is RequestState.DECODING
        self.slot, self.plan = None, None
        self.done_prefill = self.cache_len = 0
        self._set(RequestState.QUEUED)

    def next_chunk(self, limit: int) -> PrefillChunk:
        """The next piece of what prefill computes, at most ``limit`` tokens (``last``: the
        prompt's end, whose logits the strategy starts from; never for a resumed job)."""
        start, todo = self.done_prefill, self.prefill_ids
        ids = todo[start:start + limit]
        end = start + len(ids) == len(todo)
        return PrefillChunk(self.slot_id, ids, start, end and not self.resumed)

    def prefilled(self, chunk: PrefillChunk, cache: tuple[int, CacheLayout | None],
                  logits: dict[str, Any] | None) -> None:
        """The backend wrote ``chunk``; ``cache`` is the slot's cache length now (and its
        per-layer lengths, when reported); ``logits`` records z_1 after the last chunk."""
        self.done_prefill += len(chunk.token_ids)
        self.cache_len = self.done_prefill
        resumed = self.resumed and self.done_prefill == len(self.prefill_ids)
        kind = "resumed" if resumed else "last" if chunk.last else "chunk"
        self.recorder.prefilled(self.slot_id, chunk.start, len(chunk.token_ids), cache, kind,
                                len(self.prompt_ids), logits)
        if kind != "chunk":
            self._set(RequestState.DECODING)

    # --- decode ------------------------------------------------------------------------------

    def decoded(self, cache: tuple[int, CacheLayout | None],
                logits: Sequence[dict[str, Any]]) -> None:
        """The backend ran this step's plan; the cache now covers its tokens too and
        ``logits`` records each wanted output (z_{t+1} for one fed token y_t; z_{t+1} ..
        z_{t+k+1} when k drafts follow it). The plan's own events come first."""
        assert self.plan is not None, "decoded without a plan"
        if self.plan.write:
            self.cache_len += len(self.plan.token_ids)
        self.recorder.decoded(self.plan, len(self.output_ids), cache, logits)
        self.plan = None

    def rolled_back(self, positions: int, cache: tuple[int, CacheLayout | None]) -> None:
        """The strategy dropped ``positions`` fed positions again (rejected drafts); ``cache``
        is the slot's length after the truncation (and its per-layer lengths)."""
        self.cache_len -= positions
        self.recorder.rolled_back(len(self.output_ids), positions, cache)

    def take(self, taken: Taken, max_context: int, processed: dict[str, Any] | None = None,
             order: tuple[str, ...] | None = None) -> FinishReason | None:
        """Commit one token the strategy took, recording a forced override first."""
        if taken.forced is not None:
            event_type, payload = taken.forced
            self.recorder.emit("engine", event_type, payload)
        return self.advance(taken.token_id, taken.logprob, max_context, processed, taken.draw,
                            order)

    def advance(self, token: int, logprob: TokenLogprob | None, max_context: int,
                processed: dict[str, Any] | None = None, draw: float | None = None,
                order: tuple[str, ...] | None = None) -> FinishReason | None:
        """Take y_t: stoppers, detokenizer, delta. Returns the finish reason if it ended.

        ``processed`` records the distribution y_t was selected from, ``draw`` the uniform
        number the selector consumed (recorded at ``full``), ``order`` the processors applied
        this step (recorded when it differs from the previous step's).
        """
        step = len(self.output_ids) + 1
        selected = self.recorder.selected(step, token, len(self.prompt_ids) + step - 1, logprob,
                                          processed, draw, order)
        if self.first_token_ns is None:
            self.first_token_ns = time.monotonic_ns()
        self.output_ids.append(token)
        verdict = self.text.check_token(token, step)
        if verdict is None:
            verdict = self._window_full(step, max_context)
        released, verdict = self.text.commit(token, logprob, verdict)
        if released or verdict is not None:
            self.push(released, verdict.reason if verdict is not None else None, step, selected)
        if verdict is not None:
            self._end(verdict.reason, verdict.detail)
            return verdict.reason
        return None

    def _window_full(self, step: int, max_context: int) -> StopVerdict | None:
        """The length verdict when output token ``step`` fills the context (the model's, or
        the request's ``max_context_tokens`` when smaller)."""
        limit = self.request.runtime_limits.max_context_tokens
        if len(self.prompt_ids) + step >= window(max_context, limit):
            return StopVerdict(FinishReason.LENGTH, "context window full", keep_token_text=True)
        return None

    # --- endings -----------------------------------------------------------------------------

    def finish(self, reason: FinishReason, detail: str) -> None:
        """End outside the token path (cancel, deadline): flush held text and close the stream."""
        if self.state.terminal:
            return
        self.push("", reason, len(self.output_ids))
        self._end(reason, detail)

    def fail(self, error: str) -> None:
        """End in state failed with ``error``."""
        if self.state.terminal:
            return
        self.error = error
        self.push("", FinishReason.ERROR, len(self.output_ids))
        self._end(FinishReason.ERROR, error)

    def push(self, text: str, reason: FinishReason | None, step: int,
             parent: int | None = None) -> None:
        """One delta of ``text`` to the handle (``reason`` on the last: what is held back goes
        out with it), with its typed parts; its events follow event ``parent``."""
        parts = tuple(self.text.split(text, reason is not None))
        self.recorder.tool_parts(parts)
        delta = self.text.delta(text, reason, parts)
        self.recorder.delta(delta.seq, step, text, len(delta.token_ids), reason is not None,
                            parent)
        self.handle.push(delta)

    def _end(self, reason: FinishReason, detail: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, detail
        self.state = _TERMINAL_STATE.get(reason, RequestState.FINISHED)
        self.recorder.finished(reason.value, detail, self.output_ids, self.text.emitted,
                               self.state.value)

    def end_strategy(self) -> None:
        """Let the strategy free what its loop state holds (once; a failure is recorded, the
        request is over either way)."""
        strategy, state = self.strategy, self.decode_state
        if strategy is None or state is None:
            return
        self.decode_state = None
        try:
            strategy.finish(state)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.recorder.emit("engine", "strategy.finish_failed", {"error": repr(exc)})

    def abort(self, error: str) -> None:
        """Last resort when ending the job normally raised (its state is corrupt): complete
        the handle with a bare failure built only from what is certainly well-formed. Never
        raises, so a caller waiting on the handle always gets an answer."""
        try:
            self.state, self.error = RequestState.FAILED, error
            self.finish_reason = FinishReason.ERROR  # the slot stays: the engine frees it
            ids = tuple(t for t in self.output_ids if type(t) is int)
            elapsed = (time.monotonic_ns() - self.spec.accepted_ns) / 1e9
            completion = Completion(
                request_id=self.request.request_id, text="", token_ids=ids,
                finish_reason=FinishReason.ERROR, usage=Usage(len(self.prompt_ids), len(ids)),
                trace=self.recorder.tracer.events, timings=Timings(elapsed, None, elapsed),
                stop_reason=None, error=error)
        except Exception:  # not even that: an empty, failed completion
            completion = Completion(self.request.request_id, "", (), FinishReason.ERROR,
                                    Usage(0, 0), (), Timings(0.0, None, 0.0), error=error)
        self.handle.fail(completion)

    def released(self) -> None:
        """The slot (if any) is free again; the caller gets its completion."""
        self.recorder.released(self.slot)
        self.slot = None
        self.handle.complete(self._completion(), self.state)

    def _completion(self) -> Completion:
        now = time.monotonic_ns()
        start = self.spec.accepted_ns
        queued = ((self.started_ns or now) - start) / 1e9
        ttft = None if self.first_token_ns is None else (self.first_token_ns - start) / 1e9
        assert self.finish_reason is not None
        return Completion(
            request_id=self.request.request_id, text=self.text.emitted,
            token_ids=tuple(self.output_ids), finish_reason=self.finish_reason,
            usage=Usage(len(self.prompt_ids), len(self.output_ids), self.cached_tokens),
            trace=self.recorder.tracer.events, timings=Timings(queued, ttft, (now - start) / 1e9),
            stop_reason=self.stop_reason,
            logprobs=tuple(self.text.logprobs) if self.config.logprobs else None, error=self.error,
            tool_calls=self.text.tool_reader.calls if self.text.tool_reader else (),
            parts=self.text.whole_parts())

