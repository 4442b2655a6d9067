"""Splitting the model's output text into answer text, thinking, and tool calls.

Owns :class:`OutputSplitter`, an incremental parser over the detokenized text of one request.
The chat templates mark reasoning with ``<think>…</think>`` and tool calls with
``<tool_call>{"name": …, "arguments": {…}}</tool_call>``; the splitter finds these markers
across delta boundaries (holding back a partial marker), and turns each completed tool call
into a :class:`ToolCallPart` (its arguments the model's own text). A tool call whose body is
not a JSON object with a string ``name`` stays visible as text, so nothing the model wrote is
lost. The newlines that open and close a thinking block, and those right after it, are
layout, not content: they are dropped. Both dialects, streaming and not, go through this one
parser, so streamed and non-streamed answers agree.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

import attrs

from pipeline.types import unicode_error

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_MARKERS = (THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE)


@attrs.frozen
class TextPart:
    """Answer text (``kind="text"``) or reasoning (``kind="thinking"``)."""

    kind: Literal["text", "thinking"]
    text: str


@attrs.frozen
class ToolCallPart:
    """A parsed tool call; ``arguments`` is JSON text of an object, as the model wrote it."""

    index: int
    id: str
    name: str
    arguments: str


Part = TextPart | ToolCallPart


def tool_call_prefix(name: str) -> str:
    """The text a tool call must begin with: the opening marker, and, when ``name`` is not
    empty, the call's name in the template's format up to its arguments."""
    if not name:
        return TOOL_OPEN + "\n"
    return TOOL_OPEN + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '


def opens_thinking(prompt: str) -> bool:
    """True when a rendered prompt ends inside an open ``<think>`` block (templates that
    start the reasoning for the model), so the output begins as thinking."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _held_suffix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    for n in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in _MARKERS):
            return n
    return 0


def _strict_json(text: str) -> Any:
    """``json.loads`` of model output; NaN / Infinity (not JSON, and unencodable in an
    answer) and nesting too deep to parse are malformed like any other bad JSON."""
    return json.loads(text, parse_constant=_not_json)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _member_texts(body: str) -> dict[str, str]:
    """The text of each member value of the JSON object ``body`` (valid JSON text), exactly
    as written; the last of a repeated key wins, as in ``json.loads``."""
    decoder, at = json.JSONDecoder(), 1
    out: dict[str, str] = {}
    while True:
        at = _skip_space(body, at)
        if body[at] == "}":
            return out
        key, at = decoder.raw_decode(body, at)
        at = _skip_space(body, _skip_space(body, at) + 1)  # past the colon
        _, end = decoder.raw_decode(body, at)
        out[key], at = body[at:end], _skip_space(body, end)
        at += body[at] == ","


def _skip_space(text: str, at: int) -> int:
    while text[at] in " \t\n\r":
        at += 1
    return at


def parse_tool_call(body: str, index: int) -> ToolCallPart | None:
    """The tool call in ``body`` (the text between the markers), or None if malformed.

    ``arguments`` is the model's own text of the arguments object (inside a string, when the
    model wrote them as one), not a re-encoding: a client that sends the call back in the
    conversation then renders the tokens the model generated, and the next turn reuses them
    from the prefix cache (and it is what OpenAI's API returns: the arguments as the model
    wrote them)."""
    body = body.strip()
    try:
        value = _strict_json(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    args, text = value.get(key, {}), _member_texts(body).get(key, "{}")
    if isinstance(args, str):
        try:
            args, text = _strict_json(args), args.strip()
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:
        decoded = json.dumps(args, ensure_ascii=False)
    except RecursionError:
        return None
    if unicode_error(decoded) or unicode_error(value["name"]):  # a "\ud800" escape
        return None
    return ToolCallPart(index, f"call_{uuid.uuid4().hex[:24]}", value["name"], text)


class OutputSplitter:
    """Feed detokenized text; get :data:`Part`\\s in order. Call ``finish`` at the end.

    ``thinking`` starts the parser inside a reasoning block (a template that opened
    ``<think>`` in the prompt). Tool-call parsing is on only when the request offered tools.
    """

    def __init__(self, *, tools: bool, thinking: bool = False) -> None:
        self._tools = tools
        self._mode: Literal["text", "thinking", "tool"] = "thinking" if thinking else "text"
        self._buffer = ""
        self._tool_body: list[str] = []
        self._calls = 0
        self._after_tool = ""  # whitespace after a tool call, held until real text follows
        self._think_start = thinking  # newlines opening a thinking block are dropped
        self._think_newlines = ""  # newlines in a thinking block, held until more follows
        self._after_think = False  # newlines right after a thinking block are dropped
        self.tool_calls: list[ToolCallPart] = []

    def feed(self, text: str) -> list[Part]:
        """Parse more text; parts whose end is certain come back, a partial marker is held."""
        self._buffer += text
        parts: list[Part] = []
        while True:
            at, marker = self._next_marker()
            if marker is None:
                keep = _held_suffix(self._buffer)
                self._emit(self._buffer[:len(self._buffer) - keep], parts)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return parts
            self._emit(self._buffer[:at], parts)
            self._buffer = self._buffer[at + len(marker):]
            self._switch(marker, parts)

    def finish(self) -> list[Part]:
        """End of output: release held text; an unclosed tool call is returned as text."""
        parts: list[Part] = []
        self._emit(self._buffer, parts)
        self._buffer = ""
        if self._mode == "tool":
            self._mode = "text"
            self._text(TOOL_OPEN + "".join(self._tool_body), parts)
        return parts

    def _next_marker(self) -> tuple[int, str | None]:
        best, found = len(self._buffer), None
        for marker in self._active_markers():
            at = self._buffer.find(marker)
            if 0 <= at < best:
                best, found = at, marker
        return best, found

    def _active_markers(self) -> tuple[str, ...]:
        if self._mode == "tool":
            return (TOOL_CLOSE,)
        if self._mode == "thinking":
            return (THINK_CLOSE,)
        return (THINK_OPEN, TOOL_OPEN) if self._tools else (THINK_OPEN,)

    def _switch(self, marker: str, parts: list[Part]) -> None:
        if marker == THINK_OPEN:
            self._mode, self._think_start, self._think_newlines = "thinking", True, ""
        elif marker == THINK_CLOSE:
            self._mode, self._think_newlines, self._after_think = "text", "", True
        elif marker == TOOL_OPEN:
            self._mode, self._tool_body, self._after_tool = "tool", [], ""
        else:
            self._close_tool(parts)

    def _close_tool(self, parts: list[Part]) -> None:
        body = "".join(self._tool_body)
        self._mode = "text"
        call = parse_tool_call(body.strip(), self._calls)
        if call is None:
            self._text(TOOL_OPEN + body + TOOL_CLOSE, parts)
            return
        self._calls += 1
        self.tool_calls.append(call)
        parts.append(call)
        self._after_tool = "\0"  # marks "just after a call": whitespace is held from here

    def _emit(self, text: str, parts: list[Part]) -> None:
        if not text:
            return
        if self._mode == "tool":
            self._tool_body.append(text)
        elif self._mode == "thinking":
            self._thinking(text, parts)
        else:
            self._text(text, parts)

    def _thinking(self, text: str, parts: list[Part]) -> None:
        """Reasoning without the newlines that open and close its block (Qwen3's template
        writes ``<think>\n...\n</think>\n\n``; its model card strips them the same way)."""
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
        if self._after_tool:
            held = self._after_tool.lstrip("\0") + text
            if not held.strip():
                self._after_tool = "\0" + held
                return
            self._after_tool, text = "", held
        if parts and isinstance(parts[-1], TextPart) and parts[-1].kind == "text":
            parts[-1] = TextPart("text", parts[-1].text + text)
        else:
            parts.append(TextPart("text", text))
