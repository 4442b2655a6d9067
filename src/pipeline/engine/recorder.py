"""A request's trace inside the engine: what each transition records, in causal order.

Owns :class:`Recorder`, the part of a :class:`~pipeline.engine.job.Job` that holds its trace
(beside its scheduling state and its text). It continues the
request's :class:`~pipeline.events.Tracer` after the pipeline's tokenization event: every
event follows the one before it (its parent), so a finished request's trace is the minimal
timeline of docs/design.md §7. It builds each event's payload from plain values the job
gives it, and records content only at ``Recording.FULL`` (digests otherwise). The raw-logits
digests of the latest call are kept here too: the committer joins them to what it records
about the processed distribution. A ``taps`` request's layer taps (:meth:`tap`, each
layer's hidden state at the position whose logits the step produced) join the next
``prefill.completed`` or ``decode.completed`` as its ``taps``.

Example::

    recorder = Recorder(tracer, spec.last_event, full=False)
    recorder.prefill_started(slot=0, prompt_tokens=12, queued_ms=0.4)
    selected = recorder.selected(step=1, token=42, cache_len=12, logprob=None,
                                 processed=None, draw=None, order=None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeline.events import Tracer, digest_ids, digest_text
from pipeline.contracts.request import MAX_TAP_RECORDS, MAX_TAP_VALUES, TapWindow
from pipeline.recording import tap_record
from pipeline.contracts.model import Attention, CacheLayout
from pipeline.contracts.strategy import Plan, StrategyEvent
from pipeline.contracts.output import Part, TokenLogprob, ToolCallDelta, ToolCallEnd


def _layers(payload: dict[str, Any], layout: CacheLayout | None) -> dict[str, Any]:
    """``payload`` with the per-layer cache lengths, when the backend reports them."""
    if layout is not None:
        payload["layers"] = {"k": list(layout.key_lengths), "v": list(layout.value_lengths)}
    return payload


class Recorder:
    """The engine's events about one request. Engine thread only."""

    def __init__(self, tracer: Tracer, last_event: int | None, full: bool,
                 taps: bool = False, window: TapWindow | None = None) -> None:
        self.tracer = tracer
        self.full = full
        """Whether the request records content (``Recording.FULL``), not only digests."""
        self.taps = taps
        """Whether the request records layer taps (``Recording.TAPS``)."""
        self._window = window
        self._kept = 0  # tensor values kept so far (at most MAX_TAP_VALUES)
        self._records = 0  # tap records so far (at most MAX_TAP_RECORDS)
        self._step = 0
        self._dtype, self._width = "", 0
        self._tapped: list[dict[str, Any]] = []
        self.raw_digests: list[str | None] = []
        """The digests of each wanted output of the latest call."""
        self._last = last_event
        self._order: tuple[str, ...] = ()
        self._configured = False

    # --- layer taps ------------------------------------------------------------------------

    def tapping(self, step: int) -> None:
        """A forward that produces z_step begins: its taps replace any not yet recorded."""
        self._step, self._tapped = step, []

    def tap(self, name: str, hidden: torch.Tensor) -> None:
        """One tap's hidden states ``[n, H]`` of this request's call: the last row (the
        position whose logits the step produces) is recorded; its values too when the
        request's :class:`~pipeline.contracts.request.TapWindow` holds it and room is left."""
        row = hidden[-1]
        self._dtype, self._width = str(row.dtype).removeprefix("torch."), row.numel()
        w = self._window
        keep = (w is not None and w.step == self._step and w.holds(name)
                and self._kept + row.numel() <= MAX_TAP_VALUES)
        if keep:
            self._kept += row.numel()
        self._tapped.append(tap_record(name, row, keep))

    def _taps(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with the latest forward's taps (then forgotten), if any. Once the
        request's :data:`MAX_TAP_RECORDS` are spent the step says so and taps stop."""
        if self._tapped:
            self._records += len(self._tapped)
            if self._records > MAX_TAP_RECORDS:
                payload["taps"] = {"step": self._step, "spent": MAX_TAP_RECORDS}
                self.taps = False
            else:
                payload["taps"] = {"step": self._step, "dtype": self._dtype,
                                   "width": self._width, "layers": self._tapped}
            self._tapped = []
        return payload

    def emit(self, component: str, event_type: str, payload: dict[str, Any],
             parent: int | None = None) -> int:
        """Record an event after ``parent`` (default: the latest); returns its id."""
        self._last = self.tracer.emit(component, event_type, payload,
                                      parent if parent is not None else self._last)
        return self._last

    # --- prefill -----------------------------------------------------------------------------

    def prefill_started(self, slot: int, prompt_tokens: int, queued_ms: float,
                        recompute: int | None = None) -> None:
        """The job got ``slot`` (``recompute``: the positions a preempted job computes again)."""
        payload: dict[str, Any] = {"slot": slot, "prompt_tokens": prompt_tokens,
                                   "queued_ms": queued_ms}
        if recompute is not None:
            payload["recompute_tokens"] = recompute
        self.emit("engine", "prefill.started", payload)

    def prefix_hit(self, cached: int, blocks: int) -> None:
        """The prefix cache supplied ``cached`` positions in ``blocks`` blocks."""
        self.emit("engine", "prefix.hit", {"cached_tokens": cached, "blocks": blocks})

    def preempted(self, blocks: int, cache_len: int, step: int) -> None:
        """The job gave its slot and ``blocks`` KV blocks back."""
        self.emit("engine", "preempted", {"blocks": blocks, "cache_len": cache_len,
                                          "step": step})

    def prefilled(self, slot: int, start: int, tokens: int,
                  cache: tuple[int, CacheLayout | None], kind: str,
                  prompt_tokens: int, logits: dict[str, Any] | None) -> None:
        """A prefill chunk was written: ``kind`` is ``"chunk"`` (more follow), ``"resumed"``
        (a preempted job's recompute is done) or ``"last"`` (``logits`` records z_1)."""
        cache_len, layout = cache
        payload = _layers({"slot": slot, "start": start, "tokens": tokens,
                           "cache_len": cache_len}, layout)
        if kind == "chunk":
            self._tapped = []  # no logits from a chunk: its taps explain nothing
            self.emit("backend", "prefill.chunk", payload)
        elif kind == "resumed":
            self._tapped = []
            self.emit("backend", "prefill.completed", {**payload, "resumed": True})
        else:
            payload["prompt_tokens"] = prompt_tokens
            payload["logits"] = logits
            self.raw_digests = [None if logits is None else logits.get("digest")]
            self.emit("backend", "prefill.completed", self._taps(payload))

    def configured(self, strategy: str, order: tuple[str, ...], seed: int) -> None:
        """The strategy and the processor order of step 1; once per request."""
        if self._configured:
            return
        self._configured = True
        self._order = order
        self.emit("engine", "selection.configured", {
            "strategy": strategy, "processors": list(order), "seed": seed})

    # --- decode ------------------------------------------------------------------------------

    def decoded(self, plan: Plan, step: int, cache: tuple[int, CacheLayout | None],
                logits: Sequence[dict[str, Any]]) -> None:
        """The backend ran ``plan``; the plan's own events first, then ``decode.completed``
        with each wanted output's logits record."""
        self.noted(plan.events)
        fed = plan.token_ids
        cache_len, layout = cache
        payload: dict[str, Any] = {"step": step, "token_id": fed[0], "cache_len": cache_len,
                                   "logits": logits[0]}
        if len(fed) > 1:
            payload["token_ids"] = list(fed)
        if not plan.write:  # a denoising pass: it read the cache, wrote nothing
            payload["write"] = False
        if plan.attention is not Attention.CAUSAL:
            payload["attention"] = plan.attention.value
        if plan.embeddings is not None:  # the ids are placeholders for these vectors
            payload["inputs"] = "embeddings"
        if len(logits) > 1:  # the first divergence may lie at any verified position
            payload["outputs"] = list(plan.outputs)
            payload["block_logits"] = list(logits)
        self.raw_digests = [record.get("digest") for record in logits]
        self.emit("backend", "decode.completed", self._taps(_layers(payload, layout)))

    def rolled_back(self, step: int, positions: int,
                    cache: tuple[int, CacheLayout | None]) -> None:
        """The strategy dropped ``positions`` fed positions (rejected drafts)."""
        cache_len, layout = cache
        self.emit("engine", "cache.rollback", _layers(
            {"step": step, "positions": positions, "cache_len": cache_len}, layout))

    def noted(self, events: Sequence[StrategyEvent]) -> None:
        """The strategy's own events (a payload's ``ids`` as a digest unless ``full``)."""
        for event_type, payload in events:
            if "ids" in payload and not self.full:
                ids = payload["ids"]
                payload = {k: v for k, v in payload.items() if k != "ids"}
                payload["ids_digest"] = digest_ids(ids)
            self.emit("strategy", event_type, payload)

    def selected(self, step: int, token: int, cache_len: int, logprob: TokenLogprob | None,
                 processed: dict[str, Any] | None, draw: float | None,
                 order: tuple[str, ...] | None) -> int:
        """``token.selected`` for output token ``step``; ``order`` is recorded when it differs
        from the previous step's. Returns the event's id (the parent of its delta)."""
        payload: dict[str, Any] = {"step": step, "token_id": token, "cache_len": cache_len}
        if logprob is not None:
            payload["logprob"] = logprob.logprob
        if processed is not None:
            payload["processed"] = processed
        if self.full:
            payload["draw"] = draw
        if order is not None and order != self._order:
            payload["processors"] = list(order)
            self._order = order
        return self.emit("selector", "token.selected", payload)

    # --- delivery and the end ----------------------------------------------------------------

    def tool_parts(self, parts: Sequence[Part]) -> None:
        """Each call the reader begins is ``tool.proposed`` and each it ends ``tool.parsed``
        (or ``tool.malformed``) (docs/design.md §11)."""
        for part in parts:
            if isinstance(part, ToolCallDelta) and part.name is not None:
                self.emit("tools", "tool.proposed", {"call_id": part.id, "index": part.index,
                                                     "name": part.name})
            elif isinstance(part, ToolCallEnd):
                self.emit("tools", *_parsed(part, self.full, self._proposed(part.index)))

    def _proposed(self, index: int) -> Any:
        """The call id the ``tool.proposed`` event of call ``index`` gave."""
        for event in reversed(self.tracer.events):
            if event.event_type == "tool.proposed" and event.payload["index"] == index:
                return event.payload["call_id"]
        return None

    def delta(self, seq: int, step: int, text: str, tokens: int, final: bool,
              parent: int | None) -> None:
        """``stream.delta``: what the caller got (its text at ``full``, else its digest)."""
        payload: dict[str, Any] = {"seq": seq, "step": step, "bytes": len(text.encode()),
                                   "tokens": tokens, "digest": digest_text(text),
                                   "final": final}
        if self.full:
            payload["text"] = text
        self.emit("transport", "stream.delta", payload, parent)

    def finished(self, reason: str, detail: str | int | None, output_ids: Sequence[int],
                 text: str, state: str) -> None:
        """``generation.finished``."""
        self.emit("engine", "generation.finished", {
            "reason": reason, "detail": detail, "completion_tokens": len(output_ids),
            "output_digest": digest_ids(output_ids), "text_digest": digest_text(text),
            "state": state})

    def released(self, slot: int | None) -> None:
        """``resources.released``."""
        self.emit("engine", "resources.released", {"slot": slot})


def _parsed(end: ToolCallEnd, full: bool, call_id: Any) -> tuple[str, dict[str, Any]]:
    """The event ending a proposed call: parsed (with its arguments' digest) or malformed."""
    call = end.call
    if call is None:
        return "tool.malformed", {"call_id": call_id, "index": end.index, "why": end.error}
    return "tool.parsed", {"call_id": call.id, "index": end.index, "name": call.name,
                           "arguments_digest": digest_text(call.arguments),
                           **({"arguments": call.arguments} if full else {})}
