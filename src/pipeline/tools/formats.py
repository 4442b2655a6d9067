"""The tool-call formats of the model families, each a parser and its reader, and which one a
model gets.

Owns :class:`HermesParser` (Hermes / Qwen: ``<tool_call>{"name", "arguments"}</tool_call>``,
any number, anywhere in the answer), :class:`Llama3Parser` (Llama 3.x: the answer *is* the
call, ``{"name", "parameters"}``, optionally after ``<|python_tag|>``, several joined by
``;``) and :class:`MistralParser` (``[TOOL_CALLS][{"name", "arguments"}, ...]``), registered
by name as :data:`PARSERS`. Each ``recognizes`` its format in a chat template's rendering of a
call, and carries the format's grammars as ``calls`` (:mod:`pipeline.tools.grammars`), which
force and limit calls in it.

:func:`choose_parser` picks a model's parser: a named one comes from the registry (kind
``tool_parser``); with none named, the template renders a probe conversation in which the
assistant calls a tool (:func:`pipeline.tools.fallback.probe_rendering`), and the first
registered parser that recognizes that rendering wins (Hermes when the template cannot render
a call, the most common format and the tiny model's).
"""

from __future__ import annotations

import hashlib
import re
from typing import cast

from pipeline.output_parts import THINK_CLOSE, THINK_OPEN, held_suffix
from pipeline.contracts.text import Renderer, ToolCallParser
from pipeline.registry import BuildContext, Registry
from pipeline.tools.fallback import probe_rendering
from pipeline.tools.grammars import (
    MISTRAL_CALLS, TOOL_CLOSE, TOOL_OPEN, HermesCalls, Llama3Calls, MistralCalls,
)
from pipeline.tools.reader import CallReader

PYTHON_TAG = "<|python_tag|>"
LLAMA_CALL = re.compile(r'\{"name": *"[^"]*", *"parameters": *[{"]')
FALLBACK = "hermes"


class HermesReader(CallReader):
    """``<tool_call>`` … ``</tool_call>`` blocks among answer text. Reasoning
    (``<think>`` … ``</think>``, which Qwen3 writes first) is text: a call it mentions is not
    made. A ``</tool_call>`` inside one of the call's JSON strings is that string's content."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self._thinking = False

    def _markers(self) -> tuple[str, ...]:
        if self._scanner is not None:
            return (TOOL_CLOSE,)
        return (THINK_CLOSE,) if self._thinking else (TOOL_OPEN, THINK_OPEN)

    def _read(self, final: bool) -> None:
        while True:
            markers = self._markers()
            found = [(at, m) for m in markers if (at := self._buffer.find(m)) >= 0]
            if not found:
                keep = 0 if final else held_suffix(self._buffer, markers)
                self._take_text(self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return
            at, marker = min(found)
            if marker in (THINK_OPEN, THINK_CLOSE):  # reasoning markers stay in the text
                self._take_text(self._buffer[:at + len(marker)])
                self._thinking = marker == THINK_OPEN
            else:
                self._take_text(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            if marker == TOOL_CLOSE and self._scanner is not None and self._scanner.in_string:
                self._take_text(marker)   # inside one of the call's strings: its content
                continue
            if marker == TOOL_OPEN:
                self._open(TOOL_OPEN)
            elif marker == TOOL_CLOSE:
                self._close(complete=self._scanner_done(), trailer=TOOL_CLOSE)

    def _scanner_done(self) -> bool:
        return self._scanner is not None and self._scanner.done and not self._scanner.broken

    def _take_text(self, text: str) -> None:
        if self._scanner is None:
            self._text(text)
            return
        rest = self._call_text(text)  # after the object, up to the marker: kept as written
        if rest:
            self._markup.append(rest)
            if rest.strip():
                self._scanner.spoil()  # text after the object: the body is no call


class HermesParser:
    """Hermes / Qwen tool calls (the format of Qwen2.5, Qwen3, Hermes and the tiny model)."""

    name = "hermes"
    summary = "Hermes / Qwen <tool_call>{json}</tool_call> calls"
    calls = HermesCalls()
    """The format's grammars (forced and optional calls)."""

    def recognizes(self, rendered_call: str) -> bool:
        """The rendering wraps the call in ``<tool_call>`` tags."""
        return TOOL_OPEN in rendered_call and TOOL_CLOSE in rendered_call

    def start(self, request_id: str) -> HermesReader:
        """A reader for one request."""
        return HermesReader(request_id)


class _ObjectsReader(CallReader):
    """A reader whose calls are bare JSON objects in a small grammar of separators; the
    subclass steps through modes, each returning whether it made progress."""

    def __init__(self, request_id: str, mode: str) -> None:
        super().__init__(request_id)
        self._mode = mode
        self._lead = ""  # markup before the next object (given back if it is no call)

    def _read(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _in_call(self) -> bool:
        """Feed the open call; on its end go to ``between`` (a call) or ``text`` (none)."""
        scanner = self._scanner
        if scanner is None or not self._buffer:
            return False
        self._buffer = self._call_text(self._buffer)
        if not (scanner.done or scanner.broken):
            return False
        self._mode = "between" if self._close(complete=scanner.done) else "text"
        return True

    def _start_object(self, stripped: str) -> None:
        self._open(self._lead + self._buffer[:len(self._buffer) - len(stripped)])
        self._lead, self._buffer, self._mode = "", stripped, "call"

    def _give_up(self) -> bool:
        """The text is not (or no longer) calls: the rest is answer text."""
        self._mode, self._buffer, self._lead = "text", self._lead + self._buffer, ""
        return True

    def _all_text(self) -> bool:
        self._text(self._buffer)
        self._buffer = ""
        return False


class Llama3Reader(_ObjectsReader):
    """An answer that is one or more ``{"name", "parameters"}`` objects, or plain text.

    The first non-space character decides: ``{`` (or ``<|python_tag|>``) starts a candidate
    call, held back until its name and arguments show it is one; anything else is text to
    the end. After a call, ``;`` may start another; other text is answer text."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id, "start")

    def _step(self, final: bool) -> bool:
        if self._mode == "call":
            return self._in_call()
        if self._mode == "text":
            return self._all_text()
        stripped = self._buffer.lstrip()
        if self._mode == "between":
            if stripped.startswith(";"):
                self._buffer, self._mode = stripped[1:], "start"
                return True
            return bool(stripped) and self._give_up()
        if not stripped or (PYTHON_TAG.startswith(stripped) and not final):
            return final and bool(self._buffer or self._lead) and self._give_up()
        if stripped.startswith(PYTHON_TAG):
            self._lead += self._buffer[:len(self._buffer) - len(stripped)] + PYTHON_TAG
            self._buffer = stripped[len(PYTHON_TAG):]
            return True
        if stripped.startswith("{"):
            self._start_object(stripped)
            return True
        return self._give_up()


class Llama3Parser:
    """Llama 3.x JSON tool calls (the built-in ``<|python_tag|>`` prefix is accepted)."""

    name = "llama3_json"
    summary = "Llama 3.x JSON calls ({name, parameters}; <|python_tag|>)"
    calls = Llama3Calls()
    """The format's grammars (forced and optional calls)."""

    def recognizes(self, rendered_call: str) -> bool:
        """The rendering writes the call as a bare ``{"name", "parameters"}`` object (a tool's
        definition has a description between the two, so it does not count)."""
        return TOOL_OPEN not in rendered_call and LLAMA_CALL.search(rendered_call) is not None

    def start(self, request_id: str) -> Llama3Reader:
        """A reader for one request."""
        return Llama3Reader(request_id)


class MistralReader(_ObjectsReader):
    """Answer text, then ``[TOOL_CALLS]`` and a JSON array of call objects."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id, "text")

    def make_id(self, index: int) -> str:
        """Mistral's templates require ids of nine letters and digits."""
        return hashlib.sha256(f"{self._request_id}:{index}".encode()).hexdigest()[:9]

    def _step(self, final: bool) -> bool:
        if self._mode == "call":
            return self._in_call()
        if self._mode == "text":
            return self._plain(final)
        stripped = self._buffer.lstrip()
        if not stripped:
            return final and bool(self._buffer or self._lead) and self._give_up()
        space = self._buffer[:len(self._buffer) - len(stripped)]
        if self._mode == "open":  # after the marker: the array opens
            if not stripped.startswith("["):
                return self._give_up()
            self._lead += space + "["
            self._buffer, self._mode = stripped[1:], "object"
            return True
        if self._mode == "object" and stripped.startswith("{"):
            self._start_object(stripped)
            return True
        if self._mode == "between" and stripped.startswith(","):
            self._lead, self._buffer, self._mode = space + ",", stripped[1:], "object"
            return True
        if stripped.startswith("]"):
            self._lead, self._buffer, self._mode = "", stripped[1:], "text"
            return True
        return self._give_up()

    def _plain(self, final: bool) -> bool:
        at = self._buffer.find(MISTRAL_CALLS)
        if at < 0:
            keep = 0 if final else held_suffix(self._buffer, (MISTRAL_CALLS,))
            self._text(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        self._text(self._buffer[:at])
        self._lead, self._buffer, self._mode = MISTRAL_CALLS, self._buffer[at + len(
            MISTRAL_CALLS):], "open"
        return True


class MistralParser:
    """Mistral tool calls: ``[TOOL_CALLS]`` and a JSON array of calls."""

    name = "mistral"
    summary = "Mistral [TOOL_CALLS][{...}] calls"
    calls = MistralCalls()
    """The format's grammars (forced and optional calls)."""

    def recognizes(self, rendered_call: str) -> bool:
        """The rendering writes ``[TOOL_CALLS]``."""
        return MISTRAL_CALLS in rendered_call

    def start(self, request_id: str) -> MistralReader:
        """A reader for one request."""
        return MistralReader(request_id)


PARSERS = {p.name: p for p in (HermesParser, Llama3Parser, MistralParser)}
"""The built-in parsers by registered name, in the order ``choose_parser`` asks them."""


def choose_parser(registry: Registry, context: BuildContext,
                  value: str | ToolCallParser | None,
                  renderer: Renderer | None) -> ToolCallParser | None:
    """The parser ``value`` names (or is); for None, the one the renderer's template writes."""
    if value is not None and not isinstance(value, str):
        return value
    if isinstance(value, str):
        return cast(ToolCallParser, registry.create("tool_parser", value, context))
    if renderer is None:
        return None
    rendered = probe_rendering(renderer)
    names = registry.names("tool_parser")
    for name in names:
        parser = cast(ToolCallParser, registry.create("tool_parser", name, context))
        if rendered and parser.recognizes(rendered):
            return parser
    return (cast(ToolCallParser, registry.create("tool_parser", FALLBACK, context))
            if FALLBACK in names else None)
