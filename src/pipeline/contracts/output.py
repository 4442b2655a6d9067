r"""The output side of the contracts: what a request produces (docs/design.md §3).

:class:`Delta` (a step's new text and its typed :data:`Part`\s), :class:`Completion`,
:class:`FinishReason`, :class:`TokenLogprob`, :class:`Usage` and :class:`Timings`, and the
pieces a tool-call reader emits (:class:`TextPiece`, :class:`ToolCallDelta`,
:class:`ToolCallEnd`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs

from pipeline.contracts.request import ToolCall
from pipeline.errors import InvalidValueError

if TYPE_CHECKING:
    from pipeline.events import Event


# --- results ------------------------------------------------------------------------------


class FinishReason(enum.Enum):
    """Why a generation ended. ``openai`` gives the OpenAI dialect's word for it."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    LENGTH = "length"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """``stop`` / ``length`` as the OpenAI API spells them (others pass through)."""
        if self in (FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.STOP_STRING):
            return "stop"
        return str(self.value)


def token_text(data: bytes) -> str:
    """A token's bytes as text, as OpenAI's logprobs show a token: UTF-8, with each byte that
    is not part of a whole character (a byte-level token may end or begin inside one)
    written as a ``\\xNN`` escape, so ``b"\\xe4\\xb8"`` is the 8 characters ``\\xe4\\xb8``."""
    return data.decode("utf-8", errors="backslashreplace")


def _alternatives(value: Any) -> tuple[TokenLogprob, ...]:
    """Top alternatives as records; ``(token_id, logprob)`` pairs are accepted too."""
    if not isinstance(value, (list, tuple)):
        raise InvalidValueError("top", value, "must be a list of alternatives")
    return tuple(v if isinstance(v, TokenLogprob) else TokenLogprob(*v) for v in value)


@attrs.frozen
class TokenLogprob:
    """Log-probability of a token under the processed distribution it was selected from.

    ``top`` are the most likely alternatives at that step, most likely first, each a
    ``TokenLogprob`` of its own (with no alternatives). ``token_bytes`` are the exact bytes
    the token stands for and ``text`` those bytes as text (:func:`token_text`: a token that
    ends inside a UTF-8 character shows the partial bytes as ``\\xNN`` escapes, while
    ``token_bytes`` keeps them exact). The pipeline fills both from its tokenizer on every
    record it returns; they are None only on a record straight from a selector.
    """

    token_id: int
    logprob: float
    top: tuple[TokenLogprob, ...] = attrs.field(default=(), converter=_alternatives)
    text: str | None = None
    token_bytes: bytes | None = None

    def with_text(self, token_bytes: Callable[[int], bytes]) -> TokenLogprob:
        """This record and its alternatives with ``token_bytes`` and ``text`` filled in from
        ``token_bytes(token_id)`` (a tokenizer's
        :meth:`~pipeline.contracts.text.Tokenizer.token_bytes`)."""
        data = token_bytes(self.token_id)
        return TokenLogprob(self.token_id, self.logprob,
                            tuple(t.with_text(token_bytes) for t in self.top),
                            token_text(data), data)


@attrs.frozen
class ToolCallDelta:
    """A piece of a tool call as the model writes it (docs/design.md §11).

    The first piece of call ``index`` carries its ``id`` and ``name`` (and no arguments);
    later pieces carry fragments of its arguments' JSON text, in order. Joined, the fragments
    are exactly the finished call's ``arguments`` (what OpenAI's ``function.arguments`` deltas
    and Anthropic's ``input_json_delta`` stream)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@attrs.frozen
class ToolCallEnd:
    """The end of call ``index``: the finished ``call``, or ``None`` with ``error`` saying why
    the text was not a tool call (its text then follows as a :class:`TextPiece`)."""

    index: int
    call: ToolCall | None
    error: str | None = None


@attrs.frozen
class TextPiece:
    """Answer text outside any tool call."""

    text: str


OutputPiece = TextPiece | ToolCallDelta | ToolCallEnd
"""What a tool-call reader makes of the model's text, in order."""


@attrs.frozen
class TextPart:
    """Answer text (``kind="text"``) or reasoning (``kind="thinking"``) of an output."""

    kind: Literal["text", "thinking"]
    text: str


Part = TextPart | ToolCallDelta | ToolCallEnd
"""A typed piece of an output, in order: answer text, thinking, a tool call's delta or end
(:mod:`pipeline.output_parts` makes them, once, as the text is released)."""


@attrs.frozen
class Delta:
    """One streamed piece: new text safe to show, the tokens since the last delta, and on the
    last delta of a request ``finish_reason``. ``parts`` is the same text typed: answer text,
    thinking (the ``<think>`` markers and their layout newlines dropped) and, when the
    request offered tools, the tool calls' deltas and ends (a piece held back until its kind
    is certain rides on a later delta). ``tool_calls`` are the call deltas among them
    (``text`` is still everything the model wrote, markup included)."""

    request_id: str
    seq: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    parts: tuple[Part, ...] = ()

    @property
    def final(self) -> bool:
        """True on the request's last delta."""
        return self.finish_reason is not None


@attrs.frozen
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Timings:
    """Latencies of a request in seconds, from acceptance (monotonic clock)."""

    queued_s: float
    first_token_s: float | None
    total_s: float


@attrs.frozen
class Completion:
    """A finished request: text, tokens, why it ended, usage, its whole event trace, and the
    tool calls its text holds."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    trace: tuple[Event, ...]
    timings: Timings
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    """The tool calls parsed from ``text`` when the request offered tools (docs/design.md §11)."""
    parts: tuple[Part, ...] = ()
    """The whole output typed (:attr:`Delta.parts` of every delta, each run of text or
    thinking joined, each call's argument fragments joined)."""
