"""One request must never take the server down: every hostile class seen against the server,
each followed by a normal streamed request that must finish within a bound and a ``/metrics``
scrape, under a memory guard, after which nothing of the hostile request may still be running.
No verdict rests on a stopwatch: "quickly" is shown by what did not happen (the template never
rendered, the text never tokenized, the body never sent), and slow work is held on events.

Loopback only, bounded in count and time. The server runs in this process, so the guard reads
this process's peak resident memory around each hostile request (``/proc/self/clear_refs``
resets the peak; where that is unavailable the growth of the resident set is used). The
figures (requests sent, status counts, 5xx, hangs, worst memory growth per request) are
printed at the end of the module, e.g. ``pytest -s tests/test_http_hostile.py``.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from contextlib import contextmanager
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
from transports.http.server.work import Workers

KEY = "sk-hostile"
AUTH = {"authorization": f"Bearer {KEY}"}
STATS: dict[str, Any] = {"sent": 0, "statuses": Counter(), "hangs": 0, "worst_growth_mb": 0.0}
MEMORY_BOUND_MB = 200.0
"""Most a single hostile request may grow this process's peak memory by."""
SERVING: list[Gateway] = []
"""The module's server's gateway, for :func:`still_serving`'s look at what is left running."""


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
        SERVING.append(gateway)
        yield c, gateway
        SERVING.clear()
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


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` until it holds; ``timeout`` only guards against a hang."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def idle(gateway: Gateway) -> bool:
    """No generation in flight and no engine slot taken: nothing left over."""
    engines = [m.pipeline.engine for m in gateway.models.values()
               if m.pipeline is not None and m.pipeline.engine is not None]
    return not gateway.admission.flights and all(e.active_slots == 0 and e.queue_depth == 0
                                       for e in engines)


def still_serving(client: httpx.Client) -> None:
    """A normal streamed answer, a ``/metrics`` scrape, and then nothing left running: a
    hostile request that left work behind (a slot held, a generation in flight) fails here,
    whatever the machine's load (the client's timeout guards only against a hang)."""
    body = {"model": "default", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hello"}]}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert client.get("/metrics").status_code == 200
    for gateway in SERVING:
        wait_for(lambda: idle(gateway), "work of a finished request is left running")


@contextmanager
def calls_to(obj: object, method: str) -> Iterator[list[tuple[Any, ...]]]:
    """Record the positional arguments of every call to ``obj.method`` meanwhile."""
    inner = getattr(obj, method)
    seen: list[tuple[Any, ...]] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(args)
        return inner(*args, **kwargs)

    setattr(obj, method, recorded)
    try:
        yield seen
    finally:
        delattr(obj, method)


@contextmanager
def tokenized(tokenizer: object) -> Iterator[list[str]]:
    """The texts ``tokenizer`` is asked to encode meanwhile, by any of its encoding methods."""
    texts: list[str] = []
    inner = {name: getattr(tokenizer, name) for name in ("encode", "encode_text",
                                                            "encode_document")
             if hasattr(tokenizer, name)}

    def recorder(name: str) -> Callable[..., Any]:
        def recorded(what: Any, *args: Any, **kwargs: Any) -> Any:
            texts.append(what if isinstance(what, str) else what.text)
            return inner[name](what, *args, **kwargs)
        return recorded

    for name in inner:
        setattr(tokenizer, name, recorder(name))
    try:
        yield texts
    finally:
        for name in inner:
            delattr(tokenizer, name)


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
    r = send(client, "/v1/chat/completions", chat(messages=[{"role": "user", "content": prompt}]))
    assert r.status_code == 413
    assert error(r)["limit"] == Limits().max_body_bytes
    # before it is read: a client that announces 5 MiB and sends none of it is answered
    host, port = str(client.base_url).removeprefix("http://").rstrip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(prompt))
        head = sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 "), head[:200]
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
    client, gateway = server
    renderer = gateway.model("default").pipe.stages.renderer
    messages = [{"role": "user", "content": "x"}] * 10_000
    with calls_to(renderer, "render") as rendered:
        r = send(client, "/v1/messages/count_tokens", {"model": "default", "messages": messages})
    assert r.status_code == 400
    assert all(len(args[0]) == 1 for args in rendered)  # only still_serving's one message
    assert r.json()["error"]["limit"] == "max_messages"
    # content blocks count too: one message of 30,000 tool results renders 30,000 messages
    blocks = [{"type": "tool_result", "tool_use_id": "a"}] * 30_000
    with calls_to(renderer, "render") as rendered:
        r = send(client, "/v1/messages/count_tokens",
                 {"model": "default", "messages": [{"role": "user", "content": blocks}]})
    assert r.status_code == 400
    assert all(len(args[0]) == 1 for args in rendered)
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
    with tokenized(served.pipe.stages.tokenizer) as texts:
        r = send(client, "/v1/completions", {"model": "default", "prompt": ["hi", long] * 4})
    assert r.status_code == 400 and error(r)["param"] == "prompt[1]"
    assert "at least" in error(r)["message"]
    assert long not in texts  # refused from its length, never tokenized
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

class HeldRenderer:
    """The embedded model's template held on an event, counting its calls: stands for a
    costly render of a long conversation, lasting exactly as long as the test needs."""

    def __init__(self, inner: Renderer) -> None:
        self.inner = inner
        self.name, self.digest = inner.name, inner.digest
        self.calls = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()  # building the pipeline renders too: held only once armed
        self._lock = threading.Lock()

    def arm(self) -> None:
        """From now on every call is counted and held until :attr:`release` is set."""
        self.calls = 0
        self.started.clear()
        self.release.clear()

    def render(self, messages: Sequence[Any], *, tools: Sequence[ToolSpec] = (),
               **kwargs: Any) -> Rendered:
        with self._lock:
            self.calls += 1
        self.started.set()
        assert self.release.wait(120), "the test never released the render"
        return self.inner.render(messages, tools=tools, **kwargs)


def held_pipeline() -> Pipeline:
    """The endless scripted model behind a renderer that holds every call until released."""
    base, backend = endless_model()
    base.close()  # only its renderer is wanted
    assert base.stages.renderer is not None
    held = HeldRenderer(base.stages.renderer)
    return build(TINY_MODEL_DIR, backend=backend, renderer=held)  # type: ignore[arg-type]


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[Workers]:
    """Every request-preparation pool a job is submitted to meanwhile (to see its queue)."""
    seen: list[Workers] = []
    submit = Workers._submit

    def recorded(self: Workers, *args: Any) -> Any:
        if self not in seen:
            seen.append(self)
        return submit(self, *args)

    monkeypatch.setattr(Workers, "_submit", recorded)
    return seen


def sent(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A connection that has sent one whole JSON POST and reads nothing (close it to leave)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    content = json.dumps(body).encode()
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(content), content))
    return sock


def test_work_for_clients_that_left_stops_and_cheap_requests_are_never_starved(
        tmp_path: Path, pools: list[Workers]) -> None:
    pipe = held_pipeline()
    slow = pipe.stages.renderer
    assert isinstance(slow, HeldRenderer)
    gateway = Gateway(config(tmp_path, work_threads=1, work_queue=8), lambda f, c: pipe)
    with running(gateway) as url:
        slow.arm()
        body = {"model": "default", "messages": [{"role": "user", "content": "count me"}]}
        # six clients ask for a count and leave: the first one's render is under way (held;
        # it finishes: a thread cannot be interrupted); the five waiting behind it all leave
        # before it ends, so none of theirs runs
        first = sent(url, "/v1/messages/count_tokens", body)
        assert slow.started.wait(60)
        waiting = [sent(url, "/v1/messages/count_tokens", body) for _ in range(5)]
        wait_for(lambda: len(pools) == 1 and pools[0].pending == 6, "six jobs in the pool")
        for sock in [first, *waiting]:
            sock.close()
        wait_for(lambda: pools[0].pending == 1, "the five that left are dropped")
        # the pool's one thread is held: these are answered because they never enter it
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
        slow.release.set()
        wait_for(lambda: pools[0].pending == 0, "the held render ends")
        assert slow.calls <= 2
        r = httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=30)
        assert r.status_code == 200 and slow.calls == 2  # the first and this one, no other
        assert gateway.admission.flights == {} and pipe.engine is not None \
            and pipe.engine.active_slots == 0


def test_a_full_preparation_pool_is_an_overload_not_a_queue(tmp_path: Path,
                                                            pools: list[Workers]) -> None:
    pipe = held_pipeline()
    slow = pipe.stages.renderer
    assert isinstance(slow, HeldRenderer)
    gateway = Gateway(config(tmp_path, work_threads=1, work_queue=1), lambda f, c: pipe)
    with running(gateway) as url:
        slow.arm()
        body = {"model": "default", "messages": [{"role": "user", "content": "x"}]}
        results: list[int] = []

        def count() -> None:
            results.append(httpx.post(f"{url}/v1/messages/count_tokens", json=body,
                                      timeout=60).status_code)

        threads = [threading.Thread(target=count) for _ in range(2)]
        threads[0].start()  # runs, held
        assert slow.started.wait(60)
        threads[1].start()  # waits: the queue's one place
        wait_for(lambda: len(pools) == 1 and pools[0].pending == 2, "one running, one waiting")
        count()  # no room: refused at once, while the pool is still held
        count()
        slow.release.set()
        for t in threads:
            t.join(60)
        assert sorted(results) == [200, 200, 529, 529]  # Anthropic's overloaded status


# --- an engine that stops -------------------------------------------------------------------

def test_an_engine_that_stops_is_reported_refused_and_restarted(tmp_path: Path) -> None:
    pipe, backend, armed = fragile_model("the model process vanished")
    restart, restarting, go = pipe.restart_engine, threading.Event(), threading.Event()

    def held_restart() -> None:  # the fresh engine starts only when the test says so
        restarting.set()
        assert go.wait(120), "the test never let the restart go on"
        restart()

    pipe.restart_engine = held_restart  # type: ignore[method-assign]
    gateway = Gateway(config(tmp_path, restart_delay_s=0.0), lambda f, c: pipe)
    with running(gateway) as url, httpx.Client(base_url=url, timeout=60) as client:
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
        # refused at once: the restart is held until after this answer, so it did not wait
        refused = client.post("/v1/chat/completions", json=chat())
        assert refused.status_code == 503
        assert "a fresh one is starting" in refused.json()["error"]["message"]
        assert restarting.wait(60)
        go.set()
        wait_for(lambda: client.get("/health").status_code == 200, "no fresh engine")
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
    # the grammar engine's own limits answer (a 400, or an output cut short); a stall would
    # trip the client's timeout, and send() sees the server serve normally afterwards
    answers = []
    for schema in ({"type": "string", "pattern": "^(a|b)*a(a|b){40}$"},
                   {"type": "string", "pattern": "^(x+x+)+y$"},
                   {"type": "array", "items": {"enum": [f"v{i}" for i in range(3000)]}}):
        r = send(client, "/v1/chat/completions", chat(max_tokens=16, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
        assert r.status_code in (200, 400), r.text
        answers.append(r)
    exponential, backtracking, wide = answers
    # the 41-character minimum does not fit 16 tokens: the room rule's search says so
    assert exponential.status_code == 400 and error(exponential)["param"] == "max_tokens"
    for r, fits in ((backtracking, lambda v: re.fullmatch(r"(x+x+)+y", v) is not None),
                    (wide, lambda v: set(v) <= {f"v{i}" for i in range(3000)})):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        if choice["finish_reason"] == "stop":
            assert fits(json.loads(choice["message"]["content"])), choice
