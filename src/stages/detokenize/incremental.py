"""The generic incremental detokenizer: offset windows over any tokenizer's ``decode``.

It owns :class:`IncrementalDetokenizer` and its state value :class:`WindowState`. The method
is the one TGI and vLLM's slow path use (``prefix_offset`` / ``read_offset``): decode a short
window of recent ids twice — the part already emitted and the whole window — and emit the
difference once it is final. Only the window is decoded, so a step costs O(1) in the length of
the output.

Why the window starts empty (no prompt tail): the contract is that the pieces concatenate to
``decode(output_ids)``. Priming the window with prompt ids would decode the first output token
in the middle of a sequence, where a sentencepiece ``Metaspace`` decoder keeps its leading
space, while ``decode(output_ids)`` strips it; it would also leak prompt bytes when the prompt
ends inside a character. Starting empty decodes the first token exactly as the full decode
does, and every later window begins with a token already emitted, so a decoder's
start-of-text rules (strip one leading space, keep ``##``) apply to both halves of the
difference and cancel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

REPLACEMENT = "\ufffd"
"""U+FFFD, what a decoder writes for bytes that are not (yet) a whole character."""

WINDOW = 6
"""Emitted tokens a window keeps before it slides forward (bounds the cost of a step)."""

MAX_HELD = 8
"""Held tokens after which a stable prefix of the held text is released anyway (see step)."""


class TextDecoder(Protocol):
    """The part of :class:`pipeline.contracts.text.Tokenizer` the detokenizers need."""

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        ...


@attrs.frozen
class WindowState:
    """Where one request's detokenization stands.

    ``ids`` is the window: the output ids from the last emission point on (skipped special
    tokens are left out, since decode drops them anyway). ``ids[:read]`` were emitted already,
    and ``prefix_text`` is their decode; ``ids[read:]`` are held back.
    """

    ids: tuple[int, ...] = ()
    read: int = 0
    prefix_text: str = ""

    @property
    def held(self) -> int:
        """How many tokens are held back."""
        return len(self.ids) - self.read


def _settled(text: str, prefix_text: str) -> bool:
    """Whether ``text`` (the window's decode) may be emitted as it stands.

    Not while it adds nothing, not while it ends in U+FFFD (a character may still be coming),
    and not while it ends in a space: a decoder that cleans up tokenization spaces (``" ."``
    to ``"."``) may still remove it when the next token arrives.
    """
    if len(text) <= len(prefix_text):
        return False
    return not text.endswith((REPLACEMENT, " "))


class IncrementalDetokenizer:
    """Streams ``tokenizer.decode`` token by token, holding back text until it is final.

    Satisfies :class:`pipeline.contracts.text.Detokenizer` with :class:`WindowState`. The object is
    stateless and may be shared by every request and thread.

    Exactness: the pieces concatenate to ``tokenizer.decode(output_ids, skip_special_tokens=
    ...)`` for every decoder whose output is prefix-stable at the points it emits from —
    byte-level BPE (GPT-2, Qwen, Llama 3), ``Metaspace``/``Strip``/``Replace`` sentencepiece
    decoders, WordPiece, and byte fallback over valid UTF-8. Decoders that rewrite text
    across an already emitted boundary (a cleanup of ``" n't"`` split over two tokens, byte
    fallback over invalid UTF-8) can differ, as in every streaming engine.

    Example::

        detok = IncrementalDetokenizer(tokenizer)
        st = detok.start(prompt_ids)
        st, piece = detok.step(st, token_id)
        tail = detok.finish(st)
    """

    def __init__(self, tokenizer: TextDecoder, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def start(self, prompt_ids: Sequence[int]) -> WindowState:
        """An empty window; the prompt is not decoded (see the module docstring)."""
        return WindowState()

    def step(self, state: WindowState, token_id: int) -> tuple[WindowState, str]:
        """Add ``token_id``; return the new state and the text that became final."""
        if token_id in self._skipped:
            return state, ""
        ids = state.ids + (token_id,)
        text = self._decode(ids)
        if _settled(text, state.prefix_text):
            return self._emit(ids, state, len(ids), text)
        if len(ids) - state.read > MAX_HELD:
            return self._release_stable(ids, state, text)
        return WindowState(ids, state.read, state.prefix_text), ""

    def _emit(self, ids: tuple[int, ...], state: WindowState, upto: int,
              upto_text: str) -> tuple[WindowState, str]:
        """Emit ``decode(ids[:upto])`` past what was emitted; slide the window when it is long.

        Sliding moves the window's start to the previous emission point, which costs one more
        decode, so it is done only once the emitted part exceeds ``WINDOW`` tokens.
        """
        piece = upto_text[len(state.prefix_text):]
        if upto <= WINDOW or state.read == 0:
            return WindowState(ids, upto, upto_text), piece
        window = ids[state.read:]
        read = upto - state.read
        return WindowState(window, read, self._decode(window[:read])), piece

    def _release_stable(self, ids: tuple[int, ...], state: WindowState,
                        text: str) -> tuple[WindowState, str]:
        """Bound the window when many tokens are held (runs of invalid bytes or spaces).

        A held character is at most four byte tokens long, so after ``MAX_HELD`` tokens some
        of the held text is settled: emit up to the last token boundary whose decode is a
        strict prefix of the window's decode (under byte-level decoding a trailing U+FFFD
        that later text confirms is an invalid byte, not half of a character).
        """
        for upto in range(len(ids) - 1, state.read, -1):
            part = self._decode(ids[:upto])
            if len(state.prefix_text) < len(part) < len(text) and text.startswith(part):
                return self._emit(ids, state, upto, part)
        return WindowState(ids, state.read, state.prefix_text), ""

    def finish(self, state: WindowState) -> str:
        """Everything still held; an invalid byte tail decodes as U+FFFD here."""
        return self._decode(state.ids)[len(state.prefix_text):]
