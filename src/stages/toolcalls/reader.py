"""What every format's reader shares: answer text, one call's life, ids, held markers.

Owns :class:`CallReader`, the base of the per-format readers (it satisfies
:class:`~pipeline.protocols.ToolCallReader` once a subclass supplies ``_read``), and
:func:`held_suffix`. A call opens (:meth:`CallReader._open`), takes its object's text
(:meth:`CallReader._call_text`: the name goes out as soon as it is known and the arguments
have begun, then argument fragments as they arrive), and closes
(:meth:`CallReader._close`): judged strictly; a call that is not well formed ends with an
error and its text is given back as answer text, so nothing the model wrote is lost.
Whitespace right after a call is layout: it is held until real text follows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pipeline.types import OutputPiece, TextPiece, ToolCall, ToolCallDelta, ToolCallEnd
from stages.toolcalls.scan import CallScanner, judge


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


def call_id(request_id: str, index: int) -> str:
    """The OpenAI-style id of call ``index`` of a request (stable across replays)."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


class CallReader:
    """Base reader: subclasses implement ``_read(text, final)`` over ``self._buffer``."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self._buffer = ""
        self._out: list[OutputPiece] = []
        self._calls: list[ToolCall] = []
        self._index = 0  # calls opened so far
        self._scanner: CallScanner | None = None
        self._markup: list[str] = []  # the open call's text as written, for giving it back
        self._announced = False
        self._args: list[str] = []  # the open call's argument fragments sent so far
        self._after_call = False  # just after a call: whitespace is held
        self._space = ""

    # --- the ToolCallReader face -------------------------------------------------------------

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The finished, well-formed calls, in order."""
        return tuple(self._calls)

    def feed(self, text: str) -> list[OutputPiece]:
        """Read more text; the pieces it made certain."""
        self._buffer += text
        self._read(final=False)
        return self._take()

    def finish(self) -> list[OutputPiece]:
        """End of output: release what is held."""
        self._read(final=True)
        if self._scanner is not None:
            self._close(complete=self._scanner.done)
        return self._take()

    def _read(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[OutputPiece]:
        out, self._out = self._out, []
        return out

    def make_id(self, index: int) -> str:
        """The id of call ``index``."""
        return call_id(self._request_id, index)

    # --- text ---------------------------------------------------------------------------------

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            held = self._space + text
            if not held.strip():
                self._space = held
                return
            self._after_call, self._space, text = False, "", held
        if self._out and isinstance(self._out[-1], TextPiece):
            self._out[-1] = TextPiece(self._out[-1].text + text)
        else:
            self._out.append(TextPiece(text))

    # --- one call -----------------------------------------------------------------------------

    def _open(self, markup: str) -> None:
        self._scanner, self._markup, self._announced = CallScanner(), [markup], False
        self._args = []

    def _send(self, fragment: str) -> None:
        if fragment:
            self._args.append(fragment)
            self._out.append(ToolCallDelta(self._index, fragment))

    def _call_text(self, text: str) -> str:
        """Give the open call more of its text; returns what follows its object's end."""
        scanner = self._scanner
        assert scanner is not None
        rest = scanner.feed(text)
        self._markup.append(text[:len(text) - len(rest)])
        if not self._announced and scanner.name is not None and (
                scanner.args_started or scanner.done):
            self._announce(scanner.name)
        if self._announced:
            self._send(scanner.take())
        return rest

    def _announce(self, name: str) -> None:
        self._announced = True
        self._out.append(ToolCallDelta(self._index, id=self.make_id(self._index), name=name))

    def _close(self, *, complete: bool, trailer: str = "") -> None:
        """End the open call; ``trailer`` is its closing markup (given back if it fails)."""
        scanner = self._scanner
        assert scanner is not None
        self._scanner = None
        body = "".join(scanner.text).strip()
        verdict = judge(body) if complete else "the call was cut off before it closed"
        index = self._index
        if isinstance(verdict, str):
            if self._announced:
                self._out.append(ToolCallEnd(index, None, verdict))
                self._index += 1
            self._after_call = False
            self._text("".join(self._markup) + trailer)
            return
        if not self._announced:
            self._announce(verdict[0])
        self._send(scanner.take())
        if not self._args:
            self._send("{}")  # a call written without arguments takes none
        call = ToolCall(name=verdict[0], arguments="".join(self._args), id=self.make_id(index))
        self._calls.append(call)
        self._out.append(ToolCallEnd(index, call))
        self._index += 1
        self._after_call, self._space = True, ""
