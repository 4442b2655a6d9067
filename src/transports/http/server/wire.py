"""What the server enforces on the wire, below the app: a bound on each request's head while it
arrives, and HTTP/1.0 framing of an answer of unknown length.

Owns :class:`WireHttpToolsProtocol` and :class:`WireH11Protocol`, uvicorn's two HTTP protocols
with these rules (:func:`transports.http.server.timeouts.protocol_class` mixes them with the read
deadlines: every server, and the tests, run both), :class:`CloseDelimitedCycle`,
:func:`head_size` (the bytes and header fields of a head as h11 reads it), :func:`over_limits`
(the 431 for a head, if any) and :func:`error_response` (an error written straight to the
socket).

The head (settings of :class:`~transports.http.server.limits.Limits`):

- ``max_header_bytes`` bounds the request line and header fields together, ``max_headers``
  the number of header fields. Over either, the client gets ``431 Request Header Fields Too
  Large`` (a JSON error in OpenAI's shape, as the 408 of a read deadline: no route is chosen
  yet; code ``header_fields_too_large`` with ``limit``, ``value`` and ``maximum``), with
  ``Connection: close``, and the connection is closed; the app never sees the request, and the
  access log has a line for it. Where another response is already on the wire (the refused
  request was pipelined behind it), the connection is just closed.
- The bytes are counted as they arrive, so a refused head never grows far past the limit.
  Over httptools, the protocol is handed the request target in pieces and each header field
  once complete, and counts every read that leaves a head unfinished whole (the parser holds
  a field in progress itself, so at most one more read, 256 KiB, is held before the refusal).
  h11 holds the head in its own buffer, measured before each parse; its own limit on an
  incomplete event is set to ``max_header_bytes`` too (by ``uvicorn_config``).

HTTP/1.0: RFC 9112 forbids the chunked transfer coding towards an HTTP/1.0 client (§7.1); a
response without a length is then delimited by the close of the connection (§6.3). An answer
whose length the app does not give (a stream) is written as it comes, without
``Transfer-Encoding``, with ``Connection: close``, and the connection closes after its last
byte. h11 frames it so itself; uvicorn's httptools cycle would chunk it, so an HTTP/1.0
request's cycle is uvicorn's with that one rule changed (:class:`CloseDelimitedCycle`).
"""

from __future__ import annotations

import asyncio
import http
import json
import re
from collections.abc import Iterable
from typing import ClassVar

import h11
from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from transports.http.accounting import logs
from transports.http.server.errors import Dialect, ErrorInfo, error_body, head_too_large
from transports.http.server.limits import Limits

Headers = Iterable[tuple[bytes, bytes]]
# the end of a head as h11 finds it: a blank line, each line ending in LF or CRLF
_BLANK_LINE = re.compile(rb"\n\r?\n")


def head_size(buffer: bytes) -> tuple[int, int]:
    """``(bytes, header fields)`` of the head at the start of ``buffer``: up to and with its
    blank line, or all of ``buffer`` while that has not arrived (its complete lines counted)."""
    end = _BLANK_LINE.search(buffer)
    head = buffer if end is None else buffer[:end.end()]
    lines = head.count(b"\n")  # the request line's, each field's, and the blank line's
    return len(head), max(0, lines - 1 - (end is not None))


def over_limits(limits: Limits, size: int, fields: int) -> ErrorInfo | None:
    """The 431 for a head of ``size`` bytes and ``fields`` header fields, or None."""
    if size > limits.max_header_bytes:
        return head_too_large("max_header_bytes", size, limits.max_header_bytes,
                              "bytes of request line and header fields")
    if fields > limits.max_headers:
        return head_too_large("max_headers", fields, limits.max_headers, "header fields")
    return None


def error_response(info: ErrorInfo, default_headers: Headers) -> bytes:
    """``info`` as a whole response written straight to the transport (no request cycle
    exists to send it through), closing the connection."""
    body = json.dumps(error_body(info, Dialect.OPENAI)).encode()
    phrase = http.HTTPStatus(info.status).phrase.encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (info.status, phrase)]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


def _refuse(transport: asyncio.Transport, info: ErrorInfo, default_headers: Headers,
            on_wire: RequestResponseCycle | None, client: tuple[str, int] | None) -> None:
    """Answer ``info`` and close; with a response ``on_wire``, close only (its app sees a
    disconnect)."""
    if transport.is_closing():
        return
    if on_wire is not None:
        on_wire.disconnected = True
        on_wire.message_event.set()
    else:
        transport.write(error_response(info, default_headers))
    transport.close()
    logs.refused(info.status, info.code or info.openai_type, info.message, client)


def _sized(status: int, method: str, headers: Headers) -> bool:
    """Whether a response's length is known without chunks: a ``Content-Length``, or no
    body at all (HEAD, 1xx, 204, 304)."""
    if method == "HEAD" or status < 200 or status in (204, 304):
        return True
    return any(name.lower() == b"content-length" for name, _ in headers)


class CloseDelimitedCycle(RequestResponseCycle):
    """uvicorn's httptools request cycle, for an HTTP/1.0 request: an answer without a length
    goes out as it comes, without ``Transfer-Encoding``, and the connection's close ends it
    (uvicorn already closes an HTTP/1.0 connection after its answer and says so)."""

    by_close: bool = False

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            headers = [(n, v) for n, v in message.get("headers", ())
                       if n.lower() != b"transfer-encoding"]
            if not _sized(message["status"], self.scope["method"],
                          [*self.default_headers, *headers]):
                self.by_close = True
                self.chunked_encoding = False  # uvicorn adds no Transfer-Encoding then
                self.keep_alive = False  # Connection: close, and a close after the last byte
                message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and self.by_close:
            # uvicorn checks each write against the length it was given: this write's own
            self.expected_content_length = len(message.get("body", b""))
        await super().send(message)


class WireHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head limits and HTTP/1.0 framing. A read that
    starts inside a head and ends neither it nor a message is that head's, every byte; the
    target and fields as parsed (plus the request line's and blank line's bytes) count the
    rest, exactly for a head written with one space after each colon."""

    limits: ClassVar[Limits] = Limits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True  # between a message's end (or the start) and its headers' end
        self._crossed = False  # this read ended a head or a message
        self._refused = False
        self._read_bytes = self._parsed_bytes = self._fields = 0

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        whole, self._crossed = self._in_head, False
        super().data_received(data)
        if whole and not self._crossed:
            self._read_bytes += len(data)
            self._check()

    def _check(self) -> None:
        size = max(self._read_bytes, self._parsed_bytes)
        info = over_limits(self.limits, size, self._fields)
        if info is not None and not self._refused:
            self._refused = True
            cycle = self.cycle  # the request before this one
            on_wire = cycle if cycle is not None and not cycle.response_complete else None
            _refuse(self.transport, info, self.server_state.default_headers, on_wire,
                    self.client)

    def on_message_begin(self) -> None:
        if self._refused:
            return
        self._in_head = True
        self._read_bytes = self._parsed_bytes = self._fields = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            self._parsed_bytes += len(url)
            self._check()
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._refused:
            self._fields += 1
            self._parsed_bytes += len(name) + len(value) + 4  # ": " and CRLF
            self._check()
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        # the request line's method, spaces, version and CRLF, and the blank line
        self._parsed_bytes += len(self.parser.get_method()) + len(" HTTP/1.1\r\n") + 3
        self._check()
        if self._refused:
            return
        self._in_head, self._crossed = False, True
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before and self.scope.get("http_version") == "1.0":
            self.cycle.__class__ = CloseDelimitedCycle

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._in_head, self._crossed = True, True
        super().on_message_complete()


class WireH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head limits: the head in h11's buffer is measured
    before each parse of a new request (h11 frames HTTP/1.0 answers itself)."""

    limits: ClassVar[Limits] = Limits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._refused = False

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def handle_events(self) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:  # a head, no response on the wire
            info = over_limits(self.limits, *head_size(self.conn.trailing_data[0]))
            if info is not None:
                self._refused = True
                _refuse(self.transport, info, self.server_state.default_headers, None,
                        self.client)
                return
        super().handle_events()
