"""Slow and stalled clients over real sockets on 127.0.0.1: a request whose headers or body stop
arriving is answered 408 and closed within its deadline, while other clients are served as
usual; slow clients inside the limits, keep-alive and pipelined requests still work. Both of
uvicorn's HTTP implementations are run. The last tests drive a protocol directly (fake
transport) on a virtual clock: each deadline is armed for exactly its limit from the right
moment, trickled bytes do not extend it, no timer outlives its connection, and time the server
spends not reading is not held against the client. No verdict rests on a stopwatch: the
socket tests print how long a close took, and their only time limit is a hang guard."""

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
EARLY_S = 0.05  # on the virtual clock: this much before a deadline, nothing has fired
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


@pytest.fixture(scope="module", params=["httptools", "h11"])
def patient_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[str]:
    """One server per HTTP implementation whose deadlines no test reaches: for what slow
    clients within the limits get from the real app (the limits' arithmetic is checked on
    the virtual clock below, where the machine's load cannot move it)."""
    gateway = Gateway(config(tmp_path_factory.mktemp("patient")))
    with running(gateway, timeouts=Timeouts(3600.0, 3600.0), http=request.param) as base:
        yield base


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60)  # a hang guard


def read_to_close(sock: socket.socket, limit_s: float = 60.0) -> tuple[bytes, float]:
    """All the server sends until it closes, and when it closed (``time.monotonic``). A server
    that keeps the connection open past ``limit_s`` (a hang guard) fails the test."""
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
        sock.settimeout(60)
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
    assert_408(data)  # when: test_each_deadline_is_armed_for_its_limit


def test_a_body_that_stops_arriving_gets_408_and_close(url: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with connect(url) as sock:
        sock.sendall(chat_request(CHAT[:20], length=1000))
        start = time.monotonic()
        data, closed = read_to_close(sock)
    print(f"body stalled at 20 of 1000 bytes: closed after {closed - start:.3f} s")
    assert_408(data)
    # the app saw a disconnect, not a failure of its own
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'endpoint="chat.completions",model="other",status="499"' in metrics
    assert 'status="500"' not in metrics


def test_a_trickled_body_is_cut_at_the_deadline(url: str) -> None:
    """The body deadline covers the whole body: a byte every 0.1 s does not extend it (that
    it is not restarted by a byte: test_trickled_bytes_do_not_extend_the_body_deadline)."""
    with connect(url) as sock:
        sock.sendall(chat_request(b"", length=1000))
        start = time.monotonic()
        while not select.select([sock], [], [], 0.1)[0]:  # until the server answers or closes
            assert time.monotonic() < start + 60, "the trickle was never cut off"  # a hang
            try:
                sock.sendall(b" ")  # JSON whitespace, never ending
            except OSError:
                break
        data, closed = read_to_close(sock)
    print(f"body trickled: closed after {closed - start:.3f} s")
    assert_408(data)


def test_stalled_clients_do_not_hold_up_others(tmp_path: Path) -> None:
    """With deadlines longer than any test, a crowd of stalled connections is still open when
    a health check and a small chat completion have been answered: they were served while
    the crowd held its connections (the times are printed, not judged)."""
    with running(Gateway(config(tmp_path)), timeouts=Timeouts(3600.0, 3600.0)) as base:
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
        assert all(is_open(sock) for sock in stalled)
        for sock in stalled:
            sock.close()


# --- slow but within the limits ------------------------------------------------------------------

def test_slow_headers_and_body_within_the_limits_are_answered(patient_url: str) -> None:
    url = patient_url
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


def test_keep_alive_requests_each_get_a_fresh_clock(patient_url: str) -> None:
    """Two slow requests on one connection, idle longer than a deadline in between: neither
    the idle time nor the first request's time counts against the second (on the virtual
    clock: test_keep_alive_idleness_and_slow_pieces_within_the_limits_are_not_cut)."""
    url = patient_url
    with connect(url) as sock:
        for _ in range(2):
            send_slowly(sock, HEALTH, pieces=7, gap_s=0.05)
            status, head, _ = read_response(sock)
            assert status == 200 and b"connection: close" not in head.lower()
            time.sleep(HEADER_S + 0.3)  # under uvicorn's 5 s keep-alive
        assert is_open(sock)


def test_pipelined_requests_each_get_their_own_clock(patient_url: str) -> None:
    """Two whole requests and half of a third in one write: two answers, the connection still
    waiting on the third (whose own header deadline then ends it with a 408, on the virtual
    clock: test_pipelined_requests_get_their_own_header_deadline)."""
    with connect(patient_url) as sock:
        sock.sendall(HEALTH + chat_request() + b"GET /hea")
        first, _, _ = read_response(sock)
        second, _, body = read_response(sock)
        assert (first, second) == (200, 200) and json.loads(body)["object"] == "chat.completion"
        assert is_open(sock)


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


class VirtualClock:
    """The event loop as a protocol sees it, with a clock of its own: ``time()`` and every
    ``call_later``/``call_at`` run on virtual seconds that only :meth:`advance` moves;
    everything else (tasks, ``call_soon``) is the real running loop's."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._seq = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None
                ) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, self._loop, context=context)
        self._seq += 1
        self._timers.append((when, self._seq, handle))
        return handle

    def call_later(self, delay: float, callback: Any, *args: Any, context: Any = None
                   ) -> asyncio.TimerHandle:
        return self.call_at(self.now + delay, callback, *args, context=context)

    def pending(self) -> list[float]:
        """When each live timer is due."""
        return sorted(when for when, _, h in self._timers if not h.cancelled())

    async def advance(self, seconds: float) -> None:
        """Move the clock on, running each timer that falls due in order (and the real
        loop's ready callbacks after each)."""
        end = self.now + seconds
        while True:
            due = sorted(t for t in self._timers if t[0] <= end and not t[2].cancelled())
            if not due:
                break
            when, seq, handle = due[0]
            self._timers.remove((when, seq, handle))
            self.now = when
            handle._run()
            await asyncio.sleep(0)
        self.now = end
        await asyncio.sleep(0)


def make_protocol(http: HTTPImpl, timeouts: Timeouts, app: Any = until_disconnect,
                  clock: VirtualClock | None = None) -> tuple[asyncio.Protocol, FakeTransport]:
    cls = protocol_class(timeouts, http)
    loop = clock if clock is not None else asyncio.get_running_loop()
    protocol = cls(config=uvicorn.Config(app, log_config=None),  # type: ignore[call-arg]
                   server_state=ServerState(), app_state={}, _loop=loop)
    transport = FakeTransport()
    protocol.connection_made(transport)
    return protocol, transport


@pytest.mark.parametrize("http", ["httptools", "h11"])
@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/comp",
                                  b"GET /health HTTP/1.1\r\nHost: t\r\nAccept: */"],
                         ids=["nothing", "half a request line", "half the headers"])
def test_each_deadline_is_armed_for_its_limit(http: HTTPImpl, sent: bytes) -> None:
    """Headers that stop arriving: nothing just before the header deadline (counted from the
    connection's opening), a 408 and a close at it; a body that stops arriving: the same
    for the body deadline, counted from the end of the headers."""
    async def scenario() -> None:
        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(HEADER_S, BODY_S * 3), clock=clock)
        if sent:  # (no bytes at all is not a read of none: that would be the end of input)
            protocol.data_received(sent)
        await clock.advance(HEADER_S - EARLY_S)
        assert not transport.closing and not transport.written
        await clock.advance(EARLY_S)
        assert transport.closing
        assert_408(transport.written)
        protocol.connection_lost(None)

        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(HEADER_S, BODY_S * 3), clock=clock)
        await clock.advance(HEADER_S - EARLY_S)  # the headers arrive just in time
        protocol.data_received(chat_request(CHAT[:20], length=1000))
        await clock.advance(BODY_S * 3 - EARLY_S)
        assert not transport.closing and not transport.written
        await clock.advance(EARLY_S)
        assert transport.closing
        assert_408(transport.written)
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)  # the app task sees the disconnect and ends

    asyncio.run(scenario())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_trickled_bytes_do_not_extend_the_body_deadline(http: HTTPImpl) -> None:
    """A byte every 0.1 s (virtual) does not move the body deadline: it fires at ``BODY_S``
    after the headers."""
    async def scenario() -> None:
        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(HEADER_S, BODY_S), clock=clock)
        protocol.data_received(chat_request(b"", length=1000))
        ticks = 0
        while not transport.closing:
            protocol.data_received(b" ")
            await clock.advance(0.1)
            ticks += 1
            assert ticks < 100, "the trickle was never cut off"
        assert BODY_S - EARLY_S <= clock.now <= BODY_S + 0.1
        assert_408(transport.written)
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    """An app that reads the whole body and answers ``{}``."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_pipelined_requests_get_their_own_header_deadline(http: HTTPImpl) -> None:
    """Two whole requests and half of a third: the third's header deadline is its own, from
    when its bytes are parsed, and ends in a 408 after the two answers."""
    async def scenario() -> None:
        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(HEADER_S, BODY_S), _answer, clock)
        protocol.data_received(HEALTH + chat_request() + b"GET /hea")
        for _ in range(20):  # the real loop runs the two answers
            await asyncio.sleep(0)
        assert transport.written.count(b"HTTP/1.1 200 ") == 2 and not transport.closing
        await clock.advance(HEADER_S - EARLY_S)
        assert not transport.closing
        await clock.advance(EARLY_S)
        assert transport.closing
        assert b"HTTP/1.1 408 " in transport.written
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_keep_alive_idleness_and_slow_pieces_within_the_limits_are_not_cut(
        http: HTTPImpl) -> None:
    """Headers, then a body, each in seven pieces 0.05 s apart (0.35 s of a 0.5 s limit):
    answered; then idle longer than a deadline, and a second slow request on the same
    connection: answered too, the connection still open."""
    async def slowly(protocol: asyncio.Protocol, clock: VirtualClock, data: bytes) -> None:
        size = -(-len(data) // 7)
        for start in range(0, len(data), size):
            protocol.data_received(data[start:start + size])
            await clock.advance(0.05)

    async def scenario() -> None:
        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(HEADER_S, BODY_S), _answer, clock)
        await slowly(protocol, clock, HEALTH)
        head, _, payload = chat_request().partition(b"\r\n\r\n")
        await clock.advance(HEADER_S + 0.3)  # idle between requests: keep-alive's, not ours
        protocol.data_received(head + b"\r\n\r\n")
        await slowly(protocol, clock, payload)
        for _ in range(20):
            await asyncio.sleep(0)
        assert transport.written.count(b"HTTP/1.1 200 ") == 2, transport.written
        assert not transport.closing
        protocol.connection_lost(None)
        await asyncio.sleep(0.01)

    asyncio.run(scenario())


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

        clock = VirtualClock(asyncio.get_running_loop())
        protocol, transport = make_protocol(http, Timeouts(0.2, 0.2), never_reads, clock)
        protocol.data_received(chat_request(b" " * 70_000, length=200_000))
        assert not transport.reading
        await clock.advance(0.5)  # past the deadline twice over, but the server is not reading
        assert not transport.closing and not transport.written
        protocol.flow.resume_reading()  # type: ignore[attr-defined]  # what receive() does
        await clock.advance(0.4)
        assert transport.closing
        assert_408(transport.written)
        protocol.connection_lost(None)
        busy.set()
        await asyncio.sleep(0.01)

    asyncio.run(scenario())
