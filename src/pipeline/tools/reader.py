"""What every format's reader shares: answer text, one call's life, ids, held markers.

Owns :class:`CallReader`, the base of the per-format readers (it satisfies
:class:`~pipeline.contracts.text.ToolCallReader` once a subclass supplies ``_read``), and
:func:`call_id`. A call opens (:meth:`CallReader._open`), takes its object's text
(:meth:`CallReader._call_text`: the name goes out as soon as it is known and the arguments
have begun, then argument fragments as they arrive), and closes
(:meth:`CallReader._close`): judged strictly; a call that is not well formed ends with an
error and its text is given back as answer text, so nothing the model wrote is lost.
Whitespace right after a call is layout: it is held until real text follows.

A call that repeats an earlier call of the output byte for byte (the same name, the same
arguments text) is dropped: a turn never holds the same call twice (an agent would run the
effect twice). While a call's name and arguments so far could still be such a repeat, its
pieces are held back; once it differs they go out, and a repeat that closes is never seen
(its index is the next call's). A tool-call grammar ends the output after such a repeat
(:attr:`~pipeline.grammar.Grammar.distinct_calls`); without a grammar the reader alone keeps
the calls distinct.
"""

from __future__ import annotations

import hashlib

from pipeline.contracts.output import OutputPiece, TextPiece, ToolCallDelta, ToolCallEnd
from pipeline.contracts.request import ToolCall
from pipeline.tools.scan import CallScanner, judge


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
        self._held: list[OutputPiece] | None = None  # the open call's pieces, held while
        # it could still repeat an earlier call
        self._closing_name: str | None = None  # the name of the call being closed

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
        self._held = [] if self._calls else None

    def _send(self, fragment: str) -> None:
        if fragment:
            self._args.append(fragment)
            self._emit(ToolCallDelta(self._index, fragment))

    def _emit(self, piece: OutputPiece) -> None:
        """Put out one of the open call's pieces, or hold it while the call may repeat an
        earlier one; the held pieces go out once it cannot."""
        if self._held is None:
            self._out.append(piece)
            return
        self._held.append(piece)
        name, args = self._name, "".join(self._args)
        if not any(c.name == name and c.arguments.startswith(args) for c in self._calls):
            self._out.extend(self._held)
            self._held = None

    @property
    def _name(self) -> str | None:
        """The open call's name, once known."""
        return self._scanner.name if self._scanner is not None else self._closing_name

    def _repeats(self, call: ToolCall) -> bool:
        """Whether ``call`` is an earlier call of the output again, byte for byte."""
        return any(c.name == call.name and c.arguments == call.arguments for c in self._calls)

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
        self._emit(ToolCallDelta(self._index, id=self.make_id(self._index), name=name))

    def _close(self, *, complete: bool, trailer: str = "") -> bool:
        """End the open call; ``trailer`` is its closing markup (given back if it fails).
        Whether it was a call (kept, or dropped as a repeat)."""
        scanner = self._scanner
        assert scanner is not None
        self._scanner = None
        body = "".join(scanner.text).strip()
        verdict = judge(body) if complete else "the call was cut off before it closed"
        index = self._index
        if isinstance(verdict, str):
            if self._announced and self._held is None:
                self._out.append(ToolCallEnd(index, None, verdict))
                self._index += 1
            self._held = None   # a held piece of a broken call: given back below as text
            self._after_call = False
            self._text("".join(self._markup) + trailer)
            return False
        self._closing_name = verdict[0]
        if not self._announced:
            self._announce(verdict[0])
        self._send(scanner.take())
        if not self._args:
            self._send("{}")  # a call written without arguments takes none
        self._closing_name = None
        call = ToolCall(name=verdict[0], arguments="".join(self._args), id=self.make_id(index))
        self._after_call, self._space = True, ""
        held, self._held = self._held, None
        if held is not None and self._repeats(call):
            return True   # the same call again: dropped, its index the next call's
        self._out.extend(held or ())
        self._calls.append(call)
        self._out.append(ToolCallEnd(index, call))
        self._index += 1
        return True
