"""Fuzzing the server with generated requests: client input never causes a 5xx.

Hypothesis builds request bodies for both dialects (and the token endpoints) from valid
fields, wrong types, out-of-range values, unknown fields and malformed JSON, and sends them to
a real server on 127.0.0.1 that serves the embedded model. At least 2,000 requests go out; every
answer must be a 2xx or a 4xx in the dialect's error shape, and the server must be healthy,
with no request left holding a slot, afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.http_support import config, running
from transports.http import Gateway

SENT = {"count": 0}
# Wrong-typed and out-of-range values, from a fixed list (generating arbitrary nested JSON
# costs more time than sending it, and these cover every JSON type and the numeric edges).
ANY = st.sampled_from([
    None, True, False, 0, -1, 7, 2**70, -2**70, 0.5, -1e308, 1e308, "", "x", "ü✓\u0000",
    "<|im_end|>", [], [1, "a"], [None], {}, {"a": 1}, {"type": "text"}, [[[]]],
    # numeric edges: denormals, the smallest normal, negative zero, near the float maximum
    5e-324, 1e-320, 2.2250738585072014e-308, -0.0, 1e-5, 9.99e-6, 1.7976931348623157e308,
    # invalid Unicode (json.dumps escapes it, so the bytes on the wire are valid UTF-8)
    "\ud800", "a\udfffb", {"\ud800": 1}, ["\udbff"], "x" * 5000,
])


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value, sometimes anything at all."""
    return st.one_of(valid, valid, valid, ANY)


TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "ok\udc00", "\ud83d\ude00"])
OPENAI_MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
     "content": field(TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                              "text": TEXT}), max_size=2))},
    optional={"name": field(TEXT), "tool_call_id": field(TEXT)})
TOOL = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(
    st.fixed_dictionaries({"name": field(st.from_regex(r"[a-z_]{1,8}", fullmatch=True))},
                          optional={"parameters": field(st.just({"type": "object"}))}))})
OPENAI = st.fixed_dictionaries(
    {"model": field(st.sampled_from(["default", "default", "nope", "\ud800"])),
     "messages": field(st.lists(OPENAI_MESSAGE, min_size=1, max_size=3))},
    optional={"max_tokens": field(st.integers(1, 3)), "max_completion_tokens": field(st.integers(1, 3)),
              "temperature": field(st.floats(0, 2)), "top_p": field(st.floats(0, 1)),
              "n": field(st.integers(1, 2)), "seed": field(st.integers(-5, 2**64)),
              "stop": field(TEXT | st.lists(TEXT, max_size=3)),
              "presence_penalty": field(st.floats(-2, 2)),
              "frequency_penalty": field(st.floats(-2, 2)),
              "logit_bias": field(st.dictionaries(st.sampled_from(["5", "70", "9999999"]),
                                                  st.integers(-100, 100), max_size=2)),
              "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 20)),
              "stream": field(st.booleans()),
              "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
              "tools": field(st.lists(TOOL, max_size=2)),
              "tool_choice": field(st.sampled_from(["auto", "none", "required"])),
              "user": field(TEXT), "bogus_field": ANY})
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": field(TEXT)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": field(TEXT),
                           "content": field(TEXT)}),
    ANY)
ANTHROPIC = st.fixed_dictionaries(
    {"model": field(st.sampled_from(["default", "default", "nope", "\ud800"])),
     "max_tokens": field(st.integers(1, 3)),
     "messages": field(st.lists(st.fixed_dictionaries({
         "role": field(st.sampled_from(["user", "assistant"])),
         "content": field(TEXT | st.lists(ANTHROPIC_BLOCK, max_size=2))}), min_size=1,
         max_size=3))},
    optional={"system": field(TEXT), "temperature": field(st.floats(0, 1)),
              "top_k": field(st.integers(0, 50)), "stop_sequences": field(st.lists(TEXT, max_size=2)),
              "stream": field(st.booleans()),
              "thinking": field(st.fixed_dictionaries({"type": st.just("enabled"),
                                                       "budget_tokens": st.integers(0, 4)})),
              "metadata": field(st.fixed_dictionaries({"user_id": TEXT})), "extra": ANY})
PATHS = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC,
         "/v1/messages/count_tokens": ANTHROPIC,
         "/tokenize": st.fixed_dictionaries({"model": field(st.just("default")),
                                             "prompt": field(TEXT)}),
         "/detokenize": st.fixed_dictionaries({"model": field(st.just("default")),
                                               "tokens": field(st.lists(st.integers(-3, 7000)))})}
BODY = st.one_of(st.sampled_from(sorted(PATHS)).flatmap(
    lambda p: st.tuples(st.just(p), PATHS[p].map(lambda b: json.dumps(b).encode()))),
    st.tuples(st.sampled_from(sorted(PATHS)), st.binary(max_size=30)))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Gateway]]:
    gateway = Gateway(config(tmp_path_factory.mktemp("fuzz"), max_context=256,
                             default_max_tokens=3))
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client, gateway


def check(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (path, response.status_code, response.text[:300])
    if response.status_code >= 400:
        body = response.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["message"]
        else:
            assert body["error"]["message"] and body["error"]["type"]


@settings(max_examples=2100, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(request=BODY)
def test_generated_requests_never_cause_a_5xx(server: tuple[httpx.Client, Gateway],
                                              request: tuple[str, bytes]) -> None:
    client, _ = server
    path, body = request
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    SENT["count"] += 1
    check(path, response)


def test_healthy_after_the_fuzzing(server: tuple[httpx.Client, Gateway]) -> None:
    client, gateway = server
    assert SENT["count"] >= 2000
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/chat/completions", json={
        "model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # metrics still render, and model labels stayed a bounded set (served names + "other")
    scrape = client.get("/metrics")
    assert scrape.status_code == 200
    labels = {s.labels["model"] for family in text_string_to_metric_families(scrape.text)
              for s in family.samples if "model" in s.labels}
    assert labels <= {"default", "other"}
    engine = gateway.model("default").pipe.engine
    assert engine is not None
    deadline = time.monotonic() + 10
    while engine.active_slots or engine.queue_depth:
        assert time.monotonic() < deadline
        time.sleep(0.01)
