"""Replicas behind Ray Serve (:mod:`transports.ray_serve`), on a local Ray, with a shared
PostgreSQL usage store.

Two replicas of the server (the tiny model) behind the front and Ray Serve's proxy answer 200
concurrent requests from the official OpenAI and Anthropic SDKs, streamed and not, with zero
errors, and PostgreSQL — a real server the test starts (:mod:`tests.test_usage_postgres`) —
holds exactly one usage row for each response id. Both replicas answer (two ``x-replica-id``
values, each the name of a data directory). With 16 longer requests in flight, one replica's
actor is killed once streams of both dialects are under way on it: every client sees a whole
answer, its dialect's 503 body or its stream's error event, never Ray's bare 500 or a cut
connection. A request naming a model no replica serves is the gateway's 404. Oracles: the
SDKs' own parsing and exceptions, the rows PostgreSQL returns, the replicas' data directories.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pipeline.model_paths import TINY_MODEL_DIR
from tests.http_support import free_port
from tests.test_usage_postgres import Server, server  # noqa: F401  (the PostgreSQL fixture)
from transports.http import ServerConfig
from transports.http.accounting.usage_postgres import read_records

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")


@pytest.fixture(scope="module")
def served(server: Server, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
           ) -> Iterator[tuple[str, Path]]:
    from transports.ray_serve import application

    server.clear()
    data = tmp_path_factory.mktemp("replicas")
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = ServerConfig(models={"default": TINY_MODEL_DIR}, data_dir=data, num_slots=8,
                              usage_database=server.url)
        serve.run(application(config, num_replicas=2), route_prefix="/")
        yield f"http://127.0.0.1:{port}", data
    finally:
        serve.shutdown()
        ray.shutdown()


async def _ask(url: str, i: int) -> str:
    """Request ``i`` through an SDK: OpenAI or Anthropic, streamed or not; its response id."""
    messages = [{"role": "user", "content": f"Say something about the number {i}."}]
    if i % 2 == 0:
        client: Any = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            if i % 4 == 0:
                stream = await client.chat.completions.create(
                    model="default", messages=messages, max_tokens=4, stream=True)
                ids = {chunk.id async for chunk in stream}
                assert len(ids) == 1
                return str(ids.pop())
            done = await client.chat.completions.create(model="default", messages=messages,
                                                        max_tokens=4)
            assert done.usage.completion_tokens <= 4
            rid: str = done.id
            return rid
    client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    async with client:
        if i % 4 == 1:
            async with client.messages.stream(model="default", messages=messages,
                                              max_tokens=4) as stream:
                final = await stream.get_final_message()
            return str(final.id)
        message = await client.messages.create(model="default", messages=messages, max_tokens=4)
        return str(message.id)


def test_two_replicas_answer_200_sdk_requests_each_recorded_once(
        served: tuple[str, Path], server: Server) -> None:  # noqa: F811
    url, data = served

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(_ask(url, i) for i in range(200)))

    ids = asyncio.run(all_of_them())  # an SDK error would raise here: zero errors
    assert len(set(ids)) == 200
    rows = read_records(server.url)
    assert sorted(r.request_id for r in rows) == sorted(ids)  # exactly one row each
    assert {r.endpoint for r in rows} == {"chat.completions", "messages"}
    assert len(list(data.glob("replica-*"))) == 2  # two servers, each its own data dir


def test_a_model_no_replica_serves_is_the_gateways_404(served: tuple[str, Path]) -> None:
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="default"):
        client.chat.completions.create(model="nope", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])



def _replica(headers: Any) -> str:
    """The replica that answered (the front's ``x-replica-id`` header)."""
    return str(headers["x-replica-id"])


async def _replicas_of(url: str, n: int) -> set[str]:
    """The replicas that answered ``n`` concurrent short requests."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client:
        raws = await asyncio.gather(*(client.chat.completions.with_raw_response.create(
            model="default", max_tokens=2, messages=[{"role": "user", "content": f"{i}"}])
            for i in range(n)))
    return {_replica(raw.headers) for raw in raws}


def test_both_replicas_serve(served: tuple[str, Path]) -> None:
    url, data = served
    replicas = asyncio.run(_replicas_of(url, 16))
    assert len(replicas) == 2  # each answered, and each is a server with its own data dir
    assert replicas == {p.name.removeprefix("replica-") for p in data.glob("replica-*")}


LONG = 120
"""Tokens of an in-flight request: OpenAI's exactly that many (``min_tokens``), Anthropic's
too (the greedy answer to its prompt is longer), so that each runs for that many engine
steps after its stream has begun."""


class Kill:
    """The streams under way, by replica and dialect; set once one replica has streams of both
    dialects under way, which is the one to kill."""

    def __init__(self) -> None:
        self.under_way: dict[str, set[str]] = {}
        self.ready = asyncio.Event()
        self.victim = ""

    def begun(self, replica: str, dialect: str) -> None:
        self.under_way.setdefault(replica, set()).add(dialect)
        if not self.ready.is_set() and self.under_way[replica] == {"openai", "anthropic"}:
            self.victim = replica
            self.ready.set()


async def _in_flight(url: str, i: int, kill: Kill, tokens: int = LONG) -> tuple[str, str]:
    """Request ``i`` of ``tokens`` tokens (OpenAI or Anthropic, streamed or not): its kind
    and what its client saw: ``complete``, ``503`` (the error body), ``error event`` (a stream
    ended by one), or anything else, which is a failure. Streams report to ``kill`` once under
    way."""
    ask = [{"role": "user", "content": "Tell me about 1"}]
    stream, name = i % 4 < 2, ("openai", "anthropic")[i % 2]
    kind = f"{name} stream" if stream else name
    try:
        if name == "openai":
            client: Any = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                             max_retries=0)
            async with client:
                options = {"model": "default", "messages": ask, "max_tokens": tokens,
                           "temperature": 0, "extra_body": {"min_tokens": tokens}}
                if not stream:
                    done = await client.chat.completions.create(**options)
                    return kind, _done(done.choices[0].finish_reason)
                chunks = await client.chat.completions.create(stream=True, **options)
                finish = None
                async for chunk in chunks:
                    kill.begun(_replica(chunks.response.headers), name)
                    finish = chunk.choices[0].finish_reason if chunk.choices else finish
                return kind, _done(finish)
        client = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        async with client:
            options = {"model": "default", "messages": ask, "max_tokens": tokens,
                       "extra_body": {"temperature": 0}}
            if not stream:
                message = await client.messages.create(**options)
                return kind, _done(message.stop_reason)
            async with client.messages.stream(**options) as events:
                async for _ in events:
                    kill.begun(_replica(events.response.headers), name)
                final = await events.get_final_message()
            return kind, _done(final.stop_reason)
    except openai.APIStatusError as exc:  # an answer that is an error body: the 503 one
        ok = exc.status_code == 503 and exc.type == "service_unavailable" and \
            exc.response.headers.get("retry-after-ms") == "1000"  # told when to come back
        return kind, "503" if ok else f"failure: {exc!r}"
    except openai.APIError as exc:  # an error chunk ended the stream
        ok = stream and exc.type == "service_unavailable"
        return kind, "error event" if ok else f"failure: {exc!r}"
    except anthropic.APIStatusError as exc:  # the 503 body, or the stream's error event
        ok = isinstance(exc.body, dict) and exc.body["error"]["type"] == "api_error"
        if ok and exc.status_code == 503 and exc.response.headers.get("retry-after") == "1":
            return kind, "503"
        return kind, "error event" if ok and stream else f"failure: {exc!r}"
    except Exception as exc:  # a bare 500, a cut connection: what must not happen
        return kind, f"failure: {exc!r}"


def _done(finish: str | None) -> str:
    return "complete" if finish not in (None, "error") else f"failure: finished {finish}"


def _killed(rid: str) -> None:
    """Kill replica ``rid``'s actor, as a crash would (no graceful stop, no restart)."""
    actor = ray.get_actor(f"SERVE_REPLICA::default#pipeline#{rid}", namespace="serve")
    ray.kill(actor, no_restart=True)


def test_a_replica_killed_under_load_answers_every_client_in_its_dialect(
        served: tuple[str, Path]) -> None:
    url = served[0]

    async def under_load() -> tuple[list[tuple[str, str]], str]:
        kill = Kill()
        asked = [asyncio.ensure_future(_in_flight(url, i, kill)) for i in range(16)]
        await asyncio.wait_for(kill.ready.wait(), 60)
        _killed(kill.victim)
        return await asyncio.gather(*asked), kill.victim

    seen, victim = asyncio.run(under_load())
    assert not [s for s in seen if s[1].startswith("failure")], seen
    # a non-stream request the dead replica held was sent again, to the other
    assert {what for kind, what in seen if "stream" not in kind} == {"complete"}, seen
    # the kill cut streams under way in both dialects, and each ended with its error event
    assert {kind for kind, what in seen if what == "error event"} == {
        "openai stream", "anthropic stream"}, (victim, seen)


# --- the front alone, over a replica's app that dies on cue (no Ray cluster) ----------------


class _Call:
    """A streaming handle call over ``messages`` whose replica dies (Ray's
    ``ActorDiedError``) once ``after`` messages came through, or never (None)."""

    def __init__(self, messages: Any, after: int | None) -> None:
        self.messages, self.after = messages, after

    async def __anext__(self) -> Any:
        if self.after == 0:
            await self.messages.aclose()  # the replica's app sees its client leave
            raise ray.exceptions.ActorDiedError()
        if self.after is not None:
            self.after -= 1
        return await self.messages.__anext__()

    def cancel(self) -> None:
        pass


class Dying:
    """A stand-in for the front's ``DeploymentHandle``: each call runs the request through
    one replica's real app (:func:`~transports.ray_serve.served`); the first ``deaths`` calls
    die after ``after`` messages."""

    def __init__(self, app: Any, after: int, deaths: int) -> None:
        self.app, self.after, self.deaths = app, after, deaths
        self.running: set[Any] = set()
        self.calls = 0

    def options(self, **_: Any) -> Dying:
        return self

    @property
    def forward(self) -> Dying:
        return self

    def remote(self, asked: Any) -> _Call:
        from transports.ray_serve import served as run

        self.calls += 1
        dies = self.calls <= self.deaths
        return _Call(run(self.app, asked, "r1", self.running), self.after if dies else None)


@pytest.fixture(scope="module")
def replica_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from transports.http import Gateway, create_app

    gateway = Gateway(ServerConfig(models={"default": TINY_MODEL_DIR},
                                   data_dir=tmp_path_factory.mktemp("front")))
    gateway.loader.load(wait=True)
    try:
        yield create_app(gateway)
    finally:
        gateway.close()


@contextmanager
def _front(handle: Dying) -> Iterator[str]:
    """The front over ``handle``, served on 127.0.0.1; its base URL."""
    import uvicorn

    from transports.ray_serve import Front

    server = uvicorn.Server(uvicorn.Config(Front(handle, 1 << 20), "127.0.0.1", free_port(),
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the front did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _sdk_outcomes(url: str) -> dict[str, str]:
    """What each SDK's client saw, streamed and not (one request each; :func:`_in_flight`)."""
    async def each() -> list[tuple[str, str]]:
        return [await _in_flight(url, i, Kill(), tokens=8) for i in range(4)]

    return dict(asyncio.run(each()))


def test_the_front_answers_a_replica_dead_before_any_byte_with_the_dialects_503(
        replica_app: Any) -> None:
    handle = Dying(replica_app, after=0, deaths=8)  # every try dies: the retry too
    with _front(handle) as url:
        seen = _sdk_outcomes(url)
    assert seen == {"openai": "503", "anthropic": "503", "openai stream": "503",
                    "anthropic stream": "503"}
    assert handle.calls == 8  # each request was tried twice


def test_the_front_sends_a_request_again_when_its_replica_died_before_any_byte(
        replica_app: Any) -> None:
    handle = Dying(replica_app, after=1, deaths=1)  # after the head, before any body
    with _front(handle) as url:
        seen = _sdk_outcomes(url)
    assert set(seen.values()) == {"complete"}, seen
    assert handle.calls == 5  # the first request's two tries, then one each


def test_the_front_ends_a_stream_whose_replica_died_with_the_dialects_error_event(
        replica_app: Any) -> None:
    handle = Dying(replica_app, after=4, deaths=8)  # the head and three body chunks
    with _front(handle) as url:
        seen = _sdk_outcomes(url)
    assert seen["openai stream"] == seen["anthropic stream"] == "error event", seen
