"""Server-sent events framing: a pure encoder and an incremental decoder (WHATWG HTML §9.2).

Owns :class:`SSEEvent` and the two directions of the wire format, with no I/O: ``encode``
turns an event into bytes; :class:`SSEDecoder` takes bytes in chunks split anywhere (inside a
UTF-8 sequence, between ``\\r`` and ``\\n``) and returns the events completed so far. Both
dialects (OpenAI ``data:``-only chunks, Anthropic named events) go through this one module.

Example::

    wire = encode(SSEEvent(data='{"a": 1}', event="ping"))
    decoder = SSEDecoder()
    events = decoder.feed(wire[:5]) + decoder.feed(wire[5:])
    assert events == [SSEEvent(data='{"a": 1}', event="ping")]
"""

from __future__ import annotations

import codecs

import attrs

from pipeline.errors import InvalidValueError


@attrs.frozen
class SSEEvent:
    """One dispatched event: its ``data`` (lines joined by ``\\n``), ``event`` type and ``id``."""

    data: str
    event: str | None = None
    id: str | None = None


def _check_line(field: str, value: str) -> None:
    if "\n" in value or "\r" in value:
        raise InvalidValueError(field, value, "an SSE field value may not contain a line break")


def encode(event: SSEEvent) -> bytes:
    """The wire bytes of ``event``: ``event:``/``id:`` lines, one ``data:`` line per data line,
    and the blank line that dispatches it."""
    out: list[str] = []
    if event.event is not None:
        _check_line("event", event.event)
        out.append(f"event: {event.event}\n")
    if event.id is not None:
        _check_line("id", event.id)
        out.append(f"id: {event.id}\n")
    for line in event.data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        out.append(f"data: {line}\n")
    out.append("\n")
    return "".join(out).encode("utf-8")


def encode_comment(text: str = "") -> bytes:
    """A comment line (ignored by clients; keeps idle connections alive)."""
    _check_line("comment", text)
    return f": {text}\n\n".encode()


class SSEDecoder:
    """Incremental SSE parser. ``feed`` bytes as they arrive; ``close`` at end of stream.

    Follows the standard's rules: lines end in ``\\r\\n``, ``\\n`` or ``\\r``; a leading BOM is
    dropped; ``:`` starts a comment; one space after the colon is stripped; an event is
    dispatched at a blank line when it has data; an unterminated event at end of stream is
    discarded.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._pending_cr = False
        self._started = False
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse ``chunk``; return the events it completed, in order."""
        text = self._utf8.decode(chunk)
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        return self._lines(text)

    def close(self) -> list[SSEEvent]:
        """End of stream: flush the decoder; a partial event is dropped, as the standard says."""
        return self._lines(self._utf8.decode(b"", final=True))

    def _lines(self, text: str) -> list[SSEEvent]:
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]  # the \n of a \r\n split across chunks
        self._pending_cr = False
        self._buffer += text
        events: list[SSEEvent] = []
        start = 0
        buf = self._buffer
        n = len(buf)
        i = 0
        while i < n:
            ch = buf[i]
            if ch == "\n" or ch == "\r":
                event = self._line(buf[start:i])
                if event is not None:
                    events.append(event)
                if ch == "\r":
                    if i + 1 < n and buf[i + 1] == "\n":
                        i += 1
                    elif i + 1 == n:
                        self._pending_cr = True
                start = i + 1
            i += 1
        self._buffer = buf[start:]
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event, id_ = self._data, self._event, self._id
        self._data, self._event, self._id = [], None, None
        if not data:
            return None
        return SSEEvent("\n".join(data), event or None, id_ if id_ is not None else None)
