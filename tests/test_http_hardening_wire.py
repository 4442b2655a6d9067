"""The wire below the app, over raw sockets to a real server on 127.0.0.1 (both of uvicorn's
HTTP implementations, the tiny model): a request head over ``max_header_bytes`` or
``max_headers`` is answered 431 and closed, exactly at the limit, and never hangs; a streamed
answer to an HTTP/1.0 request is not chunked but ends with the connection. Responses are read
with ``http.client``, the standard library's own HTTP parser."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.http_support import config, running
from transports.http import Gateway
from transports.http.server.limits import Limits
from transports.http.server.wire import head_size

LIMITS = Limits()
READ_S = 10.0  # a server that neither answers nor closes within this fails the test


@pytest.fixture(scope="module", params=["httptools", "h11"])
def address(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, int]]:
    gateway = Gateway(config(tmp_path_factory.mktemp("wire"), default_max_tokens=3))
    with running(gateway, http=request.param) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


def send(address: tuple[str, int], raw: bytes) -> socket.socket:
    """A connection that sends ``raw`` from a thread (the server may stop reading, or close,
    before it is all sent: that is no error here)."""
    sock = socket.create_connection(address, timeout=READ_S)

    def write() -> None:
        try:
            sock.sendall(raw)
        except OSError:
            pass

    threading.Thread(target=write, daemon=True).start()
    return sock


def response(sock: socket.socket, method: str = "GET") -> tuple[http.client.HTTPResponse, bytes]:
    """The next response on ``sock``, read by ``http.client``, and its body."""
    answer = http.client.HTTPResponse(sock, method=method)
    answer.begin()
    return answer, answer.read()


def closed(sock: socket.socket) -> bool:
    """The server ends the connection (end of stream or reset) within ``READ_S``."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True  # a socket timeout raises instead: the test fails


def head(fields: list[tuple[str, str]], target: str = "/v1/models") -> bytes:
    lines = [f"GET {target} HTTP/1.1", *(f"{n}: {v}" for n, v in fields)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def head_of(size: int) -> bytes:
    """A request head of exactly ``size`` bytes, padded by one header field."""
    base = head([("Host", "t"), ("X-Pad", "")])
    raw = head([("Host", "t"), ("X-Pad", "a" * (size - len(base)))])
    assert len(raw) == size
    return raw


def assert_431(answer: http.client.HTTPResponse, body: bytes, limit: str) -> dict[str, Any]:
    assert answer.status == 431, body
    assert answer.getheader("connection") == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "header_fields_too_large" and error["limit"] == limit
    assert error["maximum"] == getattr(LIMITS, limit)
    return error  # type: ignore[no-any-return]


# --- the head's bounds ------------------------------------------------------------------------

def test_a_head_of_exactly_the_byte_limit_is_served(address: tuple[str, int]) -> None:
    with send(address, head_of(LIMITS.max_header_bytes)) as sock:
        answer, _ = response(sock)
        assert answer.status == 200


def test_one_byte_over_the_byte_limit_is_431(address: tuple[str, int]) -> None:
    with send(address, head_of(LIMITS.max_header_bytes + 1)) as sock:
        error = assert_431(*response(sock), "max_header_bytes")
        assert error["value"] == LIMITS.max_header_bytes + 1
        assert closed(sock)


def test_a_megabyte_header_is_refused_while_it_arrives(address: tuple[str, int]) -> None:
    raw = head([("Host", "t"), ("X-Big", "a" * (1 << 20))])
    with send(address, raw) as sock:
        error = assert_431(*response(sock), "max_header_bytes")
        # refused after at most one more read past the limit, not after the whole megabyte
        assert LIMITS.max_header_bytes < error["value"] <= LIMITS.max_header_bytes + (256 << 10)
        assert closed(sock)


def test_a_head_that_never_ends_is_refused_too(address: tuple[str, int]) -> None:
    raw = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n" + b"X-Many: a\r\n" * 10_000
    with send(address, raw) as sock:  # no blank line: the head is never complete
        answer, body = response(sock)
        assert answer.status == 431
        assert closed(sock)


def test_exactly_the_header_count_is_served_and_one_more_is_431(
        address: tuple[str, int]) -> None:
    fields = [("Host", "t")] + [(f"X-{i}", "v") for i in range(LIMITS.max_headers - 1)]
    with send(address, head(fields)) as sock:
        answer, _ = response(sock)
        assert answer.status == 200
    with send(address, head([*fields, ("X-One-More", "v")])) as sock:
        error = assert_431(*response(sock), "max_headers")
        assert error["value"] == LIMITS.max_headers + 1
        assert closed(sock)


def test_ten_thousand_headers_are_refused(address: tuple[str, int]) -> None:
    fields = [("Host", "t")] + [(f"X-{i}", "v") for i in range(10_000)]
    with send(address, head(fields)) as sock:
        answer, body = response(sock)
        assert answer.status == 431
        assert closed(sock)


def test_a_refused_head_behind_a_request_ends_the_connection(address: tuple[str, int]) -> None:
    """Pipelined: the first answer, if it is written at all, is whole; then the 431 or just
    the close (a response already on the wire cannot be followed by another)."""
    big = head_of(LIMITS.max_header_bytes + 1)
    with send(address, head([("Host", "t")]) + big) as sock:
        statuses = []
        try:
            while len(statuses) < 2:
                statuses.append(response(sock)[0].status)
        except (http.client.RemoteDisconnected, ConnectionResetError):
            pass
        assert statuses in ([], [200], [200, 431])
        assert closed(sock)


def test_the_refusal_has_an_access_line(address: tuple[str, int],
                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, "pipeline.serve.access"):
        with send(address, head_of(LIMITS.max_header_bytes + 1)) as sock:
            response(sock)
            closed(sock)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.serve.access"]
    assert len(lines) == 1
    assert lines[0].startswith("- - 431 - error=header_fields_too_large reason=\"")
    assert "max_header_bytes" in lines[0] and "\n" not in lines[0]


@pytest.mark.parametrize(("buffer", "expected"), [
    (b"GET / HTTP/1.1\r\nHost: t\r\n\r\nBODY", (27, 1)),
    (b"GET / HTTP/1.1\nHost: t\nA: b\n\nBODY", (29, 2)),
    (b"GET / HTTP/1.1\r\nHost: t\r\nAcc", (28, 1)),
    (b"GET / HT", (8, 0)),
])
def test_head_size_reads_a_head_as_h11_does(buffer: bytes, expected: tuple[int, int]) -> None:
    assert head_size(buffer) == expected


# --- HTTP/1.0: no chunks, the close ends the answer -------------------------------------------

def post_10(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.0\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


STREAMS = {
    "openai": ("/v1/chat/completions",
               {"model": "default", "stream": True, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}, b"data: [DONE]\n\n"),
    "anthropic": ("/v1/messages",
                  {"model": "default", "stream": True, "max_tokens": 3,
                   "messages": [{"role": "user", "content": "hi"}]},
                  b'event: message_stop\ndata: {"type": "message_stop"}\n\n'),
}


@pytest.mark.parametrize("dialect", list(STREAMS))
def test_a_stream_to_an_http_10_client_is_delimited_by_the_close(
        address: tuple[str, int], dialect: str) -> None:
    path, body, last = STREAMS[dialect]
    with send(address, post_10(path, body)) as sock:
        answer, data = response(sock, "POST")
        assert answer.status == 200, data
        assert answer.getheader("transfer-encoding") is None and not answer.chunked
        assert answer.getheader("content-length") is None
        assert answer.getheader("connection") == "close"
        assert answer.getheader("content-type", "").startswith("text/event-stream")
        # the bytes are the events themselves: no chunk sizes between them
        assert data.startswith(b"event: " if dialect == "anthropic" else b"data: {")
        assert data.endswith(last)
        assert closed(sock)


def test_a_sized_answer_to_http_10_keeps_its_length(address: tuple[str, int]) -> None:
    with send(address, b"GET /v1/models HTTP/1.0\r\n\r\n") as sock:
        answer, data = response(sock)
        assert answer.status == 200 and not answer.chunked
        assert int(answer.getheader("content-length", "-1")) == len(data)
        assert json.loads(data)["data"][0]["id"] == "default"
        assert closed(sock)


def test_a_stream_to_http_11_is_still_chunked(address: tuple[str, int]) -> None:
    path, body, last = STREAMS["openai"]
    data = json.dumps(body).encode()
    raw = (f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with send(address, raw + data) as sock:
        answer, events = response(sock, "POST")
        assert answer.chunked and answer.getheader("transfer-encoding") == "chunked"
        assert events.endswith(last)
