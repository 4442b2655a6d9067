"""A request's text side: committed tokens to released text and deltas.

Owns :class:`TextState`, one of a request's small records in the engine (docs/design.md §6, second
edition): the detokenizer and its state, the stoppers and their states, the text emitted so
far, the logprob records, the output splitter (:mod:`pipeline.output_parts`: thinking, answer
text and the tool-call reader's calls, typed once for every transport), and what has not been
sent yet (tokens and logprobs that ride on the next delta). It sees *committed* tokens only, one at a time, in order; the strategy that
chose them, the KV cache and the trace are elsewhere (:class:`~pipeline.engine.job.Job` holds them
side by side). The stage objects are given at construction, never kept in the request's
:class:`~pipeline.engine.job_spec.JobSpec`, so the spec stays plain data.

The release rule, per committed token: the stoppers' token checks first (the first verdict
wins; the caller may add its own, e.g. a full context window); then the detokenizer's piece
(unless the verdict drops the stopping token's text), and at a verdict its final flush; then
the stoppers' text checks in order, which may hold back a possible stop string's start or
cut at a stop string. Held-back text rides on a later delta; a verdict always closes the
stream with one.

Example::

    text = TextState(spec, detokenizer, stoppers, tokenizer.token_bytes)
    verdict = text.check_token(token, step)
    released, verdict = text.commit(token, logprob, verdict)
    if released or verdict is not None:
        delta = text.delta(released, verdict.reason if verdict else None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipeline.engine.job_spec import JobSpec
from pipeline.output_parts import OutputSplitter, joined
from pipeline.contracts.text import Detokenizer, StopContext, Stopper, StopVerdict, ToolCallReader
from pipeline.contracts.output import Delta, FinishReason, Part, TokenLogprob, ToolCallDelta


class TextState:
    """Detokenizer, stoppers and the stream's bookkeeping for one request. Mutable; touched
    only by the engine thread."""

    def __init__(self, spec: JobSpec, detokenizer: Detokenizer[Any],
                 stoppers: Sequence[Stopper[Any]],
                 token_bytes: Callable[[int], bytes] | None = None,
                 tool_reader: ToolCallReader | None = None) -> None:
        self.request_id = spec.request.request_id
        self.detokenizer = detokenizer
        self.stoppers = tuple(stoppers)
        self.token_bytes = token_bytes
        """The tokenizer's bytes of a token id, which logprob records are labelled with."""
        self.tool_reader = tool_reader
        """Reads tool calls out of the released answer text, when the request offered tools."""
        self.splitter = OutputSplitter(tools=tool_reader, thinking=spec.thinking)
        """Types the released text: thinking, answer text, and the reader's calls."""
        self.parts: list[Part] = []
        """Every delta's parts so far, in order (joined once, by :meth:`whole_parts`)."""
        self.detok_state = detokenizer.start(spec.prompt.input_ids)
        context = StopContext(spec.eos_token_ids, spec.accepted_ns)
        self.stop_states = [s.start(spec.request, context) for s in self.stoppers]
        self.pieces: list[str] = []
        """Text of every delta sent so far, in order."""
        self.logprobs: list[TokenLogprob] = []
        self.seq = 0
        """The next delta's sequence number."""
        self.unsent_ids: list[int] = []
        self.unsent_logprobs: list[TokenLogprob] = []

    def whole_parts(self) -> tuple[Part, ...]:
        """The output's parts with each run of text and each call's argument fragments
        joined (:func:`~pipeline.output_parts.joined`), once at the end: joining per delta
        would copy the growing text again at every delta."""
        whole: list[Part] = []
        joined(whole, self.parts)
        return tuple(whole)

    @property
    def emitted(self) -> str:
        """The text sent so far."""
        return "".join(self.pieces)

    def check_token(self, token: int, step: int) -> StopVerdict | None:
        """The first stopper's verdict on output token ``step`` (1-based), if any."""
        for stopper, state in zip(self.stoppers, self.stop_states):
            verdict = stopper.check_token(state, token, step)
            if verdict is not None:
                return verdict
        return None

    def commit(self, token: int, logprob: TokenLogprob | None, verdict: StopVerdict | None
               ) -> tuple[str, StopVerdict | None]:
        """Take a committed token that ``verdict`` (if any) ends the request with; returns
        the text released now and the verdict that ends the request (a stop string found in
        the text wins over the token's own)."""
        self.unsent_ids.append(token)
        if logprob is not None:
            if self.token_bytes is not None:
                logprob = logprob.with_text(self.token_bytes)
            self.logprobs.append(logprob)
            self.unsent_logprobs.append(logprob)
        piece = ""
        if verdict is None or verdict.keep_token_text:
            self.detok_state, piece = self.detokenizer.step(self.detok_state, token)
        final = verdict is not None
        if final:
            piece += self.detokenizer.finish(self.detok_state)
        released, text_verdict = self._check_text(piece, final)
        return released, text_verdict or verdict

    def _check_text(self, text: str, final: bool) -> tuple[str, StopVerdict | None]:
        """Chain text through the stoppers. After a verdict the rest get ``final=True`` so
        they release what they hold; a later stopper's verdict lies earlier in the (already
        trimmed) text, so it wins."""
        verdict: StopVerdict | None = None
        for i, stopper in enumerate(self.stoppers):
            self.stop_states[i], text, found = stopper.check_text(
                self.stop_states[i], text, final or verdict is not None)
            verdict = found or verdict
        return text, verdict

    def split(self, text: str, final: bool) -> list[Part]:
        """The parts of released ``text`` whose kind is certain (``final``: all of them, the
        reader's unfinished call included)."""
        parts = self.splitter.feed(text) if text else []
        return parts + self.splitter.finish() if final else parts

    def delta(self, text: str, reason: FinishReason | None,
              parts: tuple[Part, ...] = ()) -> Delta:
        """The next delta: ``text`` with the tokens and logprobs not sent yet (``reason`` on
        the last one) and the typed ``parts`` made of it (:meth:`split`). The text counts as
        emitted and the unsent buffers empty."""
        calls = tuple(p for p in parts if isinstance(p, ToolCallDelta))
        delta = Delta(self.request_id, self.seq, text, tuple(self.unsent_ids),
                      tuple(self.unsent_logprobs), reason, calls, parts)
        self.seq += 1
        self.parts.extend(parts)
        self.pieces.append(text)
        self.unsent_ids.clear()
        self.unsent_logprobs.clear()
        return delta
