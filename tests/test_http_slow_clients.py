"""Slow and stalled clients over real sockets on 127.0.0.1: a request whose headers or body stop
arriving is answered 408 and closed within its deadline, while other clients are served as
usual; slow clients inside the limits, keep-alive and pipelined requests still work. Both of
uvicorn's HTTP implementations are run. The last tests drive a protocol directly (fake
transport): no timer outlives its connection, and time the server spends not reading is not
held against the client."""

from __future__ import annotations

import asyncio
import gc
import json
import select
import socket
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from pipeline.errors import InvalidValueError
from tests.http_support import config, running
from transports.http import Gateway, Timeouts
from transports.http.server.timeouts import HTTPImpl, protocol_class

HEADER_S = BODY_S = 0.5
MARGIN_S = 1.0  # scheduling slack on a busy machine; every close is also bounded by recv's timeout
EARLY_S = 0.05  # a close this much before the deadline would be a premature one
CHAT = json.dumps({"model": "default", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


def chat_request(body: bytes = CHAT, length: int | None = None, extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n" % (len(body) if length is None else length, extra)
            + body)


HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(scope="module", params=["httptools", "h11"])
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    """One server per HTTP implementation, with half-second header and body deadlines."""
    gateway = Gateway(config(tmp_path_factory.mktemp("slow")))
    with running(gateway, timeouts=Timeouts(HEADER_S, BODY_S), http=request.param) as base:
        yield base


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def read_to_close(sock: socket.socket, limit_s: float = 5.0) -> tuple[bytes, float]:
    """All the server sends until it closes, and when it closed (``time.monotonic``). A server
    that keeps the connection open past ``limit_s`` fails the test (socket timeout)."""
    sock.settimeout(limit_s)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks), time.monotonic()


def read_response(sock: socket.socket) -> tuple[int, bytes, bytes]:
    """One ``Content-Length`` response off a connection that stays open: status, head, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than one response"
    return int(head.split()[1]), head, body


def assert_408(data: bytes) -> None:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def is_open(sock: socket.socket) -> bool:
    """The server has neither closed nor answered: nothing to read yet."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.settimeout(5)
    return False


def send_slowly(sock: socket.socket, data: bytes, pieces: int, gap_s: float) -> None:
    size = -(-len(data) // pieces)
    for start in range(0, len(data), size):
        sock.sendall(data[start:start + size])
        time.sleep(gap_s)


# --- stalled clients are cut off ---------------------------------------------------------------

@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/comp",
                                  b"GET /health HTTP/1.1\r\nHost: t\r\nAccept: */"],
                         ids=["nothing", "half a request line", "half the headers"])
def test_headers_that_stop_arriving_get_408_and_close(url: str, sent: bytes) -> None:
    with connect(url) as sock:
        start = time.monotonic()
        sock.sendall(sent)
        data, closed = read_to_close(sock)
    print(f"headers stalled ({sent[:12]!r}): closed after {closed - start:.3f} s")
    assert HEADER_S - EARLY_S <= closed - start <= HEADER_S + MARGIN_S
    assert_408(data)


def test_a_body_that_stops_arriving_gets_408_and_close(url: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with connect(url) as sock:
        sock.sendall(chat_request(CHAT[:20], length=1000))
        start = time.monotonic()
        data, closed = read_to_close(sock)
    print(f"body stalled at 20 of 1000 bytes: closed after {closed - start:.3f} s")
    assert BODY_S - EARLY_S <= closed - start <= BODY_S + MARGIN_S
    assert_408(data)
    # the app saw a disconnect, not a failure of its own
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'endpoint="chat.completions",model="other",status="499"' in metrics
    assert 'status="500"' not in metrics


def test_a_trickled_body_is_cut_at_the_deadline(url: str) -> None:
    """The body deadline covers the whole body: a byte every 0.1 s does not extend it."""
    with connect(url) as sock:
        sock.sendall(chat_request(b"", length=1000))
        start = time.monotonic()
        while time.monotonic() < start + BODY_S + MARGIN_S:
            if select.select([sock], [], [], 0.1)[0]:
                break  # the server answered or closed
            try:
                sock.sendall(b" ")  # JSON whitespace, never ending
            except OSError:
                break
        data, closed = read_to_close(sock)
    print(f"body trickled: closed after {closed - start:.3f} s")
    assert BODY_S - EARLY_S <= closed - start <= BODY_S + MARGIN_S
    assert_408(data)


def test_stalled_clients_do_not_hold_up_others(tmp_path: Path) -> None:
    """With the default (long) deadlines, a crowd of stalled connections is still open when a
    health check and a small chat completion have been answered."""
    with running(Gateway(config(tmp_path)), timeouts=Timeouts()) as base:
        stalled = [connect(base) for _ in range(16)]
        for n, sock in enumerate(stalled):
            sock.sendall(b"GET /health HT" if n % 2 else chat_request(CHAT[:10], length=1000))
        with httpx.Client(base_url=base, timeout=10) as client:
            start = time.monotonic()
            health = client.get("/health")
            health_s = time.monotonic() - start
            answer = client.post("/v1/chat/completions", content=CHAT,
                                 headers={"content-type": "application/json"})
            chat_s = time.monotonic() - start - health_s
        print(f"16 stalled connections open: /health in {health_s:.3f} s, chat in {chat_s:.3f} s")
        assert health.status_code == 200 and answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
        assert health_s < 1.0 and chat_s < 5.0
        assert all(is_open(sock) for sock in stalled)
        for sock in stalled:
            sock.close()


# --- slow but within the limits ------------------------------------------------------------------

def test_slow_headers_and_body_within_the_limits_are_answered(url: str) -> None:
    with connect(url) as sock:
        send_slowly(sock, HEALTH, pieces=7, gap_s=0.05)  # 0.35 s of headers
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["status"] == "ok"
    with connect(url) as sock:
        head, _, payload = chat_request().partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        send_slowly(sock, payload, pieces=7, gap_s=0.05)  # 0.35 s of body
        status, _, body = read_response(sock)
        assert status == 200 and json.loads(body)["object"] == "chat.completion"


def test_keep_alive_requests_each_get_a_fresh_clock(url: str) -> None:
    """Two slow requests on one connection, idle longer than a deadline in between: neither
    the idle time nor the first request's time counts against the second."""
    with connect(url) as sock:
        for _ in range(2):
            send_slowly(sock, HEALTH, pieces=7, gap_s=0.05)
            status, head, _ = read_response(sock)
            assert status == 200 and b"connection: close" not in head.lower()
            time.sleep(HEADER_S + 0.3)  # under uvicorn's 5 s keep-alive
        assert is_open(sock)


def test_pipelined_requests_each_get_their_own_clock(url: str) -> None:
    """Two whole requests and half of a third in one write: two answers, then the third's
    header deadline (408, close)."""
    with connect(url) as sock:
        start = time.monotonic()
        sock.sendall(HEALTH + chat_request() + b"GET /hea")
        first, _, _ = read_response(sock)
        second, _, body = read_response(sock)
        assert (first, second) == (200, 200) and json.loads(body)["object"] == "chat.completion"
        data, closed = read_to_close(sock)
    print(f"pipelined, third request stalled: closed after {closed - start:.3f} s")
    assert closed - start <= HEADER_S + MARGIN_S
    assert_408(data)


# --- the protocol itself ---------------------------------------------------------------------

def test_timeouts_are_validated() -> None:
    assert Timeouts() == Timeouts(10.0, 30.0)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(InvalidValueError, match="header_s"):
            Timeouts(header_s=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidValueError, match="body_s"):
            Timeouts(body_s=bad)  # type: ignore[arg-type]


class FakeTransport(asyncio.Transport):
    """Records what the protocol writes and whether it reads; a client that never sends more."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name)

    def write(self, data: Any) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def until_disconnect(scope: Any, receive: Any, send: Any) -> None:
    """An app that takes the body, as ours does, and gives up when the client is gone."""
    while (await receive())["type"] != "http.disconnect":
        pass


def make_protocol(http: HTTPImpl, timeouts: Timeouts, app: Any = until_disconnect
                  ) -> tuple[asyncio.Protocol, FakeTransport]:
    cls = protocol_class(timeouts, http)
    protocol = cls(config=uvicorn.Config(app, log_config=None),  # type: ignore[call-arg]
                   server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop())
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.mark.parametrize("http", ["httptools", "h11"])
@pytest.mark.parametrize("sent", [b"GET /hea", chat_request(CHAT[:10], length=1000)],
                         ids=["mid-headers", "mid-body"])
def test_no_timer_outlives_its_connection(http: HTTPImpl, sent: bytes) -> None:
    """A timer left armed after ``connection_lost`` would keep the protocol alive (and fire
    into a dead connection); once lost, nothing may hold it."""
    async def scenario() -> None:
        protocol, transport = make_protocol(http, Timeouts(5.0, 5.0))
        protocol.data_received(sent)
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)  # the app task (mid-body) sees the disconnect and ends
        assert not asyncio.all_tasks() - {asyncio.current_task()}
        gone = weakref.ref(protocol)
        del protocol, transport
        gc.collect()  # with the loop still running: a pending timer would be holding it
        assert gone() is None

    asyncio.run(scenario())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_time_the_server_is_not_reading_does_not_count(http: HTTPImpl) -> None:
    """A body larger than uvicorn's read buffer that the app does not take pauses reading; the
    body deadline then waits, and runs again once reading resumes."""
    async def scenario() -> None:
        busy = asyncio.Event()

        async def never_reads(scope: Any, receive: Any, send: Any) -> None:
            await busy.wait()  # neither takes the body nor answers, until the test ends

        protocol, transport = make_protocol(http, Timeouts(0.2, 0.2), never_reads)
        protocol.data_received(chat_request(b" " * 70_000, length=200_000))
        assert not transport.reading
        await asyncio.sleep(0.5)
        assert not transport.closing and not transport.written
        protocol.flow.resume_reading()  # type: ignore[attr-defined]  # what receive() does
        await asyncio.sleep(0.4)
        assert transport.closing
        assert_408(transport.written)
        protocol.connection_lost(None)
        busy.set()
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
