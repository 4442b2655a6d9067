"""One request's life inside the engine: its state machine over its records, and its events.

Owns :class:`Job`, the engine-thread-only handle on a request in flight. A request is a few
small records (docs/design.md §6, second edition), which the job holds side by side:

- its **spec** (:class:`~pipeline.engine.job_spec.JobSpec`): the request, its tokenized prompt, the
  seed and ids; plain data, serializable;
- its **decode state**: the strategy's loop state (``Job.decode_state``, owned by the strategy:
  ``start``, ``plan``, ``update``), and the committed tokens (``Job.output_ids``);
- its **text state** (:class:`~pipeline.engine.text_state.TextState`): detokenizer, stoppers,
  emitted text and what is not sent yet; it sees committed tokens only (:meth:`Job.advance`);
- its **trace**: the :class:`~pipeline.events.Tracer` that numbers its events.

Besides those the job keeps the scheduler's view (state, slot, prefill progress, cache
length, preemption) and the timings. Every transition emits the docs/design.md §7 event for it,
so the trace of a finished job holds the minimal timeline in causal order. Only the engine calls
these methods, from its own thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipeline.events import Tracer, digest_ids, digest_text
from pipeline.engine.forcing import Forcing
from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.engine.job_spec import JobSpec
from pipeline.protocols import (
    Attention, CacheLayout, Plan, PrefillChunk, Row, StopVerdict, Strategy, StrategyEvent, Taken,
)
from pipeline.engine.text_state import TextState
from pipeline.types import (
    Completion, FinishReason, Part, Recording, Timings, TokenLogprob, ToolCallDelta,
    ToolCallEnd, Usage,
)

_TERMINAL_STATE = {
    FinishReason.CANCELLED: RequestState.CANCELLED,
    FinishReason.ERROR: RequestState.FAILED,
}


class Job:
    """A request in the engine: its records and its place in the schedule. Mutable;
    touched only by the engine thread. ``text`` was started from ``spec`` (with the
    pipeline's detokenizer and stoppers); ``tracer`` continues the request's trace and
    ``handle`` is the caller's side."""

    def __init__(self, spec: JobSpec, text: TextState, tracer: Tracer,
                 handle: RequestHandle) -> None:
        self.spec = spec
        self.text = text
        self.request = spec.request
        self.config = spec.request.generation_config
        self.tracer = tracer
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
        self._last = spec.last_event
        self._full = spec.request.recording is Recording.FULL
        self._order: tuple[str, ...] = ()
        self._configured = False
        self.raw_digest: str | None = None  # of the latest raw logits z_t
        self.raw_digests: list[str | None] = []  # of each wanted output of the latest call

    # --- small views -------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        """Whether this request records content (``Recording.FULL``), not only digests."""
        return self._full

    @property
    def slot_id(self) -> int:
        """The slot; only valid while the job holds one."""
        assert self.slot is not None, "job holds no slot"
        return self.slot

    @property
    def processor_order(self) -> tuple[str, ...] | None:
        """The request's processor-order override, if any."""
        return self.config.processor_order

    def forcing(self) -> Forcing:
        """A fresh forced-token source for this request (required prefix, reasoning budget)."""
        return Forcing.for_request(self.config.forced_prefix, self.config.reasoning_budget_tokens,
                                   self.spec.think_markers, self.prompt_ids)

    def row(self) -> Row:
        """This job's committed decode state as processors and selectors see it."""
        return Row(self.request.request_id, self.config, self.prompt_ids, self.output_ids,
                   len(self.output_ids) + 1, self.spec.seed, self.spec.eos_token_ids)

    def deadline_passed(self, now_ns: int) -> bool:
        """True when the request's deadline has passed."""
        limit = self.request.runtime_limits.deadline_s
        return limit is not None and now_ns - self.spec.accepted_ns > limit * 1e9

    def queue_timed_out(self, now_ns: int) -> bool:
        """True when the request waited for a slot longer than its queue limit."""
        limit = self.request.runtime_limits.queue_timeout_s
        return limit is not None and now_ns - self.spec.accepted_ns > limit * 1e9

    def _emit(self, component: str, event_type: str, payload: dict[str, Any],
              parent: int | None = None) -> int:
        self._last = self.tracer.emit(component, event_type, payload,
                                      parent if parent is not None else self._last)
        return self._last

    def _set(self, state: RequestState) -> None:
        self.state = state
        self.handle._set_state(state)

    # --- prefill -----------------------------------------------------------------------------

    def start_prefill(self, slot: int) -> None:
        """The job got ``slot``; prefill begins."""
        self.slot = slot
        self.started_ns = self.started_ns or time.monotonic_ns()  # first admission
        self._set(RequestState.PREFILLING)
        payload: dict[str, Any] = {"slot": slot, "prompt_tokens": len(self.prompt_ids),
                                   "queued_ms": (self.started_ns - self.spec.accepted_ns) / 1e6}
        if self.resumed:
            payload["recompute_tokens"] = len(self.prefill_ids)
        self._emit("engine", "prefill.started", payload)

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
        self._emit("engine", "prefix.hit", {"cached_tokens": cached, "blocks": blocks})

    def preempted(self, blocks: int) -> None:
        """The engine took the job's slot and ``blocks`` KV blocks back to let others go on;
        it waits at the head of the queue and recomputes its cache when readmitted."""
        self._emit("engine", "preempted", {"blocks": blocks, "cache_len": self.cache_len,
                                           "step": len(self.output_ids)})
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
        cache_len, layout = cache
        payload: dict[str, Any] = {"slot": self.slot_id, "start": chunk.start,
                                   "tokens": len(chunk.token_ids), "cache_len": cache_len}
        if layout is not None:
            payload["layers"] = {"k": list(layout.key_lengths), "v": list(layout.value_lengths)}
        if self.resumed and self.done_prefill == len(self.prefill_ids):
            self._emit("backend", "prefill.completed", {**payload, "resumed": True})
            self._set(RequestState.DECODING)
        elif chunk.last:
            payload["prompt_tokens"] = len(self.prompt_ids)
            payload["logits"] = logits
            self.raw_digest = None if logits is None else logits.get("digest")
            self.raw_digests = [self.raw_digest]
            self._emit("backend", "prefill.completed", payload)
            self._set(RequestState.DECODING)
        else:
            self._emit("backend", "prefill.chunk", payload)

    def configured(self, strategy: Strategy, order: tuple[str, ...]) -> None:
        """Record the strategy and the processor order applied at step 1 (before selecting);
        once, though an iterative strategy updates several times before its first token."""
        if self._configured:
            return
        self._configured = True
        self._order = order
        self._emit("engine", "selection.configured", {
            "strategy": strategy.name, "processors": list(order), "seed": self.spec.seed})

    # --- decode ------------------------------------------------------------------------------

    def decoded(self, cache: tuple[int, CacheLayout | None],
                logits: Sequence[dict[str, Any]]) -> None:
        """The backend ran this step's plan; the cache now covers its tokens too and
        ``logits`` records each wanted output (z_{t+1} for one fed token y_t; z_{t+1} ..
        z_{t+k+1} when k drafts follow it). The plan's own events come first."""
        assert self.plan is not None, "decoded without a plan"
        self.noted(self.plan.events)
        fed = self.plan.token_ids
        if self.plan.write:
            self.cache_len += len(fed)
        cache_len, layout = cache
        payload: dict[str, Any] = {"step": len(self.output_ids), "token_id": fed[0],
                                   "cache_len": cache_len, "logits": logits[0]}
        if len(fed) > 1:
            payload["token_ids"] = list(fed)
        if not self.plan.write:  # a denoising pass: it read the cache, wrote nothing
            payload["write"] = False
        if self.plan.attention is not Attention.CAUSAL:
            payload["attention"] = self.plan.attention.value
        if self.plan.embeddings is not None:  # the ids are placeholders for these vectors
            payload["inputs"] = "embeddings"
        if len(logits) > 1:  # the first divergence may lie at any verified position
            payload["outputs"] = list(self.plan.outputs)
            payload["block_logits"] = list(logits)
        self.raw_digests = [record.get("digest") for record in logits]
        self.raw_digest = self.raw_digests[0]
        if layout is not None:
            payload["layers"] = {"k": list(layout.key_lengths), "v": list(layout.value_lengths)}
        self._emit("backend", "decode.completed", payload)
        self.plan = None

    def rolled_back(self, positions: int, cache: tuple[int, CacheLayout | None]) -> None:
        """The strategy dropped ``positions`` fed positions again (rejected drafts); ``cache``
        is the slot's length after the truncation (and its per-layer lengths)."""
        self.cache_len -= positions
        cache_len, layout = cache
        payload: dict[str, Any] = {"step": len(self.output_ids), "positions": positions,
                                   "cache_len": cache_len}
        if layout is not None:
            payload["layers"] = {"k": list(layout.key_lengths), "v": list(layout.value_lengths)}
        self._emit("engine", "cache.rollback", payload)

    def noted(self, events: Sequence[StrategyEvent]) -> None:
        """Record the strategy's own events (a payload's ``ids`` as a digest unless ``full``)."""
        for event_type, payload in events:
            if "ids" in payload and not self._full:
                ids = payload["ids"]
                payload = {k: v for k, v in payload.items() if k != "ids"}
                payload["ids_digest"] = digest_ids(ids)
            self._emit("strategy", event_type, payload)

    def take(self, taken: Taken, max_context: int, processed: dict[str, Any] | None = None,
             order: tuple[str, ...] | None = None) -> FinishReason | None:
        """Commit one token the strategy took, recording a forced override first."""
        if taken.forced is not None:
            event_type, payload = taken.forced
            self._emit("engine", event_type, payload)
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
        cache_len = len(self.prompt_ids) + step - 1
        payload: dict[str, Any] = {"step": step, "token_id": token, "cache_len": cache_len}
        if logprob is not None:
            payload["logprob"] = logprob.logprob
        if processed is not None:
            payload["processed"] = processed
        if self._full:
            payload["draw"] = draw
        if order is not None and order != self._order:
            payload["processors"] = list(order)
            self._order = order
        selected = self._emit("selector", "token.selected", payload)
        if self.first_token_ns is None:
            self.first_token_ns = time.monotonic_ns()
        self.output_ids.append(token)
        verdict = self.text.check_token(token, step)
        if verdict is None:
            verdict = self._window_full(step, max_context)
        released, verdict = self.text.commit(token, logprob, verdict)
        self._deliver(released, verdict, selected)
        if verdict is not None:
            self._end(verdict.reason, verdict.detail)
            return verdict.reason
        return None

    def _window_full(self, step: int, max_context: int) -> StopVerdict | None:
        """The length verdict when output token ``step`` fills the context (the model's, or
        the request's ``max_context_tokens`` when smaller)."""
        limit = self.request.runtime_limits.max_context_tokens
        if len(self.prompt_ids) + step >= min(max_context, limit or max_context):
            return StopVerdict(FinishReason.LENGTH, "context window full", keep_token_text=True)
        return None

    def _deliver(self, text: str, verdict: StopVerdict | None, parent: int) -> None:
        if not text and verdict is None:
            return  # held back: the tokens ride on the next delta
        reason = verdict.reason if verdict is not None else None
        self._push(text, reason, parent)

    def _push(self, text: str, reason: FinishReason | None, parent: int | None = None) -> None:
        delta = self.text.delta(text, reason, self._parts(text, reason is not None))
        payload: dict[str, Any] = {"seq": delta.seq, "step": len(self.output_ids),
                                   "bytes": len(text.encode()),
                                   "tokens": len(delta.token_ids), "digest": digest_text(text),
                                   "final": reason is not None}
        if self._full:
            payload["text"] = text
        self._emit("transport", "stream.delta", payload, parent)
        self.handle._push(delta)

    def _parts(self, text: str, final: bool) -> tuple[Part, ...]:
        """Type the released text (:meth:`TextState.split`); each call the reader begins is
        ``tool.proposed`` and each it ends ``tool.parsed`` (or ``tool.malformed``) in the
        trace (docs/design.md §11)."""
        pieces = self.text.split(text, final)
        for piece in pieces:
            if isinstance(piece, ToolCallDelta) and piece.name is not None:
                self._emit("tools", "tool.proposed", {"call_id": piece.id, "index": piece.index,
                                                      "name": piece.name})
            elif isinstance(piece, ToolCallEnd):
                self._emit("tools", *_parsed(piece, self._full, self._proposed(piece.index)))
        return tuple(pieces)

    def _proposed(self, index: int) -> Any:
        """The call id the ``tool.proposed`` event of call ``index`` gave."""
        for event in reversed(self.tracer.events):
            if event.event_type == "tool.proposed" and event.payload["index"] == index:
                return event.payload["call_id"]
        return None

    # --- endings -----------------------------------------------------------------------------

    def finish(self, reason: FinishReason, detail: str) -> None:
        """End outside the token path (cancel, deadline): flush held text and close the stream."""
        if self.state.terminal:
            return
        self._push("", reason)
        self._end(reason, detail)

    def fail(self, error: str) -> None:
        """End in state failed with ``error``."""
        if self.state.terminal:
            return
        self.error = error
        self._push("", FinishReason.ERROR)
        self._end(FinishReason.ERROR, error)

    def _end(self, reason: FinishReason, detail: str | int | None) -> None:
        self.finish_reason, self.stop_reason = reason, detail
        self.state = _TERMINAL_STATE.get(reason, RequestState.FINISHED)
        self._emit("engine", "generation.finished", {
            "reason": reason.value, "detail": detail, "completion_tokens": len(self.output_ids),
            "output_digest": digest_ids(self.output_ids), "text_digest": digest_text(
                self.text.emitted), "state": self.state.value})

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
                trace=self.tracer.events, timings=Timings(elapsed, None, elapsed),
                stop_reason=None, error=error)
        except Exception:  # not even that: an empty, failed completion
            completion = Completion(self.request.request_id, "", (), FinishReason.ERROR,
                                    Usage(0, 0), (), Timings(0.0, None, 0.0), error=error)
        self.handle._abort(completion)

    def released(self) -> None:
        """The slot (if any) is free again; the caller gets its completion."""
        self._emit("engine", "resources.released", {"slot": self.slot})
        self.slot = None
        self.handle._complete(self._completion(), self.state)

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
            trace=self.tracer.events, timings=Timings(queued, ttft, (now - start) / 1e9),
            stop_reason=self.stop_reason,
            logprobs=tuple(self.text.logprobs) if self.config.logprobs else None, error=self.error,
            tool_calls=self.text.tool_reader.calls if self.text.tool_reader else (),
            parts=tuple(self.text.parts))


def _parsed(end: ToolCallEnd, full: bool, call_id: Any) -> tuple[str, dict[str, Any]]:
    """The event ending a proposed call: parsed (with its arguments' digest) or malformed."""
    call = end.call
    if call is None:
        return "tool.malformed", {"call_id": call_id, "index": end.index, "why": end.error}
    return "tool.parsed", {"call_id": call.id, "index": end.index, "name": call.name,
                           "arguments_digest": digest_text(call.arguments),
                           **({"arguments": call.arguments} if full else {})}
