"""Deadlines for reading each request: its headers within ``header_s``, its body within ``body_s``.

uvicorn bounds only the idle time between keep-alive requests (``timeout_keep_alive``). Without
these deadlines a client that sends half a request line, or a ``Content-Length`` and then half
the body, holds its connection (and, once its headers are in, an ASGI task) for ever: a
slowloris. Each connection has its own timer on the event loop, so a stalled client costs the
others nothing.

Owns :class:`Timeouts` (the two limits, validated), :func:`protocol_class` (uvicorn's httptools
or h11 protocol with the deadlines enforced, over :mod:`transports.http.server.wire`'s head limits and
HTTP/1.0 framing) and :func:`uvicorn_config`, the one uvicorn configuration that ``serve()``
and the tests both run.

The clocks:

- headers: from the connection's opening (for its first request) or from the first byte after
  a response (for a later one; the wait before that byte is uvicorn's keep-alive idleness) until
  the headers are complete. On expiry the client gets ``408 Request Timeout`` (a JSON error,
  ``Connection: close``) and the connection is closed.
- body: from the end of the headers to the end of the body (``Content-Length`` reached or the
  last chunk), however the bytes trickle in. On expiry the app sees ``http.disconnect``; if it
  has sent nothing yet the client gets a 408; the connection is closed.
- A timer that expires while the server itself has stopped reading (a pipelined request waiting
  for the response before it, or body bytes the app has not taken yet) starts again: that wait
  is the server's, not the client's.
- Where a 408 cannot be written (another response is already on the wire), the connection is
  just closed.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Protocol, cast

import attrs
import h11
import uvicorn
from starlette.types import ASGIApp
from uvicorn.config import LOGGING_CONFIG
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeline.errors import InvalidValueError
from transports.http.server.errors import Dialect, ErrorInfo, error_body
from transports.http.server.limits import Limits
from transports.http.server.wire import WireH11Protocol, WireHttpToolsProtocol

Phase = Literal["headers", "body"]
HTTPImpl = Literal["httptools", "h11"]


def _seconds(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise InvalidValueError(attribute.name, value, "must be a finite number of seconds > 0")


@attrs.frozen
class Timeouts:
    """How long a client may take to send a request's headers (``header_s``) and then its body
    (``body_s``, the whole body, not the gap between its bytes)."""

    header_s: float = attrs.field(default=10.0, validator=_seconds)
    body_s: float = attrs.field(default=30.0, validator=_seconds)


class _Cycle(Protocol):
    """What both uvicorn request cycles (httptools and h11) share and the deadlines use."""

    response_started: bool
    response_complete: bool
    disconnected: bool
    message_event: asyncio.Event


def _timeout_response(phase: Phase, limit_s: float,
                      default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The 408, written straight to the transport: no request cycle exists to send it through
    when the headers never arrived. OpenAI's error shape: the dialect is not known yet."""
    info = ErrorInfo(408, "invalid_request_error", "invalid_request_error",
                     f"request {phase} not received within {limit_s:g} s", code="request_timeout")
    body = json.dumps(error_body(info, Dialect.OPENAI)).encode()
    head = [b"HTTP/1.1 408 Request Timeout\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


def _abandon(transport: asyncio.Transport, cycle: _Cycle | None, response: bytes | None) -> None:
    """Drop the connection: a running app sees ``http.disconnect`` now and its later writes are
    dropped (they must not follow ``response`` on the wire); the client gets ``response`` if
    any; the transport closes (``connection_lost`` then cleans up as for any disconnect)."""
    if cycle is not None and not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()
    if response is not None:
        transport.write(response)
    transport.close()


class _ReadDeadline:
    """A connection's one pending read deadline: a request is reading its headers or its body,
    never both, and pipelined requests are parsed one after the other."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeouts: Timeouts, flow: FlowControl,
                 expired: Callable[[Phase], None]) -> None:
        self._loop = loop
        self._timeouts = timeouts
        self._flow = flow
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None
        self.phase: Phase | None = None

    def start(self, phase: Phase) -> None:
        """A fresh clock for ``phase``; any earlier one is dropped."""
        self.stop()
        self.phase = phase
        self._timer = self._loop.call_later(self.limit_s(phase), self._fire)

    def limit_s(self, phase: Phase) -> float:
        return self._timeouts.header_s if phase == "headers" else self._timeouts.body_s

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self.phase = None, None

    def _fire(self) -> None:
        phase = self.phase
        assert phase is not None
        if self._flow.read_paused:
            # uvicorn paused reading (a pipelined request waits its turn, or the app has not
            # taken the body so far): the client cannot send, so it is not the one stalling
            self.start(phase)
            return
        self._timer, self.phase = None, None
        self._expired(phase)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`Timeouts` on every request's headers and body.
    httptools reports each request's start, end of headers and end of message; the clocks follow
    those callbacks."""

    timeouts: ClassVar[Timeouts] = Timeouts()
    _deadline: _ReadDeadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = _ReadDeadline(self.loop, self.timeouts, self.flow, self._timed_out)
        # a connection that never sends its first byte is a stalled request too
        self._deadline.start("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.stop()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # keep-alive armed = idle between requests; uvicorn cancels it on any byte, and bytes
        # that begin no message (blank lines) would otherwise leave no clock running at all
        if self.timeout_keep_alive_task is not None and self._deadline.phase is None:
            self._deadline.start("headers")
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline.phase is None:  # else this request's clock already runs
            self._deadline.start("headers")

    def on_headers_complete(self) -> None:
        before = self.cycle
        self._deadline.stop()
        super().on_headers_complete()
        if self.cycle is not before:  # no new cycle: a websocket upgrade, no longer ours
            self._deadline.start("body")

    def on_message_complete(self) -> None:
        # before uvicorn's early return for a request whose response is already complete
        self._deadline.stop()
        super().on_message_complete()

    def _timed_out(self, phase: Phase) -> None:
        if self.transport.is_closing():
            return
        cycle: _Cycle | None = self.cycle
        if phase == "headers":
            # this request has no cycle yet; self.cycle is the one before it
            on_wire = cycle is not None and not cycle.response_complete
        else:
            # queued in the pipeline: an earlier request's response is being written
            on_wire = bool(self.pipeline) or self.cycle.response_started
        response = None if on_wire else _timeout_response(
            phase, self._deadline.limit_s(phase), self.server_state.default_headers)
        _abandon(self.transport, cycle, response)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`Timeouts` on every request's headers and body. h11
    has no parser callbacks; the clocks follow the state of the client's side after each read."""

    timeouts: ClassVar[Timeouts] = Timeouts()
    _deadline: _ReadDeadline

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = _ReadDeadline(self.loop, self.timeouts, self.flow, self._timed_out)
        self._deadline.start("headers")  # as for httptools: silence is a stalled request

    def connection_lost(self, exc: Exception | None) -> None:
        self._deadline.stop()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_client()

    def on_response_complete(self) -> None:
        # uvicorn starts the next cycle here and parses any pipelined bytes it buffered
        super().on_response_complete()
        self._follow_client()

    def _follow_client(self) -> None:
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._deadline.phase != "body":
                self._deadline.start("body")
        elif state is h11.IDLE:
            # bytes of a request whose headers are not complete; IDLE with nothing buffered
            # between requests is keep-alive idleness (the first request's clock runs anyway)
            if self._deadline.phase is None and self.conn.trailing_data[0]:
                self._deadline.start("headers")
        else:
            self._deadline.stop()  # the request is in (DONE) or the connection is ending

    def _timed_out(self, phase: Phase) -> None:
        if self.transport.is_closing():
            return
        # headers: the client is IDLE, so no response is on the wire; body: this request's
        cycle: _Cycle | None = self.cycle if phase == "body" else None
        on_wire = cycle is not None and cycle.response_started
        response = None if on_wire else _timeout_response(
            phase, self._deadline.limit_s(phase), self.server_state.default_headers)
        _abandon(self.transport, cycle, response)


def protocol_class(timeouts: Timeouts, http: HTTPImpl = "httptools",
                   limits: Limits = Limits()) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class (for ``uvicorn.Config(http=...)``) enforcing ``timeouts``,
    and the head limits and HTTP/1.0 framing of :mod:`transports.http.server.wire` with ``limits``;
    uvicorn builds one per connection with its own arguments, so the limits ride on the class."""
    base = TimedHttpToolsProtocol if http == "httptools" else TimedH11Protocol
    wire = WireHttpToolsProtocol if http == "httptools" else WireH11Protocol
    return cast("type[asyncio.Protocol]",
                type(base.__name__, (base, wire), {"timeouts": timeouts, "limits": limits}))


def uvicorn_config(app: ASGIApp, host: str, port: int, log_level: str = "warning",
                   timeouts: Timeouts = Timeouts(), http: HTTPImpl = "httptools",
                   log_config: dict[str, Any] | None = LOGGING_CONFIG,
                   limits: Limits = Limits()) -> uvicorn.Config:
    """The uvicorn configuration the server runs (and the tests, identically): lifespan on,
    five seconds of graceful shutdown, ``timeouts`` on every request, and ``limits``' bounds
    on every request's head (:mod:`transports.http.server.wire`; h11's own bound on an incomplete
    event is the same). uvicorn's access log is off: the app writes its own
    (:class:`transports.http.accounting.logs.AccessLog`). ``log_config`` is uvicorn's logging setup
    (``None``: leave logging to the application)."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                          timeout_graceful_shutdown=5,
                          http=protocol_class(timeouts, http, limits),
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          access_log=False, log_config=log_config)
