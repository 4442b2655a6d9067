"""Overload: refusals decided before parsing, one log line per burst of them, a bound on the
queue wait, 415 for a body that is not declared JSON, and ``Retry-After`` on every refusal a
client may retry.

Oracles: the real OpenAI and Anthropic SDKs (which exception a status and body become), a
body that is not JSON at all (a request refused before parsing gets the overload error, one
that was parsed a 400), a scripted model that writes until it is stopped (it holds its slot
for as long as the test needs), and an injected clock for the log's summary line and the pace of a model, the SDKs' own retry code for what a
``Retry-After`` makes them wait (their sleep recorded, not slept). No verdict rests on a
duration: each wait is a bound on something that must happen."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pipeline.pipe import Pipeline
from pipeline.contracts.request import Request
from tests.http_support import config, endless_model, fragile_model, running
from transports.http import Gateway, ServerConfig
from transports.http.gateway.door import (
    LOADING_WAIT_S, RETRY_MAX_S, RETRY_MIN_S, Pace, Refusals, check_media_type, peek_models,
    place_wait_s, restart_wait_s,
)
from transports.http.server.errors import Dialect

CHAT = {"model": "default", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}]}
LONG = {**CHAT, "max_tokens": 4000, "stream": True}  # holds its slot until it is closed
BROKEN = b'{"model": "default", "max_tokens": 8, "messages": ['  # never parses
JSON_ROUTES = {"/v1/chat/completions": Dialect.OPENAI, "/v1/completions": Dialect.OPENAI,
               "/v1/responses": Dialect.OPENAI, "/v1/embeddings": Dialect.OPENAI,
               "/tokenize": Dialect.OPENAI, "/detokenize": Dialect.OPENAI,
               "/v1/messages": Dialect.ANTHROPIC,
               "/v1/messages/count_tokens": Dialect.ANTHROPIC}


def serve(tmp: Path, **fields: Any) -> tuple[Gateway, Pipeline]:
    pipe = endless_model(delay_s=0.005, num_slots=fields.get("num_slots", 8))[0]
    return Gateway(config(tmp, **fields), lambda f, c: pipe), pipe


@contextlib.contextmanager
def holding(url: str, path: str = "/v1/chat/completions") -> Iterator[None]:
    """A streamed request that holds a slot (it has sent its first event) until the block
    ends, when its connection closes and it is cancelled."""
    with httpx.Client(timeout=60) as client, \
            client.stream("POST", url + path, json=LONG) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        yield


def waits(headers: Mapping[str, str]) -> float:
    """The wait a refusal's ``headers`` ask for, in seconds, after checking they agree:
    ``Retry-After`` is ``retry-after-ms`` rounded up to whole seconds, within the bounds."""
    ms = int(headers["retry-after-ms"])
    assert int(headers["retry-after"]) == math.ceil(ms / 1e3)
    assert RETRY_MIN_S <= ms / 1e3 <= RETRY_MAX_S, ms
    return ms / 1e3


def error_of(body: dict[str, Any], dialect: Dialect) -> dict[str, Any]:
    """The error object of a body in ``dialect``'s shape (and check the shape)."""
    if dialect is Dialect.ANTHROPIC:
        assert body["type"] == "error"
    return body["error"]  # type: ignore[no-any-return]


# --- the door: media types and the peek --------------------------------------------------


@pytest.mark.parametrize("value", [None, "application/json", "application/json; charset=utf-8",
                                   "Application/JSON", "application/vnd.api+json"])
def test_json_and_no_content_type_pass(value: str | None) -> None:
    check_media_type(value)


def test_a_body_that_is_not_declared_json_is_a_415_on_every_json_route(tmp_path: Path) -> None:
    gateway, _ = serve(tmp_path)
    body = b'{"model": "default", "messages": [{"role": "user", "content": "hi"}]}'
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
        for path, dialect in JSON_ROUTES.items():
            for kind in ("text/plain", "application/x-www-form-urlencoded"):  # curl -d's
                r = client.post(path, content=body, headers={"content-type": kind})
                assert r.status_code == 415, (path, kind, r.text)
                error = error_of(r.json(), dialect)
                assert error["type"] == "invalid_request_error"
                assert "application/json" in error["message"]
                if dialect is Dialect.OPENAI:
                    assert error["code"] == "unsupported_media_type"
        # the same bytes declared as JSON, or not declared at all, are served
        for headers in ({"content-type": "application/json"}, {}):
            r = client.post("/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 200, r.text


def test_the_sdks_see_a_415_as_their_own_error(tmp_path: Path) -> None:
    gateway, _ = serve(tmp_path)
    headers = {"content-type": "text/plain"}
    with running(gateway) as url:
        oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            oa.chat.completions.create(model="default", messages=[{"role": "user",
                                                                   "content": "hi"}],
                                       extra_headers=headers)
        assert caught.value.status_code == 415 and caught.value.code == "unsupported_media_type"
        an = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as refused:
            an.messages.create(model="default", max_tokens=4, extra_headers=headers,
                               messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 415
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_peek_finds_model_keys_but_not_text_that_mentions_one() -> None:
    assert peek_models(b'{"model": "a", "x": {"model" :"b"}}') == {"a", "b"}
    quoted = b'{"messages": [{"content": "say \\"model\\": \\"a\\""}], "model":"q"}'
    assert peek_models(quoted) == {"q"}
    assert peek_models(b'{"messages": []}') == frozenset()
    assert peek_models(b'{"model": 3}') == frozenset()
    many = b"[" + b",".join(b'{"model": "a"}' for _ in range(40)) + b"]"
    assert peek_models(many) == frozenset()  # too many to say: no pre-check


# --- refused before parsing ---------------------------------------------------------------


def test_a_full_model_refuses_before_the_body_is_parsed(tmp_path: Path) -> None:
    """With the model's one place taken, a body that is not even JSON gets the overload
    error of its dialect: it was refused before parsing. With the place free it is a 400."""
    gateway, _ = serve(tmp_path, num_slots=1, max_queue=0)
    json_type = {"content-type": "application/json"}
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
        for path in ("/v1/chat/completions", "/v1/messages"):
            assert client.post(path, content=BROKEN, headers=json_type).status_code == 400
        with holding(url):
            openai_side = client.post("/v1/chat/completions", content=BROKEN,
                                      headers=json_type)
            anthropic_side = client.post("/v1/messages", content=BROKEN, headers=json_type)
            other = client.post("/v1/chat/completions", headers=json_type,
                                content=BROKEN.replace(b'"default"', b'"nothing"'))
            metrics = client.get("/metrics").text
    assert openai_side.status_code == 429, openai_side.text
    assert error_of(openai_side.json(), Dialect.OPENAI)["type"] == "rate_limit_exceeded"
    assert anthropic_side.status_code == 529, anthropic_side.text
    assert error_of(anthropic_side.json(), Dialect.ANTHROPIC)["type"] == "overloaded_error"
    assert other.status_code == 400  # a name no model is served under: parsed, then refused
    assert "retry-after" not in other.headers  # no refusal: no wait to ask for
    for refused in (openai_side, anthropic_side):  # nothing finished yet: the shortest wait
        assert waits(refused.headers) == RETRY_MIN_S
    assert ('pipeline_requests_total{endpoint="chat.completions",model="default",'
            'status="429"} 1.0') in metrics


def test_the_sdks_see_a_full_model_as_overloaded(tmp_path: Path) -> None:
    gateway, _ = serve(tmp_path, num_slots=1, max_queue=0)
    messages = [{"role": "user", "content": "hi"}]
    with running(gateway) as url, holding(url):
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0
                          ).chat.completions.create(model="default", messages=messages)  # type: ignore[arg-type]
        with pytest.raises(anthropic.OverloadedError):
            anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
                model="default", max_tokens=4, messages=messages)  # type: ignore[arg-type]


def test_a_loading_model_logs_no_error_per_refused_request(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    pipe = endless_model()[0]

    def slow_builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        release.wait(60)
        return pipe

    gateway = Gateway(config(tmp_path), slow_builder)
    caplog.set_level(logging.INFO, "pipeline.serve")
    try:
        with running(gateway, wait=False) as url, httpx.Client(base_url=url) as client:
            statuses = [client.post("/v1/messages", json={**CHAT, "max_tokens": i + 1}
                                    ).status_code for i in range(5)]
            loading = client.post("/v1/chat/completions", json=CHAT)
            loading_an = client.post("/v1/messages", json=CHAT)
            body = loading.json()
            lines = [r for r in caplog.records if r.name == "pipeline.serve"
                     and r.levelno >= logging.WARNING]
    finally:
        release.set()
    assert statuses == [503] * 5
    assert body["error"]["code"] == "model_loading"
    assert waits(loading.headers) == waits(loading_an.headers) == LOADING_WAIT_S
    assert lines == []  # no line per refusal: the burst's one line comes later


def test_one_summary_line_per_burst_of_refusals(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    refusals = Refusals(window_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, "pipeline.serve")
    opened = [refusals.count("over capacity") for _ in range(3)]
    now[0] += 4.0
    opened += [refusals.count("engine restarting"), refusals.count("over capacity")]
    assert opened == [True, False, False, False, False]  # one burst: one flush to schedule
    assert caplog.records == []
    now[0] += 6.0
    refusals.flush()
    (line,) = caplog.records
    assert line.levelno == logging.WARNING
    assert line.getMessage() == ("refused 5 requests in the last 10.0 s: 4 over capacity; "
                                 "1 engine restarting")
    refusals.flush()  # nothing new: nothing written
    assert refusals.count("over capacity")  # the next burst opens afresh
    now[0] += 10.0
    refusals.flush()
    assert [r.getMessage() for r in caplog.records][1] == (
        "refused 1 request in the last 10.0 s: 1 over capacity")


# --- the queue wait bound -----------------------------------------------------------------


def test_the_queue_wait_has_a_default_bound_on_every_request() -> None:
    assert ServerConfig(models={"d": None}).max_queue_wait_s == 60.0
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        ServerConfig(models={"d": None}, max_queue_wait_s=0)


def test_fit_gives_each_request_the_servers_queue_bound(tmp_path: Path) -> None:
    gateway, _ = serve(tmp_path)
    gateway.loader.load(wait=True)
    try:
        served = gateway.model("default")
        fitted = gateway.window_fit.fit(served, Request(prompt="hi"), max_tokens_given=False)
        assert fitted.request.runtime_limits.queue_timeout_s == 60.0
        own = Request(prompt="hi", runtime_limits={"queue_timeout_s": 5.0})
        assert gateway.window_fit.fit(served, own, max_tokens_given=False
                           ).request.runtime_limits.queue_timeout_s == 5.0
    finally:
        gateway.close()


def test_a_request_that_waits_past_the_bound_gets_the_overload_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One slot held by an endless request: the next one queues, and after the bound (a
    small one here, so the test does not wait a minute) it gets its dialect's overload
    error, streamed and not, and the log has no ERROR line for it."""
    gateway, _ = serve(tmp_path, num_slots=1, max_queue=4, max_queue_wait_s=0.2)
    caplog.set_level(logging.INFO, "pipeline.serve")
    messages = [{"role": "user", "content": "hi"}]
    with running(gateway) as url, holding(url):
        oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as caught:
            oa.chat.completions.create(model="default", messages=messages, max_tokens=4)  # type: ignore[arg-type]
        an = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=60)
        with pytest.raises(anthropic.OverloadedError) as overloaded:
            an.messages.create(model="default", max_tokens=4, messages=messages)  # type: ignore[arg-type]
        with pytest.raises(openai.APIError) as streamed_oa:
            for _ in oa.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                                max_tokens=4, stream=True):
                pass
        with pytest.raises(anthropic.APIStatusError) as streamed_an:
            with an.messages.stream(model="default", max_tokens=4,
                                    messages=messages) as stream:  # type: ignore[arg-type]
                for _ in stream:
                    pass
    assert caught.value.status_code == 503 and caught.value.code == "queue_timeout"
    assert waits(caught.value.response.headers) >= RETRY_MIN_S
    assert waits(overloaded.value.response.headers) >= RETRY_MIN_S
    assert "max_queue_wait_s" in caught.value.message
    assert overloaded.value.status_code == 529
    assert overloaded.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert streamed_oa.value.code == "queue_timeout"
    assert streamed_an.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- when to come back: Retry-After -----------------------------------------------------------


def test_pace_and_the_waits_it_gives_in_closed_form() -> None:
    now = [50.0]
    pace = Pace(window=4, clock=lambda: now[0])
    assert pace.rate() is None
    for t in (50.0, 50.5, 51.0, 52.0, 53.0):  # the window keeps the last 4: 50.5 .. 53.0
        now[0] = t
        pace.tick()
    assert pace.rate() == 3 / 2.5
    now[0] = 55.5  # nothing ended since: the rate falls
    assert pace.rate() == 3 / 5.0
    assert place_wait_s(3, 3 / 5.0) == 5.0
    assert place_wait_s(65, 25.0) == 2.6  # 64 queued and the client, at 25 ends a second
    assert place_wait_s(65, 1.0) == RETRY_MAX_S and place_wait_s(1, 50.0) == RETRY_MIN_S
    assert place_wait_s(10, None) == RETRY_MIN_S  # no rate yet: soon, to be told better
    assert restart_wait_s(3.0, 1.0, 0.5) == 2.5
    assert restart_wait_s(3.0, 9.0, 0.25) == RETRY_MIN_S  # the delay is over: the floor
    assert restart_wait_s(1.0, 0.0, 60.0) == RETRY_MAX_S  # a long start: the bound
    assert RETRY_MAX_S <= 120  # past 120 s the OpenAI SDK gives up instead of waiting


def test_a_full_models_wait_follows_its_pace(tmp_path: Path) -> None:
    """Requests that finished give the model a pace; a refusal then asks for the wait of the
    queue ahead at that pace, within the bounds, the same figure in both headers."""
    gateway, _ = serve(tmp_path, num_slots=1, max_queue=0)
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        with holding(url):
            rate = gateway.models["default"].pace.rate()
            refused = client.post("/v1/messages", json=CHAT)
    assert refused.status_code == 529
    assert rate is not None and rate > 0
    # one ahead (the client itself): 1 / rate, where the rate can only have fallen since
    assert waits(refused.headers) >= min(max(1 / rate, RETRY_MIN_S), RETRY_MAX_S) - 1e-3


def test_a_restarting_engine_says_when_it_will_be_back(tmp_path: Path) -> None:
    """An engine that stops: the request it ended and the ones refused meanwhile ask for
    what is left of the restart delay plus the engine's measured start, within the bounds;
    a model that failed to load asks for nothing (a retry cannot help)."""
    pipe, _, armed = fragile_model("the engine thread ended")
    gateway = Gateway(config(tmp_path, restart_delay_s=5.0), lambda f, c: pipe)
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
        start_s = gateway.models["default"].start_s
        assert start_s is not None
        armed.set()
        ended = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50})
        refused = client.post("/v1/messages", json=CHAT)
    assert ended.status_code == 503 and refused.status_code == 503, (ended.text, refused.text)
    assert refused.json()["error"]["type"] == "api_error"
    for response in (ended, refused):
        assert waits(response.headers) <= 5.0 + start_s + 1e-3

    def broken(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        raise OSError("no such model file")

    failed = Gateway(config(tmp_path / "failed"), broken)
    with running(failed) as url, httpx.Client(base_url=url, timeout=60) as client:
        response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and "failed to load" in response.text
    assert "retry-after" not in response.headers and "retry-after-ms" not in response.headers


class Slept:
    """Stands for the ``time`` module of an SDK's client: its ``sleep`` is recorded, not
    slept; everything else is the real module's."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_the_sdks_wait_what_the_server_says(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI SDK refused by a full model, and the Anthropic SDK by a loading one, each
    with one retry: each sleeps, before it, the wait the refusal asked for (its own backoff
    would have been 0.375-0.5 s)."""
    import anthropic._base_client
    import openai._base_client

    slept_oa, slept_an = Slept(), Slept()
    monkeypatch.setattr(openai._base_client, "time", slept_oa)
    monkeypatch.setattr(anthropic._base_client, "time", slept_an)
    messages = [{"role": "user", "content": "hi"}]
    gateway, _ = serve(tmp_path, num_slots=1, max_queue=0)
    with running(gateway) as url, holding(url):
        with pytest.raises(openai.RateLimitError) as caught:
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=1
                          ).chat.completions.create(model="default", messages=messages)  # type: ignore[arg-type]
    assert slept_oa.seconds == [waits(caught.value.response.headers)]
    release = threading.Event()

    def slow_builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        release.wait(60)
        return endless_model()[0]

    loading = Gateway(config(tmp_path / "loading"), slow_builder)
    try:
        with running(loading, wait=False) as url:
            with pytest.raises(anthropic.InternalServerError) as refused:
                anthropic.Anthropic(base_url=url, api_key="k", max_retries=1).messages.create(
                    model="default", max_tokens=4, messages=messages)  # type: ignore[arg-type]
    finally:
        release.set()
    assert refused.value.status_code == 503
    assert slept_an.seconds == [waits(refused.value.response.headers)] == [LOADING_WAIT_S]
