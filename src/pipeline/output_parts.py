"""Typed output parts: the model's text split into answer text, thinking and tool calls.

Owns :class:`OutputSplitter`, an incremental splitter over the released text of one request,
which the engine runs once per request as text is released, so every delta carries its
:attr:`~pipeline.contracts.output.Delta.parts` and the completion its whole
:attr:`~pipeline.contracts.output.Completion.parts` (the transports only encode them), and
:func:`opens_thinking`, the one test of whether a rendered prompt opened a think block, and
:func:`held_suffix` (a partial marker held back; the tool-call readers hold theirs so too). The
chat templates mark reasoning with ``<think>…</think>``; the splitter finds these markers
across delta boundaries (holding back a partial marker) and hands the answer text to the
model's tool-call reader (the :mod:`pipeline.tools.formats` parser that ``build`` chose from the chat
template, docs/design.md §11), so tool calls come out as the reader's deltas (the name, then
argument fragments as they are generated) and ends. A call that is not well formed stays
visible as text, so nothing the model wrote is lost. The newlines that open and close a
thinking block, and those right after it, are layout, not content: they are dropped. Both
dialects, streaming and not, read the same parts, so streamed and non-streamed answers agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from pipeline.contracts.text import ToolCallReader
from pipeline.contracts.output import Part, TextPart, TextPiece, ToolCallDelta, ToolCallEnd

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def opens_thinking(prompt: str) -> bool:
    """True when a rendered prompt ends inside an open ``<think>`` block (templates that
    start the reasoning for the model), so the output begins as thinking."""
    return prompt.rstrip().endswith(THINK_OPEN)


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker (held
    back until the next text decides it)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class OutputSplitter:
    """Feed detokenized text; get :data:`Part`\\s in order. Call ``finish`` at the end.

    ``thinking`` starts the splitter inside a reasoning block (a template that opened
    ``<think>`` in the prompt). ``tools`` is the request's tool-call reader (None when the
    request offered no tools: then all answer text is text).
    """

    def __init__(self, *, tools: ToolCallReader | None, thinking: bool = False) -> None:
        self._tools = tools
        self._mode: Literal["text", "thinking"] = "thinking" if thinking else "text"
        self._buffer = ""
        self._think_start = thinking  # newlines opening a thinking block are dropped
        self._think_newlines = ""  # newlines in a thinking block, held until more follows
        self._after_think = False  # newlines right after a thinking block are dropped

    def feed(self, text: str) -> list[Part]:
        """Split more text; parts whose end is certain come back, a partial marker is held."""
        self._buffer += text
        parts: list[Part] = []
        while True:
            marker = THINK_CLOSE if self._mode == "thinking" else THINK_OPEN
            at = self._buffer.find(marker)
            if at < 0:
                keep = held_suffix(self._buffer, (marker,))
                self._emit(self._buffer[:len(self._buffer) - keep], parts)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return parts
            self._emit(self._buffer[:at], parts)
            self._buffer = self._buffer[at + len(marker):]
            if marker == THINK_OPEN:
                self._mode, self._think_start, self._think_newlines = "thinking", True, ""
            else:
                self._mode, self._think_newlines, self._after_think = "text", "", True

    def finish(self) -> list[Part]:
        """End of output: release held text; the reader finishes (an unclosed call that is
        not complete comes back as text)."""
        parts: list[Part] = []
        self._emit(self._buffer, parts)
        self._buffer = ""
        if self._tools is not None:
            self._add(self._tools.finish(), parts)
        return parts

    def _emit(self, text: str, parts: list[Part]) -> None:
        if not text:
            return
        if self._mode == "thinking":
            self._thinking(text, parts)
        else:
            self._text(text, parts)

    def _thinking(self, text: str, parts: list[Part]) -> None:
        """Reasoning without the newlines that open and close its block (Qwen3's template
        writes ``<think>\\n...\\n</think>\\n\\n``; its model card strips them the same way)."""
        if self._think_start:
            text = text.lstrip("\n")
            if not text:
                return
            self._think_start = False
        body = self._think_newlines + text
        kept = body.rstrip("\n")
        self._think_newlines = body[len(kept):]
        if kept:
            parts.append(TextPart("thinking", kept))

    def _text(self, text: str, parts: list[Part]) -> None:
        if self._after_think:
            text = text.lstrip("\n")
            if not text:
                return
            self._after_think = False
        if self._tools is None:
            self._add([TextPiece(text)], parts)
        else:
            self._add(self._tools.feed(text), parts)

    @staticmethod
    def _add(pieces: list[TextPiece | ToolCallDelta | ToolCallEnd], parts: list[Part]) -> None:
        for piece in pieces:
            if not isinstance(piece, TextPiece):
                parts.append(piece)
            elif parts and isinstance(parts[-1], TextPart) and parts[-1].kind == "text":
                parts[-1] = TextPart("text", parts[-1].text + piece.text)
            elif piece.text:
                parts.append(TextPart("text", piece.text))


def joined(parts: list[Part], more: Sequence[Part]) -> None:
    """Append ``more`` to ``parts``, joining a run of one kind of text and a call's argument
    fragments (a call's first delta, with its name, stays apart); each run is joined once,
    so the cost is linear in the text."""
    run: list[str] = []  # the pieces of the run parts[-1] heads, once it has a second

    def flush() -> None:
        if run:
            last = parts[-1]
            if isinstance(last, TextPart):
                parts[-1] = TextPart(last.kind, "".join(run))
            elif isinstance(last, ToolCallDelta):
                parts[-1] = attrs.evolve(last, arguments="".join(run))
            run.clear()

    for part in more:
        last = parts[-1] if parts else None
        if (isinstance(part, TextPart) and isinstance(last, TextPart)
                and last.kind == part.kind):
            run.extend([last.text] if not run else [])
            run.append(part.text)
        elif (isinstance(part, ToolCallDelta) and isinstance(last, ToolCallDelta)
              and part.name is None and last.name is None and last.index == part.index):
            run.extend([last.arguments] if not run else [])
            run.append(part.arguments)
        else:
            flush()
            parts.append(part)
    flush()


def calls_of(parts: list[Part]) -> list[ToolCallEnd]:
    """The well-formed calls' ends among ``parts``."""
    return [p for p in parts if isinstance(p, ToolCallEnd) and p.call is not None]
