r"""The text side of the contracts: rendering, tokenizing, detokenizing, reading tool calls
and stopping (docs/design.md §3-§5).

The value types :class:`Rendered` (with its :class:`Span`\s) and :class:`TokenizedPrompt`, and the
stage Protocols that make and consume text: :class:`Renderer`, :class:`Tokenizer`,
:class:`DocumentEncoder`, :class:`Detokenizer`, :class:`ToolCallReader`,
:class:`ToolCallParser` and :class:`Stopper`. Each Protocol's docstring is its contract: call
order and lifecycle, who may mutate what, what it raises, and an example. Implementations live
in ``stages/``; fakes in :mod:`pipeline.testing`. Stages with per-request state receive their
state and return the new one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from pipeline.contracts.output import FinishReason, OutputPiece
from pipeline.contracts.request import Message, Request, ToolCall, ToolSpec, _check

S = TypeVar('S')


# --- rendering and tokenization -----------------------------------------------------------


def _ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


class SpanKind(enum.Enum):
    """Whether a span of rendered text came from the template or from message content."""

    CONTROL = "control"
    CONTENT = "content"


@attrs.frozen
class Span:
    """``text[start:end]`` of a :class:`Rendered` is of ``kind``."""

    start: int
    end: int
    kind: SpanKind


@attrs.frozen
class Rendered:
    """The rendered prompt: text, a partition of it into control and content spans, and the
    digest of the template that produced it."""

    text: str
    spans: tuple[Span, ...]
    template_digest: str
    renderer: str = "unknown"

    def __attrs_post_init__(self) -> None:
        at = 0
        for span in self.spans:
            _check(span.start == at and span.end > span.start, "spans", span,
                   "spans must partition the text in order")
            at = span.end
        _check(at == len(self.text), "spans", self.spans, "spans must cover the whole text")

    def pieces(self) -> list[tuple[str, SpanKind]]:
        """The text cut at span boundaries, each piece with its kind."""
        return [(self.text[s.start:s.end], s.kind) for s in self.spans]

    @classmethod
    def plain(cls, text: str, template_digest: str, renderer: str) -> Rendered:
        """Rendered text that is all content (no control spans)."""
        spans = (Span(0, len(text), SpanKind.CONTENT),) if text else ()
        return cls(text, spans, template_digest, renderer)


@attrs.frozen
class TokenizedPrompt:
    """Prompt token ids with their positions and the digests of the artifacts behind them."""

    input_ids: tuple[int, ...] = attrs.field(converter=_ints)
    tokenizer_digest: str
    rendered_digest: str
    positions: tuple[int, ...] = attrs.field(converter=_ints)

    @positions.default
    def _positions(self) -> tuple[int, ...]:
        return tuple(range(len(self.input_ids)))

    def __attrs_post_init__(self) -> None:
        _check(len(self.input_ids) > 0, "input_ids", self.input_ids, "the prompt is empty")
        _check(len(self.positions) == len(self.input_ids), "positions", len(self.positions),
               f"must have one position per token ({len(self.input_ids)})")

    def __len__(self) -> int:
        return len(self.input_ids)


# --- text side ----------------------------------------------------------------------------


@runtime_checkable
class Renderer(Protocol):
    """Turns structured messages (and tools) into prompt text with control/content spans.

    Lifecycle: built once per pipeline from a template artifact; ``render`` is pure and
    thread-safe. ``digest`` identifies the template (its content hash), and every
    :class:`Rendered` carries it. Raises :class:`~pipeline.errors.TemplateError` when the
    template raises (e.g. ``raise_exception`` for an unsupported role).

    Example::

        r = HFChatTemplateRenderer.from_dir("model/")
        out = r.render([Message("user", "hi")], add_generation_prompt=True)
        assert out.text.endswith("<|im_start|>assistant\\n")
        assert out.template_digest == r.digest
    """

    name: str
    digest: str

    def render(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (),
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Rendered:
        """Render ``messages``; ``template_kwargs`` reach the template (``enable_thinking``)."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Maps rendered text to token ids and back.

    ``encode`` encodes control spans with special-token parsing and content spans without it,
    so user text that spells ``<|im_end|>`` never becomes the control token. Immutable after
    construction and thread-safe. ``digest`` hashes the tokenizer artifact. Raises
    :class:`~pipeline.errors.TokenizerError` for unreadable files (at construction) and
    :class:`~pipeline.errors.ValidationError` for an empty prompt.

    Example::

        tok = HFTokenizer.from_dir("model/")
        prompt = tok.encode(renderer.render(messages))
        assert tok.decode(prompt.input_ids, skip_special_tokens=False) == rendered.text
    """

    name: str
    digest: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]

    def encode(self, rendered: Rendered) -> TokenizedPrompt:
        """Token ids of the rendered prompt, span by span."""
        ...

    def encode_text(self, text: str, *, special: bool = False) -> list[int]:
        """Ids of ``text``; special-token strings are parsed only if ``special``."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (whole-sequence decode; the detokenizer streams it)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token ``token_id`` adds to the text when it follows other output
        (a byte-level token may hold part of a UTF-8 character; a word-start token its
        leading space; a special token its own text). Logprobs show tokens with these.
        Raises :class:`~pipeline.errors.InvalidValueError` for an id with no token."""
        ...


@runtime_checkable
class DocumentEncoder(Protocol):
    """Optional tokenizer capability: encode text as a document of its own, the way the
    tokenizer alone encodes it (transformers' ``tokenizer(text)``).

    Special-token strings in the text are parsed, and the ids the tokenizer's own rule puts
    before a sequence (a BOS, where the tokenizer asks for one) come first; nothing is put
    after it, since a prompt is a document still being written. Raw-text completion prompts
    use it; a tokenizer without it leaves them as ``encode_text(text, special=True)``.
    Thread-safe, like the tokenizer.

    Example::

        ids = tok.encode_document("<|im_start|>user\nhi")   # [BOS?] + ids, specials parsed
    """

    def encode_document(self, text: str) -> list[int]:
        """Ids of ``text`` as a document: the leading ids the tokenizer adds, then the text
        with special-token strings parsed."""
        ...


@runtime_checkable
class Detokenizer(Protocol[S]):
    """Incremental detokenization with explicit state.

    Call order per request: ``start`` once, ``step`` once per selected token that is part of
    the output, ``finish`` once at the end. ``step`` returns only text that can never change:
    no broken UTF-8 tail and no U+FFFD for a character split across tokens. The prompt is
    not decoded: the concatenation of every ``step`` result and ``finish`` equals
    ``tokenizer.decode(output_ids)`` with the same ``skip_special_tokens``. States are
    values; the detokenizer itself is stateless and shared by all requests.

    Example::

        st = detok.start(prompt_ids)
        for t in ids:
            st, piece = detok.step(st, t)
            out.append(piece)
        out.append(detok.finish(st))
    """

    def start(self, prompt_ids: Sequence[int]) -> S:
        """The initial state for a request whose prompt is ``prompt_ids``."""
        ...

    def step(self, state: S, token_id: int) -> tuple[S, str]:
        """Add one token; return the new state and the text that became final."""
        ...

    def finish(self, state: S) -> str:
        """The text still held back (a truly invalid byte tail decodes as U+FFFD here)."""
        ...


@runtime_checkable
class ToolCallReader(Protocol):
    """One request's incremental reading of tool calls out of the model's text (docs/design.md §11).

    Call order: ``feed`` with each committed text piece as it arrives, then ``finish`` once.
    Each returns the :data:`~pipeline.contracts.output.OutputPiece`\\s whose content is certain: answer
    text, tool-call deltas (name first, then argument fragments as they are generated) and a
    :class:`~pipeline.contracts.output.ToolCallEnd` per call. A partial marker is held back until the
    next piece decides it. ``calls`` are the well-formed finished calls so far. Owned by one
    consumer (the engine thread for a request); never raises on any model output.

    Example::

        reader = HermesParser().start("req-1")
        pieces = reader.feed('<tool_call>{"name": "f", "arg') + reader.feed(
            'uments": {"x": 1}}</tool_call>') + reader.finish()
        assert [c.name for c in reader.calls] == ["f"]
        assert json.loads(reader.calls[0].arguments) == {"x": 1}
    """

    def feed(self, text: str) -> list[OutputPiece]:
        """Read more text; the pieces it made certain, in order."""
        ...

    def finish(self) -> list[OutputPiece]:
        """End of output: the rest (an unclosed call that is not complete becomes text)."""
        ...

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The finished, well-formed calls, in order."""
        ...


@runtime_checkable
class ToolCallParser(Protocol):
    """A model family's tool-call format: recognizes it, and reads it out of generated text.

    Stateless and shared; ``start`` makes a :class:`ToolCallReader` per request, whose call
    ids derive from ``request_id`` and the call's index (so replays give the same ids).
    ``recognizes`` is given a chat template's rendering of an assistant turn that calls a
    tool and says whether that is this format (how ``build`` picks a parser for a model).

    Example::

        parser = HermesParser()
        assert parser.recognizes('<tool_call>\n{"name": "probe", "arguments": {}}\n</tool_call>')
        reader = parser.start("req-1")
    """

    name: str

    def recognizes(self, rendered_call: str) -> bool:
        """True when ``rendered_call`` (a template's rendering of a call) is this format."""
        ...

    def start(self, request_id: str) -> ToolCallReader:
        """A fresh reader for one request's output."""
        ...


@attrs.frozen
class StopContext:
    """What a stopper may consult when a request starts."""

    eos_token_ids: frozenset[int]
    accepted_ns: int


@attrs.frozen
class StopVerdict:
    """A stopper's decision to end the request.

    ``keep_token_text``: whether the stopping token's text belongs to the output (true for
    ``max_tokens``, false for EOS and stop tokens).
    """

    reason: FinishReason
    detail: str | int | None = None
    keep_token_text: bool = False


@runtime_checkable
class Stopper(Protocol[S]):
    """Decides when a request ends, and holds back text that might belong to a stop string.

    Call order per selected token: ``check_token`` (before the token is detokenized), then, if
    the run goes on or keeps the token's text, ``check_text`` with the detokenized piece. On the
    last call ``final`` is true and a stopper must release everything it held back. Text
    stoppers are chained: each receives what the previous one released. A stopper never emits
    any part of a matched stop string; it trims it (and what follows) from the output.

    Example::

        st = stopper.start(request, ctx)
        verdict = stopper.check_token(st, token_id, generated=t)
        st, released, verdict2 = stopper.check_text(st, piece, final=False)
    """

    name: str

    def start(self, request: Request, context: StopContext) -> S:
        """The initial state for ``request``."""
        ...

    def check_token(self, state: S, token_id: int, generated: int) -> StopVerdict | None:
        """A verdict if selecting ``token_id`` as output number ``generated`` ends the run."""
        ...

    def check_text(self, state: S, text: str, final: bool) -> tuple[S, str, StopVerdict | None]:
        """Feed new text; return the new state, the text safe to emit, and a verdict."""
        ...


