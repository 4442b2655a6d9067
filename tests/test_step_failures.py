"""Every failure inside an engine step reaches the caller as a failure (issue 21).

A fault is injected at each part of a step — a logit processor, the llguidance ``grammar``
processor (real engine failures, no fake), the backend's forward, the strategy's update, the
detokenizer — after two tokens were streamed, and the caller must see a failure: in process
the handle raises :class:`~pipeline.errors.RequestFailed` and its trace ends in a failed
``generation.finished``; over HTTP (OpenAI chat and legacy completions, Anthropic messages)
a non-streamed request gets the dialect's 500 with no internal detail, a stream ends with the
dialect's error event and never a ``stop`` / ``end_turn`` finish, the usage row says
``error``, and the server log has the cause. A JSON schema that requires itself is refused
before generation, as a 400 naming the cycle.

Oracles: the injected faults are known by construction, the SSE frames are parsed as the
dialects define them, and the usage rows are read back from SQLite by a separate connection.
One gateway serves every faulty model, in process (Starlette's test client), so the module
runs in a few seconds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from starlette.testclient import TestClient

from pipeline.builder import build
from pipeline.errors import InvalidValueError, RequestFailed
from pipeline.grammar import JSON_LAYOUT, Grammar
from pipeline.engine.handle import RequestHandle, RequestState
from pipeline.hookspecs import hookimpl
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.registry import Component
from pipeline.testing import ScriptedBackend, peaked
from pipeline.contracts.output import FinishReason
from stages.detokenize.incremental import IncrementalDetokenizer
from stages.strategies import AutoregressiveStrategy
from stages.tokenize import HFTokenizer
from tests.http_support import config
from transports.http import Gateway, create_app
from transports.http.accounting.usage import read_records

TOKENIZER = HFTokenizer.from_dir(TINY_MODEL_DIR)
AT = TOKENIZER.encode_text("@")[0]
"""The token the scripted model writes, over and over; no prompt here contains it."""
FAULT_AT = 3
"""The output step at which a fault fires: two tokens were committed and streamed before."""

RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
"""The issue's schema: ``a`` is required and is the schema itself, so no JSON value is
finite. It compiles; before issue 21 the engine failed at ``{`` and the answer was ``{``
with a ``stop``."""
PATTERNED = {"type": "object", "patternProperties": {"^a$": {"$ref": "#"}}, "required": ["a"]}
"""The same cycle through ``patternProperties``, which the up-front check does not follow:
the engine itself fails mid-step (its parser's item limit)."""
AFTER_A_CHOICE = Grammar.lark('start: ("yes" | "no") " " %json '
                              + json.dumps({**RECURSIVE, "x-guidance": JSON_LAYOUT}) + "\n")
"""A free choice first, then the endless schema: the engine fails after two tokens."""


class Injected(RuntimeError):
    """The fault every injected stage raises (its message names the stage)."""


def at_fault(rows: Sequence[Row]) -> bool:
    return any(row.step >= FAULT_AT for row in rows)


class FaultyProcessor:
    """A logit processor that raises once a row reaches step ``FAULT_AT``."""

    name = "faulty"
    argmax_invariant = False

    def active(self, row: Row) -> bool:
        return True

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        if at_fault(batch.rows):
            raise Injected("injected fault in a logit processor")
        return scores


class FaultyStrategy(AutoregressiveStrategy):
    """Autoregressive, except that its update raises once a row reaches ``FAULT_AT``."""

    name = "faulty_ar"

    def update(self, states: Sequence[Any], rows: Sequence[Row], logits: Sequence[Any]
               ) -> Any:
        if at_fault(rows):
            raise Injected("injected fault in the strategy's update")
        return super().update(states, rows, logits)


class FaultyStrategyPlugin:
    """Registers :class:`FaultyStrategy` as ``faulty_ar``, as a third party would."""

    @hookimpl
    def pipeline_components(self) -> list[Component]:
        return [Component("strategy", "faulty_ar", lambda ctx: FaultyStrategy)]


class FaultyDetokenizer:
    """The real incremental detokenizer, raising at output token ``FAULT_AT``."""

    def __init__(self) -> None:
        self.inner = IncrementalDetokenizer(TOKENIZER)

    def start(self, prompt_ids: Sequence[int]) -> tuple[Any, int]:
        return self.inner.start(prompt_ids), 0

    def step(self, state: tuple[Any, int], token_id: int) -> tuple[tuple[Any, int], str]:
        inner, done = state
        if done + 1 >= FAULT_AT:
            raise Injected("injected fault in the detokenizer")
        inner, text = self.inner.step(inner, token_id)
        return (inner, done + 1), text

    def finish(self, state: tuple[Any, int]) -> str:
        return self.inner.finish(state[0])


def backend(faulty: bool = False) -> ScriptedBackend:
    """Writes "@" for ever; ``faulty``: its forward raises once the slot holds ``FAULT_AT``
    of them (the step that would feed the third)."""

    def choose(tokens: Sequence[int]) -> int:
        if faulty and tokens.count(AT) >= FAULT_AT - 1:
            raise Injected("injected fault in the backend's forward")
        return AT

    return ScriptedBackend(TOKENIZER.vocab_size, peaked(TOKENIZER.vocab_size, choose, 30.0))


def faulty_pipelines() -> dict[str, Pipeline]:
    """One pipeline per injection point (and ``healthy``, for the grammar cases: its
    ``grammar`` processor is the real one), the tiny model's tokenizer and template over a
    scripted backend."""
    tiny = {"tokenizer": TOKENIZER}
    return {
        "healthy": build(TINY_MODEL_DIR, backend=backend(), **tiny),
        "processor": build(TINY_MODEL_DIR, backend=backend(), processors=[FaultyProcessor()],
                           **tiny),
        "forward": build(TINY_MODEL_DIR, backend=backend(faulty=True), **tiny),
        "strategy": build(TINY_MODEL_DIR, backend=backend(), strategy="faulty_ar",
                          plugins=[FaultyStrategyPlugin()], **tiny),
        "detokenizer": build(TINY_MODEL_DIR, backend=backend(), detokenizer=FaultyDetokenizer(),
                             **tiny),
    }


INJECTED = ["processor", "forward", "strategy", "detokenizer"]


# --- in process ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipes() -> Iterator[dict[str, Pipeline]]:
    made = faulty_pipelines()
    yield made
    for pipe in made.values():
        pipe.close()


def failed_in_process(handle: RequestHandle) -> RequestFailed:
    """Stream ``handle`` to its end, then check that it failed every way a caller can see."""
    deltas = list(handle.deltas(timeout=20))
    assert deltas[-1].finish_reason is FinishReason.ERROR
    assert all(d.finish_reason in (None, FinishReason.ERROR) for d in deltas)
    with pytest.raises(RequestFailed) as failed:
        handle.result(timeout=20)
    assert handle.state is RequestState.FAILED
    completion = failed.value.completion  # type: ignore[attr-defined]
    assert completion.finish_reason is FinishReason.ERROR and completion.error
    finished = [e for e in completion.trace if e.event_type == "generation.finished"]
    assert len(finished) == 1
    assert finished[0].payload["reason"] == "error"
    assert finished[0].payload["state"] == "failed"
    assert finished[0].payload["detail"] == completion.error
    return failed.value


@pytest.mark.parametrize("where", INJECTED)
def test_an_injected_fault_fails_the_request_in_process(pipes: dict[str, Pipeline],
                                                        where: str) -> None:
    handle = pipes[where].submit("hi", max_tokens=10, temperature=0)
    failure = failed_in_process(handle)
    assert "injected fault" in failure.cause
    # what was streamed before the fault is the model's: two "@"s, no more
    assert failure.completion.text == "@" * (FAULT_AT - 1)  # type: ignore[attr-defined]
    # the engine goes on: the healthy model's next request completes normally
    done = pipes["healthy"].generate("hi", max_tokens=4, temperature=0)
    assert done.text == "@@@@" and done.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("grammar", [Grammar.json_schema(PATTERNED), AFTER_A_CHOICE],
                         ids=["pattern-properties", "lark-after-a-choice"])
def test_a_grammar_engine_failure_mid_step_fails_the_request(pipes: dict[str, Pipeline],
                                                             grammar: Grammar) -> None:
    handle = pipes["healthy"].submit("hi", max_tokens=20, temperature=0, grammar=grammar)
    failure = failed_in_process(handle)
    assert "the grammar engine failed" in failure.cause
    assert "Too many items" in failure.cause  # llguidance's own reason, not a guess
    assert failure.completion.finish_reason is FinishReason.ERROR  # type: ignore[attr-defined]


def test_a_grammar_failure_fails_only_its_own_request(pipes: dict[str, Pipeline]) -> None:
    # the grammar is the client's: requests batched beside it in the same step go on
    good = [pipes["healthy"].submit(f"hi {i}", max_tokens=300, temperature=0) for i in range(3)]
    next(good[-1].deltas(timeout=20))  # running, not queued
    bad = pipes["healthy"].submit("hi", max_tokens=20, temperature=0,
                                  grammar=Grammar.json_schema(PATTERNED))
    failed_in_process(bad)
    assert not any(h.done() for h in good)  # they shared its steps
    for handle in good:
        done = handle.result(timeout=20)
        assert done.text == "@" * 300 and done.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("schema", [
    RECURSIVE,
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}},
                     "required": ["b"]},
               "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}},
                     "required": ["a"]}},
     "$ref": "#/$defs/A"},
    {"anyOf": [RECURSIVE, {"type": "object", "properties": {"b": {"$ref": "#"}},
                           "required": ["b"]}]},
], ids=["required-self", "non-empty-array-of-self", "mutual", "every-alternative"])
def test_a_schema_without_a_finite_value_is_refused_when_made(schema: dict[str, Any]) -> None:
    with pytest.raises(InvalidValueError, match="no finite JSON value satisfies it") as refused:
        Grammar.json_schema(schema)
    assert "requires itself" in str(refused.value) and "#" in str(refused.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},                  # a is optional
    {"type": "array", "items": {"$ref": "#"}},                               # [] ends it
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},                 # any type: null
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"anyOf": [RECURSIVE, {"type": "null"}]},
    {"type": "object", "required": ["v", "kids"],
     "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}},
], ids=["optional", "empty-array", "untyped", "nullable", "an-alternative", "tree"])
def test_a_recursive_schema_with_a_finite_value_is_accepted(schema: dict[str, Any],
                                                            pipes: dict[str, Pipeline]) -> None:
    grammar = Grammar.json_schema(schema)
    done = pipes["healthy"].generate("hi", max_tokens=40, temperature=0, grammar=grammar)
    assert done.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)


# --- over HTTP -------------------------------------------------------------------------------

KEY = "sk-step-failures"
AUTH = {"authorization": f"Bearer {KEY}"}
ENDPOINTS = ["chat", "completions", "messages"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    made = faulty_pipelines()
    data = tmp_path_factory.mktemp("step-failures")
    order = iter(made.values())
    gateway = Gateway(config(data, api_keys={KEY}, models={name: TINY_MODEL_DIR for name in made}),
                      lambda folder, cfg: next(order))
    gateway.loader.load(wait=True)
    with TestClient(create_app(gateway), raise_server_exceptions=False) as c:
        c.gateway = gateway  # type: ignore[attr-defined]
        yield c


def request(endpoint: str, model: str, stream: bool, **extra: Any) -> tuple[str, dict[str, Any]]:
    """The path and body of a small request to ``model`` on ``endpoint``."""
    body: dict[str, Any] = {"model": model, "max_tokens": 10, "temperature": 0,
                            "stream": stream, **extra}
    if endpoint == "completions":
        return "/v1/completions", {"prompt": "hi", **body}
    messages = [{"role": "user", "content": "hi"}]
    return ("/v1/chat/completions" if endpoint == "chat" else "/v1/messages",
            {"messages": messages, **body})


def sse(text: str) -> list[tuple[str | None, str]]:
    """A stream's frames as (event name, data), comments skipped."""
    frames = []
    for block in text.split("\n\n"):
        event, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            frames.append((event, "\n".join(data)))
    return frames


def assert_stream_failed(endpoint: str, text: str) -> dict[str, Any]:
    """The stream ended with its dialect's error event and never finished normally; returns
    the error object."""
    frames = sse(text)
    assert frames, text
    event, last = frames[-1]
    if endpoint == "messages":
        assert event == "error", text
        body = json.loads(last)
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        assert all(e not in ("message_stop", "message_delta") for e, _ in frames)
        assert '"end_turn"' not in text
        return body["error"]  # type: ignore[no-any-return]
    assert last != "[DONE]" and all(d != "[DONE]" for _, d in frames)
    body = json.loads(last)
    assert set(body) == {"error"} and body["error"]["type"] == "server_error"
    for _, data in frames[:-1]:
        for choice in json.loads(data).get("choices", []):
            assert choice.get("finish_reason") is None, data  # no "stop", no "length"
    return body["error"]  # type: ignore[no-any-return]


def assert_answer_failed(endpoint: str, response: Any) -> dict[str, Any]:
    assert response.status_code == 500, response.text
    body = response.json()
    if endpoint == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
    else:
        assert body["error"]["type"] == "server_error"
    return body["error"]  # type: ignore[no-any-return]


def fails_over_http(client: TestClient, endpoint: str, model: str, stream: bool,
                    caplog: pytest.LogCaptureFixture, cause: str, **extra: Any) -> None:
    """The request fails in its dialect's shape, tells the client nothing internal, logs
    ``cause`` on the server, and leaves a usage row that says ``error``."""
    path, body = request(endpoint, model, stream, **extra)
    before = {r.request_id for r in read_records(client.gateway.usage.path)}  # type: ignore
    with caplog.at_level(logging.ERROR, logger="pipeline.serve"):
        response = client.post(path, json=body, headers=AUTH)
    if stream:
        assert response.status_code == 200  # the stream had begun: its last event says it
        error = assert_stream_failed(endpoint, response.text)
    else:
        error = assert_answer_failed(endpoint, response)
    assert error["message"] == "internal server error"
    assert cause not in response.text and "Injected" not in response.text  # nothing leaks
    assert cause in caplog.text  # the server's log has it
    rows = [r for r in read_records(client.gateway.usage.path)  # type: ignore[attr-defined]
            if r.request_id not in before]
    assert len(rows) == 1 and rows[0].model == model
    assert rows[0].finish_reason == "error" and cause in (rows[0].error or "")
    if stream:  # the trace is kept under the id the stream's headers gave
        trace = client.get(f"/traces/{response.headers['x-request-id']}", headers=AUTH)
        events = [json.loads(line) for line in trace.text.splitlines()]
        ends = [e for e in events if e["event_type"] == "generation.finished"]
        assert [e["payload"]["reason"] for e in ends] == ["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("where", INJECTED)
def test_an_injected_fault_fails_the_request_over_http(
        client: TestClient, caplog: pytest.LogCaptureFixture, where: str, endpoint: str,
        stream: bool) -> None:
    fails_over_http(client, endpoint, where, stream, caplog, "injected fault")


def schema_format(endpoint: str, schema: dict[str, Any]) -> dict[str, Any]:
    if endpoint == "messages":
        return {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "loop", "schema": schema}}}


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "messages"])
def test_a_grammar_engine_failure_mid_step_is_a_500_over_http(
        client: TestClient, caplog: pytest.LogCaptureFixture, endpoint: str,
        stream: bool) -> None:
    fails_over_http(client, endpoint, "healthy", stream, caplog,
                    "the grammar engine failed", **schema_format(endpoint, PATTERNED))


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
@pytest.mark.parametrize("endpoint", ["chat", "messages"])
def test_the_recursive_schema_is_a_400_before_generation(client: TestClient, endpoint: str,
                                                         stream: bool) -> None:
    path, body = request(endpoint, "healthy", stream, **schema_format(endpoint, RECURSIVE))
    before = len(read_records(client.gateway.usage.path))  # type: ignore[attr-defined]
    response = client.post(path, json=body, headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "no finite JSON value satisfies it" in error["message"]
    assert "# -> #/properties/a -> #" in error["message"]
    if endpoint == "chat":
        assert error["param"] == "response_format.json_schema.schema"
    assert len(read_records(client.gateway.usage.path)) == before  # nothing was generated
