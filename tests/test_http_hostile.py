"""One request must never take the server down: every hostile class seen against the server,
each followed by a normal streamed request that must finish within a bound and a ``/metrics``
scrape, under a memory guard.

Loopback only, bounded in count and time. The server runs in this process, so the guard reads
this process's peak resident memory around each hostile request (``/proc/self/clear_refs``
resets the peak; where that is unavailable the growth of the resident set is used). The
figures (requests sent, status counts, 5xx, hangs, worst memory growth per request) are
printed at the end of the module, e.g. ``pytest -s tests/test_http_hostile.py``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.text import Renderer
from pipeline.testing import ScriptedBackend, peaked
from pipeline.contracts.request import ToolSpec
from pipeline.contracts.text import Rendered
from stages.tokenize import HFTokenizer
from tests.http_support import config, endless_model, fragile_model, running
from transports.http import Gateway
from transports.http.server.limits import Limits

KEY = "sk-hostile"
AUTH = {"authorization": f"Bearer {KEY}"}
STATS: dict[str, Any] = {"sent": 0, "statuses": Counter(), "hangs": 0, "worst_growth_mb": 0.0}
MEMORY_BOUND_MB = 200.0
"""Most a single hostile request may grow this process's peak memory by."""
NORMAL_BOUND_S = 10.0


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class MemoryGuard:
    """Peak resident memory growth of this process across one request."""

    def __enter__(self) -> MemoryGuard:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.key = "VmHWM"
        except OSError:
            self.key = "VmRSS"
        self.before = _status_kb("VmRSS")
        return self

    def __exit__(self, *_: object) -> None:
        self.growth_mb = max(0, _status_kb(self.key) - self.before) / 1024
        STATS["worst_growth_mb"] = max(STATS["worst_growth_mb"], self.growth_mb)
        assert self.growth_mb < MEMORY_BOUND_MB, f"one request grew memory {self.growth_mb} MB"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Gateway]]:
    gateway = Gateway(config(tmp_path_factory.mktemp("hostile"), api_keys={KEY},
                             max_context=512, default_max_tokens=4))
    with running(gateway) as url, httpx.Client(base_url=url, timeout=30, headers=AUTH) as c:
        yield c, gateway
    print(f"\nhostile suite: {STATS['sent']} requests, statuses {dict(STATS['statuses'])}, "
          f"5xx {sum(n for s, n in STATS['statuses'].items() if s >= 500)}, "
          f"hangs {STATS['hangs']}, worst peak memory growth per request "
          f"{STATS['worst_growth_mb']:.1f} MB")


def send(client: httpx.Client, path: str, body: bytes | dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    """One hostile request under the memory guard; afterwards the server must still stream a
    normal answer within the bound and answer ``/metrics``."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with MemoryGuard():
        try:
            response = client.post(path, content=content, headers={
                "content-type": "application/json", **(headers or {})})
        except httpx.TimeoutException:
            STATS["hangs"] += 1
            raise
    STATS["sent"] += 1
    STATS["statuses"][response.status_code] += 1
    assert response.status_code < 500, (path, response.status_code, response.text[:300])
    still_serving(client)
    return response


def still_serving(client: httpx.Client) -> None:
    started = time.monotonic()
    body = {"model": "default", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert time.monotonic() - started < NORMAL_BOUND_S
    assert client.get("/metrics").status_code == 200


def chat(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return body


def error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    return body["error"]  # type: ignore[no-any-return]


# --- sizes ----------------------------------------------------------------------------------

def test_a_megabyte_stop_string_is_refused_naming_the_limit(server: Any) -> None:
    client, _ = server
    r = send(client, "/v1/chat/completions", chat(stop=["x" * (1 << 20)]))
    assert r.status_code == 400
    e = error(r)
    assert e["code"] == "limit_exceeded" and e["limit"] == "max_stop_chars"
    assert e["value"] == 1 << 20 and e["maximum"] == Limits().max_stop_chars
    assert e["param"] == "stop[0]"
    r = send(client, "/v1/messages", {**chat(), "stop_sequences": ["s"] * 17})
    assert r.status_code == 400 and r.json()["error"]["limit"] == "max_stop"


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server: Any) -> None:
    client, _ = server
    prompt = "word " * ((5 << 20) // 5)  # 5 MiB
    started = time.monotonic()
    r = send(client, "/v1/chat/completions", chat(messages=[{"role": "user", "content": prompt}]))
    assert r.status_code == 413 and time.monotonic() - started < 5
    assert error(r)["limit"] == Limits().max_body_bytes
    # a chunked body (no Content-Length) is cut off while it streams in
    def chunks() -> Iterator[bytes]:
        for _ in range(80):
            yield b" " * 65536
    r2 = client.post("/v1/chat/completions", content=chunks(),
                     headers={"content-type": "application/json"})
    assert r2.status_code == 413
    r3 = client.post("/v1/chat/completions", content=b"{}",
                     headers={"content-type": "application/json", "content-length": "2"})
    assert r3.status_code == 400


def test_many_messages_are_refused_before_rendering(server: Any) -> None:
    client, _ = server
    messages = [{"role": "user", "content": "x"}] * 10_000
    started = time.monotonic()
    r = send(client, "/v1/messages/count_tokens", {"model": "default", "messages": messages})
    assert r.status_code == 400 and time.monotonic() - started < 5
    assert r.json()["error"]["limit"] == "max_messages"
    # content blocks count too: one message of 30,000 tool results renders 30,000 messages
    blocks = [{"type": "tool_result", "tool_use_id": "a"}] * 30_000
    started = time.monotonic()
    r = send(client, "/v1/messages/count_tokens",
             {"model": "default", "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 400 and time.monotonic() - started < 5
    assert r.json()["error"]["limit"] == "max_messages"
    assert r.json()["error"]["value"] == 30_001


def test_tool_count_and_schema_size_are_bounded(server: Any) -> None:
    client, _ = server
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = send(client, "/v1/chat/completions", chat(tools=[tool] * 129))
    assert r.status_code == 400 and error(r)["limit"] == "max_tools"
    big = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "description": "d" * 70_000}}}
    r = send(client, "/v1/chat/completions", chat(tools=[big]))
    assert r.status_code == 400 and error(r)["limit"] == "max_tool_schema_bytes"
    assert error(r)["param"] == "tools[0]"


def test_the_template_refusing_a_conversation_is_a_400(server: Any) -> None:
    client, _ = server
    # caller text that uses up every private-use character the renderer marks spans with
    every = "".join(chr(c) for c in range(0x100000, 0x10FFFE))
    r = send(client, "/v1/chat/completions",
             chat(messages=[{"role": "user", "content": every}]))
    assert r.status_code == 400 and error(r)["code"] == "template_error"


def test_detokenize_is_bounded_by_the_window(server: Any) -> None:
    client, gateway = server
    window = gateway.window_fit.window(gateway.model("default"))
    r = send(client, "/detokenize", {"model": "default", "tokens": [100] * (window + 1)})
    assert r.status_code == 400 and error(r)["limit"] == "max_model_len"
    r = send(client, "/detokenize", {"model": "default", "tokens": [100] * window})
    assert r.status_code == 200


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1" * 40, "-1", " 5"])
def test_logit_bias_keys_are_ascii_token_ids(server: Any, key: str) -> None:
    client, _ = server
    body = b'{"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}],' \
        b' "logit_bias": {"' + key.encode() + b'": 1}}'
    r = send(client, "/v1/chat/completions", body)
    assert r.status_code == 400 and error(r)["param"] == "logit_bias"


def test_logit_bias_entries_are_bounded(server: Any) -> None:
    client, _ = server
    r = send(client, "/v1/chat/completions",
             chat(logit_bias={str(i): 1 for i in range(Limits().max_logit_bias + 1)}))
    assert r.status_code == 400 and error(r)["limit"] == "max_logit_bias"


def test_a_body_of_a_million_tiny_objects_stays_under_the_memory_guard(server: Any) -> None:
    client, _ = server
    tiny = b",".join([b"{}"] * ((4 << 20) // 3 - 100))  # just under the body limit
    r = send(client, "/v1/chat/completions",
             b'{"model": "default", "messages": [], "user": [' + tiny + b"]}")
    assert r.status_code == 400 and len(r.text) < 1000  # the echoed value is cut short


def test_deep_nesting_is_refused(server: Any) -> None:
    client, _ = server
    deep = b'{"model": "default", "messages": ' + b"[" * 100 + b"]" * 100 + b"}"
    r = send(client, "/v1/chat/completions", deep)
    assert r.status_code == 400 and error(r)["limit"] == "max_json_depth"
    r = send(client, "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400


def test_prompt_characters_are_bounded_before_tokenizing(server: Any) -> None:
    client, gateway = server
    long = [{"role": "user", "content": "a" * 600_000}, {"role": "user", "content": "b" * 500_000}]
    r = send(client, "/v1/chat/completions", chat(messages=long))
    assert r.status_code == 400 and error(r)["limit"] == "max_prompt_chars"
    # every string counts, keys and roles too
    assert error(r)["value"] == 1_100_000 + 2 * len("user") + 2 * len("role" + "content")
    # within the character limit but far beyond the 512-token window at any token length:
    # refused from its length alone, without tokenizing
    served = gateway.model("default")
    chars = 512 * served.token_chars * 2
    r = send(client, "/v1/chat/completions",
             chat(messages=[{"role": "user", "content": "z" * chars}]))
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    assert "at least" in error(r)["message"]


def test_raw_completion_prompts_are_bounded(server: Any) -> None:
    """A token-id prompt of nearly two million ids, a batch of long texts, and a request for
    more choices than --max-n: each refused with the numbers, none tokenized in vain."""
    client, gateway = server
    ids = b'{"model": "default", "prompt": [' + b",".join([b"5"] * 1_900_000) + b"]}"
    r = send(client, "/v1/completions", ids)
    assert r.status_code == 400 and error(r)["code"] == "context_length_exceeded"
    assert error(r)["prompt_tokens"] == 1_900_000 and error(r)["param"] == "prompt"
    served = gateway.model("default")
    long = "z" * (512 * served.token_chars * 2)
    started = time.monotonic()
    r = send(client, "/v1/completions", {"model": "default", "prompt": ["hi", long] * 4})
    assert r.status_code == 400 and error(r)["param"] == "prompt[1]"
    assert "at least" in error(r)["message"] and time.monotonic() - started < NORMAL_BOUND_S
    r = send(client, "/v1/completions", {"model": "default", "prompt": ["a"] * 8, "n": 3})
    assert r.status_code == 400 and error(r)["limit"] == "max_n" and error(r)["value"] == 24
    r = send(client, "/v1/chat/completions", chat(n=10**9))
    assert r.status_code == 400 and error(r)["limit"] == "max_n"


# --- numbers --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {"top_p": 1e-320}, {"top_p": 5e-324}, {"temperature": 1e-320}, {"min_p": 1e-320},
    {"top_p": 1e-320, "temperature": 1.9}, {"frequency_penalty": 1e-320},
    {"presence_penalty": -0.0}, {"repetition_penalty": 0.01}, {"temperature": 2.0},
])
def test_numeric_edges_work(server: Any, fields: dict[str, float]) -> None:
    client, _ = server
    r = send(client, "/v1/chat/completions", chat(seed=3, **fields))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("body", [
    b'{"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],'
    b' "temperature": 1e999}',
    b'{"model": "default", "max_tokens": 1e999, "messages": []}',
    b'{"model": "default", "max_tokens": 3, "messages": [], "top_p": NaN}',
    b'{"model": "default", "max_tokens": 3, "messages": [], "seed": ' + b"9" * 5000 + b"}",
])
def test_numeric_edges_that_cannot_work_are_400s(server: Any, body: bytes) -> None:
    client, _ = server
    assert send(client, "/v1/chat/completions", body).status_code == 400


@pytest.mark.parametrize("fields", [{"repetition_penalty": 1e-320}, {"max_tokens": 2**31},
                                    {"top_k": 2**70}, {"top_logprobs": 1e-320}])
def test_out_of_domain_numbers_are_400s_naming_the_field(server: Any,
                                                         fields: dict[str, Any]) -> None:
    client, _ = server
    r = send(client, "/v1/chat/completions", chat(**fields))
    assert r.status_code == 400 and error(r)["param"] == next(iter(fields))


# --- text -----------------------------------------------------------------------------------

LONE = "\ud800"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": f"a{LONE}"}]),
     "messages[0].content"),
    ("/v1/messages", {**chat(), "system": LONE}, "system"),
    ("/v1/messages/count_tokens", {"model": "default", "system": [{"type": "text", "text": LONE}],
                                   "messages": [{"role": "user", "content": "x"}]},
     "system[0].text"),
    ("/tokenize", {"model": "default", "prompt": LONE}, "prompt"),
    ("/v1/chat/completions", {**chat(), LONE: 1}, f"{LONE.encode('utf-8', 'backslashreplace').decode()} (the key)"),
    ("/v1/chat/completions", chat(model=LONE), "model"),
    ("/v1/messages", {**chat(), "model": "\udfff-x"}, "model"),
])
def test_lone_surrogates_are_400s_naming_the_field(server: Any, path: str, body: dict[str, Any],
                                                    param: str) -> None:
    client, _ = server
    r = send(client, path, body)
    assert r.status_code == 400
    got = r.json()["error"]
    assert got.get("param") == param and "lone surrogate" in got["message"]


def test_metrics_labels_stay_bounded(server: Any) -> None:
    client, _ = server
    for i in range(40):
        r = client.post("/v1/chat/completions", json=chat(model=f"model-{i}"))
        assert r.status_code == 404
    scrape = client.get("/metrics")
    assert scrape.status_code == 200
    models = {s.labels["model"] for family in text_string_to_metric_families(scrape.text)
              for s in family.samples if "model" in s.labels}
    assert models <= {"default", "other"} and "other" in models


# --- keys -----------------------------------------------------------------------------------

@pytest.mark.parametrize("headers, status, says", [
    ({"authorization": f"Bearer {KEY}", "x-api-key": KEY}, 200, None),
    ({"authorization": f"Bearer {KEY}", "x-api-key": "wrong"}, 401, "x-api-key"),
    ({"authorization": "Bearer wrong", "x-api-key": KEY}, 401, "Authorization"),
    ({"authorization": f"Basic {KEY}", "x-api-key": KEY}, 401, "Bearer scheme"),
    ({"x-api-key": KEY}, 200, None),
    ({"authorization": "Bearer"}, 401, "missing"),
    ([("x-api-key", KEY), ("x-api-key", "wrong")], 401, "x-api-key"),
    ([("authorization", f"Bearer {KEY}"), ("authorization", "Basic x")], 401, "Bearer scheme"),
    ([("authorization", f"Bearer {KEY}"), ("authorization", "Bearer wrong")], 401,
     "Authorization"),
])
def test_both_key_headers_must_be_valid_when_both_are_sent(
        server: Any, headers: dict[str, str] | list[tuple[str, str]], status: int,
        says: str | None) -> None:
    client, _ = server
    bare = httpx.Client(base_url=str(client.base_url), timeout=30)
    with bare:
        r = bare.post("/v1/chat/completions", json=chat(), headers=headers)
    assert r.status_code == status
    if says is not None:
        assert says in r.json()["error"]["message"]


# --- work for a client that has gone --------------------------------------------------------

class SlowRenderer:
    """The embedded model's template, slowed down, counting its calls: stands for a costly
    render of a long conversation."""

    def __init__(self, inner: Renderer, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.name, self.digest = inner.name, inner.digest
        self.calls = 0
        self._lock = threading.Lock()

    def render(self, messages: Sequence[Any], *, tools: Sequence[ToolSpec] = (),
               **kwargs: Any) -> Rendered:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return self.inner.render(messages, tools=tools, **kwargs)


def slow_pipeline(delay_s: float) -> Pipeline:
    """The endless scripted model behind a renderer that takes ``delay_s`` per call."""
    base, backend = endless_model()
    base.close()  # only its renderer is wanted
    assert base.stages.renderer is not None
    slow = SlowRenderer(base.stages.renderer, delay_s)
    return build(TINY_MODEL_DIR, backend=backend, renderer=slow)  # type: ignore[arg-type]


def test_work_for_clients_that_left_stops_and_cheap_requests_are_never_starved(
        tmp_path: Path) -> None:
    pipe = slow_pipeline(2.0)
    slow = pipe.stages.renderer
    assert isinstance(slow, SlowRenderer)
    gateway = Gateway(config(tmp_path, work_threads=1, work_queue=8), lambda f, c: pipe)
    with running(gateway) as url:
        body = {"model": "default", "messages": [{"role": "user", "content": "count me"}]}
        # six clients ask for a count and leave after 0.2 s: the first render is under way
        # (it finishes: a thread cannot be interrupted); the five waiting behind it have all
        # left before it ends (a render takes 2 s: room for a loaded machine), so none runs
        for _ in range(6):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=0.2)
        started = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # never in the pool
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0
        time.sleep(2.5)
        assert slow.calls <= 2
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=10)
        assert r.status_code == 200 and time.monotonic() - started < 5.0
        assert gateway.admission.flights == {} and pipe.engine is not None and pipe.engine.active_slots == 0


def test_a_full_preparation_pool_is_an_overload_not_a_queue(tmp_path: Path) -> None:
    pipe = slow_pipeline(0.5)
    slow = pipe.stages.renderer
    assert isinstance(slow, SlowRenderer)
    gateway = Gateway(config(tmp_path, work_threads=1, work_queue=1), lambda f, c: pipe)
    with running(gateway) as url:
        body = {"model": "default", "messages": [{"role": "user", "content": "x"}]}
        results: list[int] = []

        def count() -> None:
            results.append(httpx.post(f"{url}/v1/messages/count_tokens", json=body,
                                      timeout=10).status_code)

        threads = [threading.Thread(target=count) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(15)
        assert sorted(results) == [200, 200, 529, 529]  # Anthropic's overloaded status


# --- an engine that stops -------------------------------------------------------------------

def test_an_engine_that_stops_is_reported_refused_and_restarted(tmp_path: Path) -> None:
    pipe, backend, armed = fragile_model("the model process vanished")
    gateway = Gateway(config(tmp_path, restart_delay_s=2.0), lambda f, c: pipe)
    with running(gateway) as url, httpx.Client(base_url=url, timeout=10) as client:
        armed.set()
        failed = client.post("/v1/chat/completions", json=chat(max_tokens=50))
        assert failed.status_code == 503 and "retry" in failed.text  # a retryable 503
        assert "vanished" not in failed.text  # no detail leaks
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "engine_stopped", "models": {"default": "restarting"},
                                 "reasons": {"engine:default": "engine_stopped"}}
        details = client.get("/health/details")  # the operator's: why, in words
        assert details.status_code == 503
        assert "Fatal" in details.json()["engine_failures"]["default"]
        started = time.monotonic()
        refused = client.post("/v1/chat/completions", json=chat())
        assert refused.status_code == 503 and time.monotonic() - started < 1.0
        assert "a fresh one is starting" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "no fresh engine"
            time.sleep(0.05)
        assert client.get("/health/details").json()["restarts"] == {"default": 1}
        again = client.post("/v1/chat/completions", json=chat(max_tokens=3))
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == "aaa"
        assert backend.busy_slots == 0 and pipe.engine.active_slots == 0


def test_response_format_schemas_are_bounded_and_cannot_stall_the_server(server: Any) -> None:
    client, _ = server
    big = {"type": "object", "description": "d" * 70_000}
    r = send(client, "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": big}}))
    assert r.status_code == 400 and error(r)["limit"] == "max_tool_schema_bytes"
    assert error(r)["param"] == "response_format.json_schema.schema"
    r = send(client, "/v1/messages", {"model": "default", "max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"}], "output_config": {"format": {
            "type": "json_schema", "schema": big}}})
    assert r.status_code == 400 and r.json()["error"]["limit"] == "max_tool_schema_bytes"
    # a pattern whose deterministic automaton is exponential, and a schema nested deeply:
    # the grammar engine's own limits answer (a 400, or an output cut short), quickly
    for schema in ({"type": "string", "pattern": "^(a|b)*a(a|b){40}$"},
                   {"type": "string", "pattern": "^(x+x+)+y$"},
                   {"type": "array", "items": {"enum": [f"v{i}" for i in range(3000)]}}):
        started = time.monotonic()
        r = send(client, "/v1/chat/completions", chat(max_tokens=16, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
        assert r.status_code in (200, 400) and time.monotonic() - started < 10, r.text
