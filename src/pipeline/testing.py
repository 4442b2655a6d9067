"""Fakes for every stage, for the library's tests and for users' own.

Owns small, exact stand-ins that satisfy the stage Protocols:

- :class:`ScriptedBackend` — a model whose next-token logits come from a function of the
  tokens in the slot (use :func:`peaked` for "this token next" scripts, :func:`hashed_logits`
  for a deterministic pseudo-random model); it checks the docs/design.md §4 cache invariants itself.
  Given a ``denoise`` function it is also a denoiser: a call with ``Attention.BLOCK`` gets,
  at each offset, ``denoise(cached tokens, block tokens, offset)`` (use
  :func:`hashed_denoiser` for a deterministic pseudo-random one).
- :class:`ByteTokenizer` — bytes 0–255 are tokens, plus a few ChatML special tokens.
- :class:`ByteDetokenizer` — emits the longest valid UTF-8 prefix of the bytes so far.
- :class:`ChatMLRenderer` — ChatML without jinja, with exact control/content spans.
- :class:`BanTokenProcessor`, :class:`ScriptedSelector`, :class:`TokenCountStopper`,
  :class:`ListTransport` — minimal processor, selector, stopper and transport.

Example::

    backend = ScriptedBackend(ByteTokenizer.VOCAB, peaked(ByteTokenizer.VOCAB, lambda ids: 65))
    pipe = build_scripted(backend)
    assert pipe.generate("hi", max_tokens=3, temperature=0).text == "AAA"
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch

from pipeline.errors import CapacityError, InvalidValueError, SlotError
from pipeline.events import digest_text
from pipeline.engine.handle import RequestHandle
from pipeline.contracts.decode import Batch, Row, Scores, Selection
from pipeline.contracts.model import Attention, CacheLayout, ModelCall, PrefillChunk
from pipeline.contracts.text import StopContext, StopVerdict
from pipeline.contracts.output import Delta, FinishReason
from pipeline.contracts.request import Message, Request, ToolSpec
from pipeline.contracts.text import Rendered, Span, SpanKind, TokenizedPrompt

LogitsFn = Callable[[Sequence[int]], torch.Tensor]
DenoiseFn = Callable[[Sequence[int], Sequence[int], int], torch.Tensor]
"""``(cached tokens, block tokens, offset) -> [V]`` logits at that offset of the block."""


def peaked(vocab_size: int, choose: Callable[[Sequence[int]], int], height: float = 10.0
           ) -> LogitsFn:
    """Logits that put ``height`` on ``choose(tokens)`` and 0 elsewhere."""

    def logits(tokens: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(vocab_size)
        out[choose(tokens)] = height
        return out

    return logits


def hashed_logits(vocab_size: int, context: int = 4, scale: float = 3.0) -> LogitsFn:
    """A deterministic pseudo-random model: logits seeded by the last ``context`` tokens."""

    def logits(tokens: Sequence[int]) -> torch.Tensor:
        key = hashlib.sha256(repr(tuple(tokens[-context:])).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        return torch.randn(vocab_size, generator=gen) * scale

    return logits


def hashed_denoiser(vocab_size: int, scale: float = 3.0) -> DenoiseFn:
    """A deterministic pseudo-random denoiser: logits seeded by the cached prefix's last
    token, the whole block and the offset (so they change as the block fills in)."""

    def logits(cached: Sequence[int], block: Sequence[int], offset: int) -> torch.Tensor:
        key = hashlib.sha256(repr((tuple(cached[-1:]), tuple(block), offset)).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        return torch.randn(vocab_size, generator=gen) * scale

    return logits


class ScriptedBackend:
    """A fake model: each slot's "cache" is its token list; logits = ``fn(tokens)``.

    ``fail(tokens)`` returning true makes the call raise :class:`SlotError` for that slot
    (other rows unharmed). ``delay_s`` sleeps per call, to give cancellation a window.
    ``calls`` logs every forward as ``("forward", [(slot, n_tokens), ...])``; ``model_calls``
    keeps the calls themselves. It reports ``layers`` fake layers' key/value lengths
    (:class:`~pipeline.contracts.model.CacheInspector`). ``denoise`` answers block-attention calls
    (without it they get ``fn`` of the prefix, as causal calls do).
    """

    def __init__(self, vocab_size: int, fn: LogitsFn, *, num_slots: int = 8,
                 max_context: int = 4096, delay_s: float = 0.0,
                 fail: Callable[[Sequence[int]], bool] | None = None, layers: int = 2,
                 denoise: DenoiseFn | None = None) -> None:
        self.vocab_size = vocab_size
        self.num_slots = num_slots
        self.max_context = max_context
        self.snapshot = digest_text(f"scripted:{vocab_size}:{num_slots}")
        self.delay_s = delay_s
        self.layers = layers
        self._fn = fn
        self._fail = fail
        self._denoise = denoise
        self.model_calls: list[ModelCall] = []
        self._cache: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self.calls: list[tuple[str, list[tuple[int, int]]]] = []

    def allocate(self) -> int:
        """A free slot, or :class:`CapacityError`."""
        with self._lock:
            for slot in range(self.num_slots):
                if slot not in self._cache:
                    self._cache[slot] = []
                    return slot
        raise CapacityError("all slots busy")

    def release(self, slot: int) -> None:
        """Free ``slot``."""
        with self._lock:
            self._cache.pop(slot, None)

    def cache_length(self, slot: int) -> int:
        """Tokens written into ``slot``."""
        return len(self._cache[slot])

    def cache_layout(self, slot: int) -> CacheLayout:
        """Per-layer key/value lengths of ``slot`` (``layers`` fake layers, all equal)."""
        n = len(self._cache[slot])
        return CacheLayout((n,) * self.layers, (n,) * self.layers)

    @property
    def busy_slots(self) -> int:
        """Slots allocated now."""
        with self._lock:
            return len(self._cache)

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """Append each writing call's tokens; logits ``[N, V]`` at the wanted outputs."""
        self.calls.append(("forward", [(c.slot, len(c.token_ids)) for c in calls]))
        self.model_calls.extend(calls)
        for c in calls:
            if c.start != len(self._cache[c.slot]):
                raise AssertionError(f"call starts at {c.start}, cache has "
                                     f"{len(self._cache[c.slot])}")
        if self.delay_s:
            time.sleep(self.delay_s)
        bad = [c.slot for c in calls
               if self._fail and self._fail([*self._cache[c.slot], *c.token_ids])]
        if bad:
            raise SlotError(bad, "scripted failure")
        rows = []
        for c in calls:
            seq = [*self._cache[c.slot], *c.token_ids]
            if self._denoise is not None and c.attention is Attention.BLOCK:
                cached = self._cache[c.slot]
                rows += [self._denoise(cached, c.token_ids, o).float() for o in c.outputs]
            else:
                rows += [self._fn(seq[:c.start + o + 1]).float() for o in c.outputs]
            if c.write:
                self._cache[c.slot] = seq
        if not rows:
            return torch.empty((0, self.vocab_size))
        return torch.stack(rows)                                                # [N, V]

    def truncate(self, slot: int, length: int) -> None:
        """Keep ``slot``'s first ``length`` tokens."""
        del self._cache[slot][length:]

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Append chunks; logits at each chunk's last token ``[len(chunks), V]``."""
        return self.forward([ModelCall(c.slot, c.token_ids, c.start, (len(c.token_ids) - 1,))
                             for c in chunks])

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Append one token per slot; logits ``[len(slots), V]``."""
        return self.forward([ModelCall(s, (t,), len(self._cache[s]), (0,))
                             for s, t in zip(slots, token_ids)])


class ByteTokenizer:
    """Bytes are tokens 0–255; then ``<|endoftext|>`` (EOS), ``<|im_start|>``, ``<|im_end|>``."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    VOCAB = 256 + len(SPECIALS)
    name = "bytes"

    def __init__(self) -> None:
        self.digest = digest_text("byte-tokenizer:v1")
        self.vocab_size = self.VOCAB
        self.special_token_ids = frozenset(range(256, self.VOCAB))
        self.eos_token_ids = frozenset({256, 258})

    def encode(self, rendered: Rendered) -> TokenizedPrompt:
        """Control spans parse special tokens; content spans are plain bytes."""
        ids: list[int] = []
        for text, kind in rendered.pieces():
            ids.extend(self.encode_text(text, special=kind is SpanKind.CONTROL))
        return TokenizedPrompt(ids, self.digest, digest_text(rendered.text))

    def encode_text(self, text: str, *, special: bool = False) -> list[int]:
        """Ids of ``text``."""
        if not special:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        at = 0
        while at < len(text):
            hit = next((i for i, s in enumerate(self.SPECIALS) if text.startswith(s, at)), None)
            if hit is None:
                ids.extend(text[at].encode("utf-8"))
                at += 1
            else:
                ids.append(256 + hit)
                at += len(self.SPECIALS[hit])
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The byte itself; a special token's text."""
        if not 0 <= token_id < self.VOCAB:
            raise InvalidValueError("token_id", token_id, f"outside 0..{self.VOCAB - 1}")
        return bytes([token_id]) if token_id < 256 else self.SPECIALS[token_id - 256].encode()

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """UTF-8 text of the byte tokens (invalid bytes become U+FFFD)."""
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend(self.SPECIALS[i - 256].encode())
        return out.decode("utf-8", errors="replace")


@attrs.frozen
class ByteDetokenizerState:
    """Bytes not yet emitted."""

    pending: bytes = b""


class ByteDetokenizer:
    """Incremental detokenizer for :class:`ByteTokenizer` (special tokens are skipped)."""

    def start(self, prompt_ids: Sequence[int]) -> ByteDetokenizerState:
        """Nothing pending."""
        return ByteDetokenizerState()

    def step(self, state: ByteDetokenizerState, token_id: int) -> tuple[ByteDetokenizerState, str]:
        """Emit the longest valid UTF-8 prefix of what is pending."""
        data = state.pending + (bytes([token_id]) if token_id < 256 else b"")
        for cut in range(len(data), max(len(data) - 4, -1), -1):
            try:
                text = data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            return ByteDetokenizerState(data[cut:]), text
        return ByteDetokenizerState(b""), data.decode("utf-8", errors="replace")

    def finish(self, state: ByteDetokenizerState) -> str:
        """Whatever is left, invalid bytes as U+FFFD."""
        return state.pending.decode("utf-8", errors="replace")


class ChatMLRenderer:
    """ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) without a template engine."""

    name = "chatml-fake"
    digest = digest_text("chatml-fake:v1")

    def render(self, messages: Sequence[Message], *, tools: Sequence[ToolSpec] = (),
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Rendered:
        """Render with exact spans: role headers and markers are control, content is content."""
        pieces: list[tuple[str, SpanKind]] = []
        for m in messages:
            pieces += [(f"<|im_start|>{m.role}\n", SpanKind.CONTROL),
                       (m.content or "", SpanKind.CONTENT), ("<|im_end|>\n", SpanKind.CONTROL)]
        if add_generation_prompt:
            pieces.append(("<|im_start|>assistant\n", SpanKind.CONTROL))
        spans, at = [], 0
        for text, kind in pieces:
            if text:
                spans.append(Span(at, at + len(text), kind))
                at += len(text)
        return Rendered("".join(t for t, _ in pieces), tuple(spans), self.digest, self.name)


class BanTokenProcessor:
    """Removes ``token_id`` from every row (a minimal :class:`LogitProcessor`)."""

    argmax_invariant = False

    def __init__(self, token_id: int, name: str = "ban_token") -> None:
        if token_id < 0:
            raise InvalidValueError("token_id", token_id, "must be >= 0")
        self.token_id = token_id
        self.name = name

    def active(self, row: Row) -> bool:
        """Always active."""
        return True

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Set the banned token's logit to -inf."""
        values = scores.to_dense(batch.vocab_size)
        values[:, self.token_id] = float("-inf")
        return Scores(values)


class ScriptedSelector:
    """Selects ``choose(row)`` for every row, ignoring the scores."""

    name = "scripted"

    def __init__(self, choose: Callable[[Row], int]) -> None:
        self._choose = choose

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        """One scripted token per row; no logprobs."""
        return Selection(tuple(self._choose(r) for r in batch.rows), (None,) * len(batch))


class TokenCountStopper:
    """Stops with ``LENGTH`` after ``n`` tokens, whatever the request says."""

    name = "token_count"

    def __init__(self, n: int) -> None:
        self.n = n

    def start(self, request: Request, context: StopContext) -> None:
        """Stateless."""
        return None

    def check_token(self, state: None, token_id: int, generated: int) -> StopVerdict | None:
        """Stop once ``n`` tokens exist."""
        if generated >= self.n:
            return StopVerdict(FinishReason.LENGTH, self.n, keep_token_text=True)
        return None

    def check_text(self, state: None, text: str, final: bool) -> tuple[None, str, None]:
        """Text passes through."""
        return None, text, None


class ListTransport:
    """Collects every delta of a handle into a list (blocking)."""

    name = "list"

    def deliver(self, handle: RequestHandle) -> list[Delta]:
        """All deltas, in order."""
        return list(handle.deltas())


def build_scripted(backend: ScriptedBackend, **stages: Any) -> Any:
    """A pipeline over ``backend`` with the byte tokenizer, ChatML renderer and byte
    detokenizer; ``stages`` override any ``build`` argument."""
    from pipeline.builder import build

    parts: dict[str, Any] = {"tokenizer": ByteTokenizer(), "renderer": ChatMLRenderer(),
                             "detokenizer": ByteDetokenizer()}
    parts.update(stages)
    return build(backend=backend, **parts)


def collect(deltas: Iterator[Delta]) -> str:
    """The text of a delta stream."""
    return "".join(d.text for d in deltas)
