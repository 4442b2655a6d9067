"""The stage Protocols and the small value types that pass between stages.

Each Protocol's docstring is its contract: call order and lifecycle, who may mutate what, what
it raises, and an example. Implementations live in ``stages/``, ``backends/`` and
``transports/``; fakes for every one live in :mod:`pipeline.testing`. A typing test proves each
implementation satisfies its Protocol (``runtime_checkable`` only checks names).

Decode state (docs/design.md §5, state D) is explicit: the engine owns one :class:`Row` per active
request and hands a read-only :class:`Batch` of them to processors and selectors; stages with
per-request state (detokenizer, stoppers) receive their state and return the new one.
"""

from __future__ import annotations

import enum
import itertools
from types import MappingProxyType
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import (
    TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, overload, runtime_checkable,
)

import attrs
import torch

from pipeline.errors import InvalidValueError
from pipeline.types import (
    FinishReason, GenerationConfig, Message, OutputPiece, Rendered, Request, TokenizedPrompt,
    TokenLogprob, ToolCall, ToolSpec,
)

if TYPE_CHECKING:
    from pipeline.engine import RequestHandle
    from pipeline.engine.forcing import Forcing

S = TypeVar("S")
Out_co = TypeVar("Out_co", covariant=True)


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
    Each returns the :data:`~pipeline.types.OutputPiece`\\s whose content is certain: answer
    text, tool-call deltas (name first, then argument fragments as they are generated) and a
    :class:`~pipeline.types.ToolCallEnd` per call. A partial marker is held back until the
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


# --- decode state, processors, selection --------------------------------------------------


NO_STATES: Mapping[str, Any] = MappingProxyType({})
"""The processor states of a row whose strategy keeps none (shared: a row per step each)."""


class TokenIds(Sequence[int]):
    """A fixed, read-only view of token ids that copies nothing: the first ``n`` ids of a list
    that only grows (the engine's committed output), then ``tail`` (a verified position's
    drafts). The list may grow after the view was made; the view does not. Slices are lists;
    it equals any sequence with the same ids.

    Example::

        output = [5, 6]
        ids = TokenIds(output)            # (5, 6)
        output.append(7)                  # ids is still (5, 6)
        ids.extended((9,))                # (5, 6, 9), nothing copied
    """

    __slots__ = ("_base", "_n", "_tail")

    def __init__(self, base: Sequence[int], n: int | None = None,
                 tail: Sequence[int] = ()) -> None:
        self._base = base
        self._n = len(base) if n is None else n
        self._tail = tuple(tail)

    def extended(self, more: Sequence[int]) -> TokenIds:
        """These ids followed by ``more``."""
        return TokenIds(self._base, self._n, (*self._tail, *more))

    def __len__(self) -> int:
        return self._n + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        n = self._n
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            out = list(self._base[start:min(stop, n)]) if start < n else []
            if stop > n:
                out.extend(self._tail[max(start - n, 0):stop - n])
            return out
        at = index + len(self) if index < 0 else index
        if not 0 <= at < len(self):
            raise IndexError(index)
        return self._base[at] if at < n else self._tail[at - n]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self._base, self._n), self._tail)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    def __repr__(self) -> str:
        return f"TokenIds({list(self)!r})"


def with_tokens(ids: Sequence[int], more: Sequence[int]) -> Sequence[int]:
    """``ids`` followed by ``more``, copying ``ids`` only when it is not a :class:`TokenIds`."""
    return ids.extended(more) if isinstance(ids, TokenIds) else (*ids, *more)


@attrs.frozen
class Row:
    """The decode state of one request, as processors and selectors see it (read-only).

    ``output_ids`` are the selected tokens y_1..y_{t-1} (from the engine, a :class:`TokenIds`
    view of its list: fixed when the row is made, nothing copied). ``step`` is t, the 1-based index of the token about to be selected; the RNG
    cursor is (``seed``, ``stream``, ``step``). ``states`` holds, by processor name, the
    request's state of each :class:`StatefulProcessor` (empty when the strategy keeps none):
    a cache of a function of the row's ids that covers its first outputs, never a different
    answer.
    """

    request_id: str
    config: GenerationConfig
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    step: int
    seed: int
    eos_token_ids: frozenset[int]
    stream: int = 0
    states: Mapping[str, Any] = attrs.field(default=NO_STATES, eq=False, repr=False)

    def with_states(self, states: Mapping[str, Any]) -> Row:
        """This row carrying ``states`` (built directly: it runs per row per step, where
        ``attrs.evolve`` costs several times more)."""
        return Row(self.request_id, self.config, self.prompt_ids, self.output_ids, self.step,
                   self.seed, self.eos_token_ids, self.stream, states)


@attrs.frozen
class Batch:
    """The rows whose logits are being processed this step, in logits-row order."""

    rows: tuple[Row, ...]
    vocab_size: int

    def __len__(self) -> int:
        return len(self.rows)


@attrs.frozen
class Scores:
    """Logits in one of two layouts.

    Dense: ``values`` is ``[B, V]`` and column j is token j (``indices`` is None). Sparse:
    after a truncation (top-k), ``values`` is ``[B, K]`` and ``indices`` ``[B, K]`` names the
    token of each column; tokens not listed have probability zero. ``-inf`` marks a removed
    candidate in either layout.
    """

    values: torch.Tensor
    indices: torch.Tensor | None = None

    @property
    def dense(self) -> bool:
        """True in the dense layout."""
        return self.indices is None

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """The ``[B, V]`` logits, ``-inf`` for tokens outside a sparse candidate set."""
        if self.indices is None:
            return self.values
        out = torch.full((self.values.shape[0], vocab_size), float("-inf"),
                         dtype=self.values.dtype, device=self.values.device)
        return out.scatter_(1, self.indices, self.values)


@runtime_checkable
class LogitProcessor(Protocol):
    """One link of the processor chain: a pure function of (scores, batch) -> scores.

    Processors are built once per pipeline (factories reject bad arguments then) and hold no
    per-request state: per-row parameters come from ``row.config``. ``active(row)`` says
    whether the processor changes that row; the chain skips a processor no row activates.
    ``argmax_invariant`` is true when the processor can never change the most likely token
    (temperature, top-k, top-p, min-p, typical-p), so the chain may skip it for greedy rows. A
    processor may return a new ``Scores`` or modify ``scores.values`` in place; it must not
    touch rows it is not active for. Raises only for programming errors.

    Example::

        class Ban13:
            name, argmax_invariant = "ban13", False
            def active(self, row): return True
            def __call__(self, scores, batch):
                scores.to_dense(batch.vocab_size)[:, 13] = float("-inf"); return scores
    """

    name: str
    argmax_invariant: bool

    def active(self, row: Row) -> bool:
        """Whether this processor changes ``row``'s logits."""
        ...

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Process the batch's logits."""
        ...


@runtime_checkable
class StatefulProcessor(Protocol):
    """An optional capability of a processor: per-request state that advances with each
    committed token, so its per-step work does not grow with the output (the penalties keep
    the counts of what a request has seen instead of rebuilding them from its ids).

    A strategy that commits one token at a time keeps the states (``start`` when the request
    starts, ``advance`` with every committed token, ``finish`` when it ends) and hands them to
    the chain in :attr:`Row.states`. A state covers the request's first committed outputs; a
    row whose ids go further (a verified draft position) adds the rest itself, and a row with
    no state is processed from its ids alone, with the same result.
    """

    def start(self, row: Row) -> Any:
        """The state of a request at its first step (``row.output_ids`` is empty)."""
        ...

    def advance(self, state: Any, token: int) -> None:
        """Account for one committed output token."""
        ...

    def finish(self, state: Any) -> None:
        """The request ended: release what the state holds."""
        ...


@runtime_checkable
class RequestCheck(Protocol):
    """An optional capability of a processor: a check of each request before it is queued,
    for what only that processor can tell (the grammar processor: whether ``max_tokens`` can
    hold any output its grammar allows). The pipeline calls it on the caller's thread, after
    tokenization; it raises :class:`~pipeline.errors.InvalidValueError` naming the field."""

    def check_request(self, config: GenerationConfig, prompt_ids: Sequence[int]) -> None:
        """Raise when no run of ``config`` after ``prompt_ids`` could succeed."""
        ...


@attrs.frozen
class Selection:
    """What a selector chose: one token per row, and log-probabilities where asked for.

    For the trace, a selector also returns the processed ``scores`` it chose from and, per
    row, the uniform ``draws`` it consumed (None for a row it did not sample); both are
    optional, and a trace records what is given.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]
    scores: Scores | None = attrs.field(default=None, eq=False)
    draws: tuple[float | None, ...] = ()


@runtime_checkable
class Selector(Protocol):
    """Chooses one token per row from processed scores.

    Deterministic given (scores, batch): a sampling selector draws its uniform number for a
    row as a pure function of (``row.seed``, ``row.stream``, ``row.step``), so a request's
    draws do not depend on the batch it runs in. Logprobs are those of the processed
    distribution it selected from; returned only for rows with ``config.logprobs``.

    Example::

        sel = SamplingSelector()
        choice = sel(Scores(logits), batch)
        token = choice.token_ids[0]
    """

    name: str

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """Select one token per row."""
        ...


# --- model --------------------------------------------------------------------------------


@attrs.frozen
class PrefillChunk:
    """Prompt tokens ``token_ids`` for ``slot`` at positions ``start .. start+len-1``.

    ``start`` equals the slot's cache length before the call; the chunk is the last of its
    prompt when ``last`` is true (only then are its logits used). A convenience of the torch
    and scripted backends' ``prefill``; the engine speaks :class:`ModelCall`.
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    last: bool


class Attention(enum.Enum):
    """How a call's new tokens attend (docs/design.md §6, second edition).

    ``CAUSAL``: each new token sees the cached prefix and the new tokens before it.
    ``BLOCK``: each new token sees the cached prefix and *every* new token of its call
    (bidirectional within the block over a causal prefix), as masked diffusion needs.
    """

    CAUSAL = "causal"
    BLOCK = "block"


def _block_table(value: Iterable[int] | None) -> tuple[int, ...] | None:
    """A block table as a tuple (None stays None)."""
    return None if value is None else tuple(value)


@attrs.frozen
class ModelCall:
    """One sequence's part of a :meth:`Backend.forward`.

    ``token_ids`` go at positions ``start .. start+len-1``; ``start`` must equal the slot's
    cache length before the call. ``outputs`` are the offsets into ``token_ids`` whose logits
    are wanted, ascending (a prefill chunk that is not its prompt's last wants none; a decode
    token wants ``(0,)``; verifying k drafts after a pending token wants ``range(k + 1)``).
    With ``write`` false the call reads the cache but leaves the slot's length as it was (its
    keys and values are never read again).

    ``blocks`` is the sequence's block table when the caller manages KV memory in blocks
    (:class:`PagedBackend`): block ``blocks[i]`` holds positions ``i*block_size ..
    (i+1)*block_size - 1``, and it covers at least ``start + len(token_ids)`` positions
    (``start`` for a call that does not write). None leaves memory to the backend.

    Continuous strategies (docs/design.md §10) feed embeddings instead of tokens: ``embeddings`` (a
    tensor ``[len(token_ids), d]`` on the model's device, in the backend's
    :meth:`EmbeddingInputs.embedding_space`) replaces the token embeddings of the call's
    positions, whose ``token_ids`` then only keep the length (placeholder ids); ``time`` (in
    [0, 1], the model family's time) and ``self_condition`` (the previous x0 estimate,
    ``[len(token_ids), d]``) condition a model that was trained with them
    (:class:`EmbeddingInputs`). All three default to None: a plain call.

    ``prompt`` marks a prompt chunk (:meth:`chunk` sets it): a batch-invariant backend computes
    a prompt position the same way whichever chunk it arrives in (whole, cut by the token
    budget, or after a prefix-cache hit), as it computes a decode token the same way in any
    batch.

    Example::

        ModelCall(slot, (y_t,), start=m + t - 1, outputs=(0,))        # a decode step
        ModelCall(slot, tuple(chunk), start=0, outputs=())             # a non-final chunk
        ModelCall(slot, (y_t,), m + t - 1, (0,), blocks=kv.table(seq)) # paged decode step
        ModelCall(slot, (0,) * 16, n, tuple(range(16)), Attention.BLOCK, write=False,
                  embeddings=x_t, time=0.7)                            # a denoising pass
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    outputs: tuple[int, ...]
    attention: Attention = Attention.CAUSAL
    write: bool = True
    blocks: tuple[int, ...] | None = attrs.field(default=None, converter=_block_table)
    embeddings: torch.Tensor | None = attrs.field(default=None, eq=False)
    time: float | None = None
    self_condition: torch.Tensor | None = attrs.field(default=None, eq=False)
    prompt: bool = False

    @classmethod
    def chunk(cls, chunk: PrefillChunk, blocks: Sequence[int] | None = None) -> ModelCall:
        """The call for a prefill chunk: logits at its last token when it ends its prompt
        (``blocks``: the sequence's block table, when the caller manages KV memory)."""
        return cls(chunk.slot, chunk.token_ids, chunk.start,
                   (len(chunk.token_ids) - 1,) if chunk.last else (), blocks=blocks,
                   prompt=True)

    @classmethod
    def planned(cls, slot: int, start: int, plan: Plan,
                blocks: Sequence[int] | None = None) -> ModelCall:
        """The call for a strategy's :class:`Plan`, placed in the cache: at ``slot``, after
        its ``start`` cached positions, with ``blocks`` its block table (None: the backend
        keeps its memory). Every field the plan has, the call takes as it is."""
        return cls(slot, plan.token_ids, start, plan.outputs, plan.attention, plan.write,
                   blocks, embeddings=plan.embeddings, time=plan.time,
                   self_condition=plan.self_condition)


def split_outputs(calls: Sequence[ModelCall], logits: torch.Tensor) -> list[torch.Tensor]:
    """Each call's rows of a forward's ``[N, V]`` logits (``[len(outputs), V]`` each)."""
    out, at = [], 0
    for call in calls:
        n = len(call.outputs)
        out.append(logits[at:at + n])
        at += n
    return out


@runtime_checkable
class Backend(Protocol):
    """A model that keeps a KV cache per slot and computes logits (docs/design.md §4, §6).

    Lifecycle: ``allocate`` a slot per request; ``forward`` batches of :class:`ModelCall`
    (prompt chunks, decode tokens, draft verification, denoising passes of a block: all one
    shape, one batched call per engine step); ``truncate`` a slot to roll back positions it
    no longer wants (rejected drafts); ``release``. Step order (docs/design.md §4): after the prompt
    of m tokens the slot's cache length is m; a call writing y_t makes it m+t and its logits
    are z_{t+1}. Every layer's keys and values cover the same positions.

    ``forward`` returns float32 logits ``[N, V]``: the wanted outputs of every call, in call
    order then offset order (:func:`split_outputs` slices them). Calls come from one thread
    (the engine's). On failure raise :class:`~pipeline.errors.SlotError` naming the slots at
    fault when the other rows' caches are intact; any other exception fails every request in
    the call. :class:`~pipeline.errors.CapacityError` from ``allocate`` means "no free slot".

    Example::

        slot = backend.allocate()
        z1 = backend.forward([ModelCall(slot, ids, 0, (len(ids) - 1,))])[0]   # cache m
        y1 = int(z1.argmax())
        z2 = backend.forward([ModelCall(slot, (y1,), len(ids), (0,))])[0]     # cache m+1
        backend.release(slot)
    """

    vocab_size: int
    num_slots: int
    max_context: int
    snapshot: str

    def allocate(self) -> int:
        """Reserve a free slot with an empty cache."""
        ...

    def release(self, slot: int) -> None:
        """Free ``slot`` and its cache."""
        ...

    def cache_length(self, slot: int) -> int:
        """Positions the slot's cache covers now."""
        ...

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """Run every call as one batch; logits ``[N, V]`` at the wanted outputs."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """Shrink ``slot``'s cache to its first ``length`` positions (never grows it)."""
        ...


@runtime_checkable
class EmbeddingInputs(Protocol):
    """Optional backend capability: calls that feed embeddings (:attr:`ModelCall.embeddings`),
    for continuous diffusion and flow strategies (docs/design.md §10).

    ``embedding_space()`` is the ``[V, d]`` float32 table of every token's embedding in the
    space calls' embeddings live in (on the model's device; the same tensor on every call,
    not to be modified); x0 estimates are mixtures of its rows and rounding finds the
    nearest one. ``time_conditioned`` / ``self_conditioned`` say whether the model reads a
    call's ``time`` / ``self_condition``; a call that gives one the model does not read is
    refused with :class:`~pipeline.errors.SlotError`.

    Example::

        space = backend.embedding_space()                          # [V, d]
        x0_hat = logits.softmax(-1) @ space                         # [L, d]
    """

    @property
    def embedding_dim(self) -> int:
        """d, the width of embedding inputs."""
        ...

    @property
    def time_conditioned(self) -> bool:
        """Whether the model reads a call's ``time``."""
        ...

    @property
    def self_conditioned(self) -> bool:
        """Whether the model reads a call's ``self_condition``."""
        ...

    def embedding_space(self) -> torch.Tensor:
        """Every token's embedding ``[V, d]`` in the space of embedding inputs."""
        ...


@runtime_checkable
class Embedder(Protocol):
    """Optional backend capability: the model's final hidden states of a token sequence,
    for embeddings (``POST /v1/embeddings``).

    ``hidden_states(token_ids)`` runs the model over ``token_ids`` as one causal sequence from
    position 0 and returns its last layer's output after the final norm, before the output
    head: ``[T, hidden_size]`` float32, one row per token. It writes no KV cache and touches
    no slot, so it never disturbs a request in flight; like every backend call it must come
    from the engine's thread (the model's scratch state is shared with ``forward``), e.g.
    through :meth:`~pipeline.engine.api.EngineAPI.call`. Raises
    :class:`~pipeline.errors.InvalidValueError` for an empty sequence, one longer than
    ``max_context``, or an id outside the vocabulary.

    Example::

        future = engine.call(lambda: backend.hidden_states(ids))
        states = future.result()                                  # [len(ids), hidden_size]
        vector = torch.nn.functional.normalize(states.mean(0), dim=0)
    """

    hidden_size: int

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The final hidden states ``[T, hidden_size]`` (float32) of ``token_ids``."""
        ...


@runtime_checkable
class PagedBackend(Protocol):
    """Optional backend capability: KV memory in ``num_blocks`` blocks of ``block_size``
    positions whose block tables the caller owns (docs/design.md §6, second edition).

    The caller (the engine) keeps a :class:`~pipeline.engine.blocks.BlockManager` of the same shape
    and passes each sequence's table in :attr:`ModelCall.blocks`; the backend reads and writes
    exactly those blocks and allocates none. Slots still name sequences and carry their
    lengths (``allocate``, ``cache_length``, ``truncate`` and ``release`` work as for any
    :class:`Backend`), with one addition: a call to an empty slot may start at a multiple of
    ``block_size`` when the first blocks of its table hold those positions already (a
    prefix-cache hit); the slot's length becomes ``start + len(token_ids)``. The caller must
    not let two calls of one ``forward`` write a block that another call of it reads, and
    must not write a block another sequence shares (the manager's rules ensure both). A
    backend without this capability keeps the slot API, and the engine leaves memory to it.
    Raises :class:`~pipeline.errors.SlotError` naming the calls whose tables are malformed
    (a block outside ``0..num_blocks-1``, repeated, too few for the positions, written by
    one call and held by another).

    Example::

        kv = BlockManager(backend.num_blocks, backend.block_size, snapshot=backend.snapshot)
        slot, hit = backend.allocate(), kv.match(prompt)
        table = kv.allocate(slot, len(prompt), prefix=hit)
        todo = prompt[hit.cached_tokens:]
        backend.forward([ModelCall(slot, todo, hit.cached_tokens, (len(todo) - 1,), blocks=table)])
    """

    block_size: int
    num_blocks: int

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """As :meth:`Backend.forward`, reading and writing the blocks each call names."""
        ...

    def truncate(self, slot: int, length: int) -> None:
        """As :meth:`Backend.truncate` (the caller frees the blocks it no longer needs)."""
        ...


# --- strategies (docs/design.md §6 second edition, §10) -----------------------------------


StrategyEvent = tuple[str, dict[str, Any]]
"""``(event_type, payload)`` of a trace event a strategy asks the engine to record (component
``strategy``), e.g. ``("spec.drafted", {"step": 5, "proposed": 4, "ids": [...]})``. A payload's
``ids`` list is content: it is recorded as is at ``Recording.FULL`` and as its digest
(``ids_digest``) otherwise."""


@attrs.frozen
class Plan:
    """What a strategy asks of the model for one sequence this step.

    ``token_ids`` are fed after the sequence's cache (at positions ``cache_len ..``);
    ``outputs`` are the offsets into them whose logits the strategy wants back; see
    :class:`ModelCall` for ``attention`` and ``write``. Autoregressive decoding plans
    ``Plan((y_t,), (0,))``; verifying k drafts plans ``Plan((y_t, d_1..d_k), range(k + 1))``.
    ``events`` are the strategy's own trace events about this plan (:data:`StrategyEvent`),
    recorded when its call has run, before ``decode.completed``. ``embeddings``, ``time`` and
    ``self_condition`` go to the call as they are (see :class:`ModelCall`): a continuous
    strategy's denoising pass.
    """

    token_ids: tuple[int, ...]
    outputs: tuple[int, ...]
    attention: Attention = Attention.CAUSAL
    write: bool = True
    events: tuple[StrategyEvent, ...] = attrs.field(default=(), eq=False)
    embeddings: torch.Tensor | None = attrs.field(default=None, eq=False)
    time: float | None = None
    self_condition: torch.Tensor | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Taken:
    """One committed token, with what the trace records about how it was chosen.

    ``draw`` is the uniform number the selector consumed (None for argmax); ``forced`` is the
    event a forced-token source recorded when it overrode the selection
    (``(event_type, payload)``, see :class:`pipeline.engine.forcing.Forcing`).
    """

    token_id: int
    logprob: TokenLogprob | None = None
    draw: float | None = None
    forced: tuple[str, dict[str, Any]] | None = None


@attrs.frozen
class Update(Generic[S]):
    """A strategy's verdict for one sequence after a model call.

    ``taken`` are the tokens committed this step, in order (possibly none: a denoising
    step that commits nothing yet); ``rollback`` is how many of the positions the plan fed
    the cache must drop again (rejected drafts); ``processed`` holds, per taken token, the
    dense processed logits it was chosen from (``[len(taken), V]``, for the trace; None if
    the strategy does not report them); ``events`` are the strategy's own trace events about
    this step (:data:`StrategyEvent`), recorded before the first taken token.
    """

    state: S
    taken: tuple[Taken, ...]
    rollback: int = 0
    processed: torch.Tensor | None = attrs.field(default=None, eq=False)
    events: tuple[StrategyEvent, ...] = attrs.field(default=(), eq=False)


@attrs.frozen
class Honours:
    """What a strategy can honour of a request's controls (its capability model).

    Four controls act on how tokens are committed, and only some strategies can keep them:
    ``grammar`` (every committed token allowed by the request's grammar: a strategy that
    commits a block it predicted at once cannot), ``forced_prefix`` and
    ``reasoning_budget`` (a forced-token source overrides committed tokens,
    :class:`~pipeline.engine.forcing.Forcing`), and ``logprobs`` (each committed token's
    log-probability). The pipeline checks a request against its strategy's ``honours`` once,
    when it is submitted, and refuses what the strategy would not keep with an
    :class:`~pipeline.errors.InvalidValueError` naming the field; nothing is dropped silently.

    Example::

        Honours.ALL.refusal(config, "autoregressive")                 # None: all kept
        Honours(logprobs=True).refusal(GenerationConfig(forced_prefix=(5,)), "continuous")
        # InvalidValueError: forced_prefix ... the 'continuous' strategy cannot ...
    """

    grammar: bool = False
    forced_prefix: bool = False
    reasoning_budget: bool = False
    logprobs: bool = False

    ALL: ClassVar[Honours]

    def refusal(self, config: GenerationConfig, strategy: str) -> InvalidValueError | None:
        """The error for the first control ``config`` asks for that this strategy cannot keep
        (None when it keeps them all)."""
        grammar = config.grammar
        asked: tuple[tuple[bool, bool, str, Any, str], ...] = (
            (self.grammar, grammar is not None, grammar.field if grammar else "grammar",
             "(grammar)", "commits positions of a block it predicts at once, so a grammar "
             "cannot constrain it; use an autoregressive model and strategy for structured "
             "output"),
            (self.forced_prefix, bool(config.forced_prefix), "forced_prefix",
             list(config.forced_prefix), "cannot force output tokens"),
            (self.reasoning_budget, config.reasoning_budget_tokens is not None,
             "reasoning_budget_tokens", config.reasoning_budget_tokens,
             "cannot force output tokens (a spent reasoning budget forces the end of thinking)"),
            (self.logprobs, config.logprobs, "logprobs", True,
             "does not report log-probabilities"),
        )
        for kept, wanted, field, value, why in asked:
            if wanted and not kept:
                return InvalidValueError(field, value, f"the {strategy!r} strategy {why}")
        return None


Honours.ALL = Honours(grammar=True, forced_prefix=True, reasoning_budget=True, logprobs=True)


@runtime_checkable
class Strategy(Protocol):
    """A generation strategy: it owns each request's loop state (docs/design.md §6, §10).

    Every strategy runs as ``start`` (after the prompt is in the cache) -> repeatedly
    ``plan`` a model call -> the engine batches every sequence's call into one
    :meth:`Backend.forward` -> ``update`` with the logits it asked for -> commit tokens,
    until a stopper ends the request. The engine owns scheduling, KV memory and the trace;
    the text stages (detokenizer, stoppers, transport) see only the tokens a strategy
    commits. The first ``update`` receives the prompt's last logits z_1 (no plan).

    ``update`` is batched: it gets the states, the :class:`Row` of each sequence (its
    committed tokens; ``step`` is the index of the next token) and each sequence's logits
    ``[len(plan.outputs), V]``, and returns one :class:`Update` per sequence. States are
    owned by the strategy; the engine stores them and hands them back. ``order`` names the
    processors a row's logits go through, for the trace. ``finish`` is called once per
    started sequence when its request ends (finished, cancelled or failed), so a strategy can
    free what its state holds (a draft model's cache slot); it must not raise. ``honours`` says which of
    a request's controls the strategy keeps (:class:`Honours`); the pipeline refuses the
    others when the request is submitted.

    Example::

        ar = AutoregressiveStrategy(chain, selector)
        state = ar.start(row, Forcing.none())
        update = ar.update([state], [row], [z1])[0]     # update.taken[0].token_id == y_1
        ar.plan(update.state)                           # Plan((y_1,), (0,))
    """

    name: str
    honours: Honours

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        ...

    def start(self, row: Row, forcing: Forcing) -> Any:
        """The loop state of a sequence whose prompt is in the cache."""
        ...

    def plan(self, state: Any) -> Plan:
        """The model call this sequence needs next."""
        ...

    def update(self, states: Sequence[Any], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> Sequence[Update[Any]]:
        """Commit tokens for each sequence from the logits its plan asked for."""
        ...

    def finish(self, state: Any) -> None:
        """The sequence's request ended: release what ``state`` holds."""
        ...


# --- delivery -----------------------------------------------------------------------------


@attrs.frozen
class CacheLayout:
    """Per-layer key and value lengths of one slot's cache (docs/design.md §8, invariant 2)."""

    key_lengths: tuple[int, ...]
    value_lengths: tuple[int, ...]


@runtime_checkable
class CacheInspector(Protocol):
    """Optional backend capability: report each layer's key and value lengths for a slot.

    A backend that has it gets those lengths recorded in ``prefill.completed`` and
    ``decode.completed``, so ``pipeline trace check`` can verify invariant 2 layer by layer;
    without it the trace records the one logical length ``cache_length`` gives.

    Example::

        layout = backend.cache_layout(slot)      # CacheLayout((7, 7), (7, 7))
    """

    def cache_layout(self, slot: int) -> CacheLayout:
        """The lengths of every layer's keys and values in ``slot``'s cache."""
        ...


@attrs.frozen
class ModelInfo:
    """What a loaded model is, for logs and listings (``pipeline serve``, ``pipeline chat``).

    ``architecture`` is the checkpoint's class name (``Qwen3ForCausalLM``); ``parameters``
    counts every weight once (a tied output head is the embedding); ``dtype`` and ``device``
    are the weights' (``bfloat16``, ``cpu``). ``weight_bytes`` is the memory the weights hold,
    quantized ones at their encoded size; ``packed_bytes`` the extra copies laid out for
    faster products; ``cache_bytes`` the preallocated key/value cache of every slot.
    """

    architecture: str
    parameters: int
    dtype: str
    device: str
    weight_bytes: int
    packed_bytes: int = 0
    cache_bytes: int = 0

    def summary(self) -> str:
        """``Qwen3MoeForCausalLM, 6.35M parameters, bfloat16 on cpu``."""
        return (f"{self.architecture}, {human_count(self.parameters)} parameters, "
                f"{self.dtype} on {self.device}")


def human_count(n: int) -> str:
    """``6348864`` → ``6.35M``; ``134515008`` → ``135M``; ``7615616512`` → ``7.62B``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def human_bytes(n: int) -> str:
    """``12697728`` → ``12.1 MiB`` (binary units, one decimal; below 1 KiB: ``512 B``)."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


@runtime_checkable
class ModelDescriber(Protocol):
    """Optional backend capability: say what model it runs (:class:`ModelInfo`).

    Called from any thread after the backend is built; the answer does not change while the
    backend lives. :meth:`Pipeline.model_info <pipeline.pipe.Pipeline.model_info>` returns
    ``None`` for a backend without it.

    Example::

        info = backend.model_info()    # ModelInfo('LlamaForCausalLM', 134515008, ...)
    """

    def model_info(self) -> ModelInfo:
        """The model's architecture, size, dtype, device and memory."""
        ...


@runtime_checkable
class Transport(Protocol[Out_co]):
    """Delivers a request's deltas to a consumer, in order, and ends after the final one.

    ``deliver`` is called once per request handle, from the consumer's thread or event loop.
    If the consumer goes away before the final delta (an iterator is closed, a client
    disconnects), the transport calls ``handle.cancel()`` so the engine frees the slot.

    Example::

        for delta in InProcessTransport().deliver(pipe.submit("hi")):
            print(delta.text, end="")
    """

    name: str

    def deliver(self, handle: RequestHandle) -> Out_co:
        """Start delivering ``handle``'s deltas."""
        ...


SyncTransport = Transport[Iterator[Any]]
AsyncTransport = Transport[AsyncIterator[Any]]
