"""Fuzzing the server against its own OpenAPI document with schemathesis.

For each operation of the document, a real server on 127.0.0.1 serves the embedded model with
an API key; schemathesis loads the document from the live ``GET /openapi.json`` and generates
requests that follow it (positive) and that break it (negative: wrong types, out-of-range
values, missing or unknown fields, wrong keys). Every answer is checked: never a 5xx
(``not_a_server_error``), the status, content type and JSON body as the document declares
them, and a broken request refused. Failing requests are collected rather than stopping at
the first, so one run lists them all, each exactly as sent; a summary line per operation, and
one for the run, print how many requests went out and their statuses.

Two hooks adjust what schemathesis generates: ``max_tokens`` is capped so answers stay short,
and one body in eight gets a lone UTF-16 surrogate, which JSON can carry and schemathesis
never generates. Each operation gets its own server so that a request that kills the engine
(the server then stops answering) is reported for that operation without hanging the others.
Scripted models add the answers random requests seldom reach (tool calls, reasoning,
logprobs, the usage chunk), checked against the same document.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance, negative_data_rejection, not_a_server_error,
    response_schema_conformance, status_code_conformance,
)
from schemathesis.errors import FailureGroup

from pipeline.builder import build
from pipeline.pipe import Pipeline
from tests.http_support import config, running, thinker_model, tool_model
from transports.http import Gateway, ServerConfig, create_app
from transports.http.dialects.openapi import openapi_document

KEY = "sk-schemathesis"
JSON = "application/json"
# Generation stays cheap: a handful of tokens per answer, a small window.
MAX_TOKENS = 4
MAX_CONTEXT = 256
# Examples per operation and mode: ~1,300 requests in all, 30-50 s on 2 cores.
EXAMPLES = {GenerationMode.POSITIVE: 100, GenerationMode.NEGATIVE: 100}
# A tiny model answers within milliseconds; a request still open after this is a stuck engine.
REQUEST_TIMEOUT_S = 10
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
OPERATIONS = [(method.upper(), path)
              for path, item in openapi_document(["default"])["paths"].items() for method in item]
TOTAL: Counter[int] = Counter()


# --- hooks: what schemathesis generates, adjusted -------------------------------------------


def cap_max_tokens(context: schemathesis.HookContext, body: Any) -> Any:
    """A valid ``max_tokens`` above ``MAX_TOKENS`` becomes ``MAX_TOKENS`` (still valid, so a
    negative case stays negative): every answer is a few tokens at most."""
    if not isinstance(body, dict):
        return body
    capped = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = capped.get(key)
        if type(value) is int and MAX_TOKENS < value <= 1 << 30:
            capped[key] = MAX_TOKENS
    return capped


def _string_spots(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], bool]]:
    """``(path, is_key)`` for every string in a JSON value: values, and object keys."""
    if isinstance(value, str):
        yield path, False
    elif isinstance(value, dict):
        for key, item in value.items():
            yield (*path, key), True
            yield from _string_spots(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _string_spots(item, (*path, i))


def _with_char(body: Any, spot: tuple[tuple[Any, ...], bool], char: str) -> Any:
    """``body`` with ``char`` appended to the string (or key) at ``spot``."""
    (path, is_key), out = spot, copy.deepcopy(body)
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1] if path else None
    if last is None:
        return out + char
    if is_key:
        parent[last + char] = parent.pop(last)
    else:
        parent[last] = parent[last] + char
    return out


def lone_surrogates(context: schemathesis.HookContext, body: Any) -> st.SearchStrategy[Any]:
    """One body in eight gets a lone UTF-16 surrogate in one of its strings or keys. JSON's
    ``\\u`` escapes carry them (a client that cuts a string inside a pair sends one), but
    schemathesis leaves them out of its alphabet, thinking of raw UTF-8."""
    spots = list(_string_spots(body))
    if not spots:
        return st.just(body)
    altered = st.tuples(st.sampled_from(spots), st.characters(categories=["Cs"])).map(
        lambda drawn: _with_char(body, *drawn))
    # one value of eight, and not an end of the range: Hypothesis favours those
    return st.integers(0, 7).flatmap(lambda n: altered if n == 3 else st.just(body))


# --- the run ---------------------------------------------------------------------------------


def counts(statuses: Counter[int]) -> str:
    return (f"{sum(statuses.values())} requests, statuses "
            f"{json.dumps({str(k): v for k, v in sorted(statuses.items())})}")


@pytest.fixture(scope="module", autouse=True)
def summary(pytestconfig: pytest.Config) -> Iterator[None]:
    """The run's totals, on the terminal even when output is captured."""
    yield
    if TOTAL:
        capture = pytestconfig.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            print(f"\nschemathesis, all operations: {counts(TOTAL)}")


def load(url: str) -> Any:
    """The live document, with the key for both schemes and the hooks above."""
    auth = {"bearer": {"bearer": KEY}, "apiKey": {"api_key": KEY}}
    schema = schemathesis.openapi.from_url(
        f"{url}/openapi.json", config=schemathesis.Config.from_dict({"auth": {"openapi": auth}}))
    schema.hook("map_body")(cap_max_tokens)
    schema.hook("flatmap_body")(lone_surrogates)
    # schemathesis leaves out the operation that served the document unless a filter names it
    return schema.include(path_regex="^/")


def negatable(operation: Any) -> bool:
    """Whether the operation has anything to break: a body or a key (else Unsatisfiable)."""
    raw = operation.definition.raw
    return "requestBody" in raw or raw.get("security") != []


def sent(request: Any) -> str:
    """A request as it went out: method, path, the headers that matter, the body's bytes."""
    body = request.body
    text = body.decode("utf-8", "backslashreplace") if isinstance(body, bytes) else body
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("authorization", "x-api-key", "traceparent")}
    return f"{request.method} {request.path_url} {headers} {text!r}"


class Fuzz:
    """One operation's run: what went out, what came back, what failed."""

    def __init__(self, operation: Any) -> None:
        self.operation = operation
        self.statuses: Counter[int] = Counter()
        self.failures: dict[str, None] = {}  # ordered and without repeats
        self.stuck = False  # the server stopped answering: send nothing more

    def send(self, case: Any) -> None:
        if self.stuck:
            return
        try:
            response = case.call(timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            self.stuck = True
            what = sent(exc.request) if exc.request is not None else case.as_curl_command()
            self.failures[f"[no answer: {type(exc).__name__}] {what}"] = None
            return
        self.statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as group:
            titles = "; ".join(sorted({f.title for f in group.exceptions}))
            self.failures[f"[{titles}] {sent(response.request)} -> "
                          f"{response.status_code} {response.text[:200]!r}"] = None

    def run(self, mode: GenerationMode) -> None:
        @settings(max_examples=EXAMPLES[mode], deadline=timedelta(seconds=2 * REQUEST_TIMEOUT_S),
                  database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=self.operation.as_strategy(generation_mode=mode))
        def each(case: Any) -> None:
            self.send(case)

        each()


def test_the_document_names_every_route(tmp_path: Path) -> None:
    """A route added to the app without a line in the document fails here, not in production."""
    gateway = Gateway(config(tmp_path))
    try:
        routes = {(method, route.path) for route in create_app(gateway).routes
                  for method in getattr(route, "methods", ()) if method != "HEAD"}
    finally:
        gateway.close()
    assert routes == set(OPERATIONS)


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# Answers random generation seldom reaches: tool calls, reasoning, logprobs, the usage chunk.
SCRIPTED = [
    ("/v1/chat/completions", {"model": "tools", "messages": ASK, "max_tokens": 40,
                              "tools": [{"type": "function", "function": WEATHER}]}),
    ("/v1/chat/completions", {"model": "tools", "messages": ASK, "max_tokens": 40, "stream": True,
                              "tools": [{"type": "function", "function": WEATHER}],
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "thinker", "messages": ASK, "max_tokens": 8,
                              "reasoning_budget_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"model": "thinker", "messages": ASK, "max_tokens": 8,
                              "stream": True, "logprobs": True, "top_logprobs": 2}),
    ("/v1/messages", {"model": "tools", "messages": ASK, "max_tokens": 40,
                      "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]}),
    ("/v1/messages", {"model": "tools", "messages": ASK, "max_tokens": 40, "stream": True,
                      "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]}),
    ("/v1/messages", {"model": "thinker", "messages": ASK, "max_tokens": 8, "stream": True,
                      "thinking": {"type": "enabled", "budget_tokens": 3}}),
    ("/v1/messages", {"model": "default", "messages": ASK, "max_tokens": 4, "stream": True,
                      "stop_sequences": ["e"]}),
    ("/v1/chat/completions", {"model": "tools", "messages": ASK, "max_tokens": 40, "n": 2,
                              "stream": True, "tools": [{"type": "function",
                                                         "function": WEATHER}]}),
    ("/v1/completions", {"model": "default", "prompt": ["Once", [1, 2, 3]], "n": 2,
                         "max_tokens": 4, "logprobs": 2}),
    ("/v1/completions", {"model": "default", "prompt": "Once", "max_tokens": 4, "n": 2,
                         "stream": True, "logprobs": 2, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "default", "prompt": [1, 2, 3], "max_tokens": 4,
                         "stream": True, "echo": True}),
    ("/v1/responses", {"model": "tools", "input": "Weather in Paris?", "max_output_tokens": 40,
                       "tools": [{"type": "function", **WEATHER}]}),
    ("/v1/responses", {"model": "tools", "input": "Weather in Paris?", "max_output_tokens": 40,
                       "stream": True, "tools": [{"type": "function", **WEATHER}]}),
    ("/v1/responses", {"model": "thinker", "input": "Hi", "max_output_tokens": 8,
                       "stream": True}),
    ("/v1/responses", {"model": "thinker", "input": "Hi", "max_output_tokens": 8}),
]


def scripted(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    """The scripted models by folder name; the embedded model otherwise."""
    if folder is not None and folder.name == "tools":
        return tool_model()[0]
    if folder is not None and folder.name == "thinker":
        return thinker_model()
    return build("tiny", options={"num_slots": cfg.num_slots})


def test_scripted_answers_conform(tmp_path: Path) -> None:
    models = {"default": None, "tools": Path("tools"), "thinker": Path("thinker")}
    gateway = Gateway(config(tmp_path, api_keys=[KEY], models=models), scripted)
    with running(gateway) as url:
        schema = load(url)
        for path, body in SCRIPTED:
            fuzz = Fuzz(schema[path]["POST"])
            fuzz.send(fuzz.operation.Case(body=body, media_type=JSON,
                                          headers={"authorization": f"Bearer {KEY}"}))
            assert fuzz.statuses == {200: 1} and not fuzz.failures, (body, fuzz.failures)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_the_server_conforms_to_its_own_document(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 method: str, path: str) -> None:
    gateway = Gateway(config(tmp_path, api_keys=[KEY], max_context=MAX_CONTEXT,
                             default_max_tokens=MAX_TOKENS))
    # a request left open on a stuck engine must not hold up the server's shutdown
    with running(gateway) as url:
        fuzz = Fuzz(load(url)[path][method])
        for mode in EXAMPLES:
            if mode is GenerationMode.POSITIVE or negatable(fuzz.operation):
                fuzz.run(mode)
    TOTAL.update(fuzz.statuses)
    with capsys.disabled():
        print(f"\nschemathesis {method} {path}: {counts(fuzz.statuses)}, "
              f"{len(fuzz.failures)} failing")
    for failure in fuzz.failures:  # shown with the failure
        print(failure)
    assert not fuzz.failures, (f"{len(fuzz.failures)} failing requests (printed above); "
                               f"first: {next(iter(fuzz.failures))}")
