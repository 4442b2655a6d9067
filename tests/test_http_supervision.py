"""Supervised workers: the usage writer under a real SQLite lock, a full disk and a read-only
one; the engine watchdog under a step that blocks. Oracles: SQLite itself (another
connection's ``BEGIN EXCLUSIVE``, the kernel's ENOSPC and EROFS on a small tmpfs), the rows a
separate connection reads back, the HTTP statuses and ``/metrics`` as Prometheus parses them.
No verdict rests on a duration: each wait is a bound on something that must happen."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pipeline.builder import build
from pipeline.runtime.parent import ProcessEngine
from pipeline.errors import EngineClosed, InvalidValueError, RequestFailed, StepStillRunning
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.model import ModelCall
from pipeline.testing import ScriptedBackend, peaked
from stages.tokenize import HFTokenizer
from tests.http_support import config, running
from transports.http import Gateway, ServerConfig
from transports.http.accounting.usage import SPILL_FILE, UsageRecord, UsageStore, read_records


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def record(i: int) -> UsageRecord:
    return UsageRecord(f"req-{i}", "m", "chat", 3, 4, 0, "stop", None, 0.0, 0.1, 0.2,
                       time.time(), "abc")


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding the database's exclusive lock, as a backup job would."""
    db = sqlite3.connect(str(path), isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    try:
        yield db
    finally:
        db.execute("COMMIT")
        db.close()


def append_all(store: UsageStore, ids: range) -> list[bool]:
    """Append records ``ids``; the outcome each callback reported, once all reported."""
    outcomes: dict[int, bool] = {}
    done = threading.Event()

    def on_done(i: int, durable: bool) -> None:
        outcomes[i] = durable
        if len(outcomes) == len(ids):
            done.set()

    for i in ids:
        store.append(record(i), lambda durable, i=i: on_done(i, durable))
    assert done.wait(30), "a record's callback never ran"
    return [outcomes[i] for i in ids]


def test_a_lock_past_the_busy_timeout_spills_then_every_record_lands(tmp_path: Path) -> None:
    store = UsageStore(tmp_path, busy_timeout_s=0.2, backoff_s=0.05, max_backoff_s=0.2)
    try:
        assert append_all(store, range(3)) == [True] * 3
        with exclusive(store.path):
            assert append_all(store, range(3, 8)) == [False] * 5  # answered, not blocked
            health = store.health()
            assert health.down is not None and "locked" in health.down
            assert health.spill_depth == 5 and health.spilled == 5
        # the lock is gone: the writer's own retry writes the spill, nothing new needed
        wait_for(lambda: len(read_records(store.path)) == 8)
        wait_for(lambda: store.health().down is None)
        assert store.health().durable == 8 and store.health().spill_depth == 0
        assert {r.request_id for r in read_records(store.path)} == {f"req-{i}" for i in range(8)}
        assert all(r.api_keys == "abc" for r in read_records(store.path))
    finally:
        store.close()


def test_a_full_spill_drops_the_oldest_and_counts_them(tmp_path: Path) -> None:
    store = UsageStore(tmp_path, busy_timeout_s=0.05, spill_limit=3, backoff_s=60)
    with exclusive(store.path):
        assert append_all(store, range(5)) == [False] * 5
        assert store.health().dropped == 2 and store.health().spill_depth == 3
    store.close()
    kept = {r.request_id for r in read_records(store.path)}
    assert kept == {"req-2", "req-3", "req-4"}  # close's last try wrote the spill


def test_a_spill_the_database_never_takes_goes_to_a_file_at_close(tmp_path: Path) -> None:
    store = UsageStore(tmp_path, busy_timeout_s=0.05, backoff_s=60)
    with exclusive(store.path):
        assert append_all(store, range(2)) == [False, False]
        store.close()
    lines = (tmp_path / SPILL_FILE).read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["req-0", "req-1"]


def test_an_older_database_gains_the_key_column(tmp_path: Path) -> None:
    db = sqlite3.connect(str(tmp_path / "usage.sqlite3"))
    db.execute("CREATE TABLE usage (request_id TEXT PRIMARY KEY, model TEXT NOT NULL, "
               "endpoint TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens "
               "INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, finish_reason TEXT NOT NULL, "
               "error TEXT, queued_s REAL NOT NULL, first_token_s REAL, total_s REAL NOT NULL, "
               "finished_at REAL NOT NULL)")
    db.execute("INSERT INTO usage VALUES ('old', 'm', 'chat', 1, 1, 0, 'stop', NULL, 0, NULL, "
               "0, 0)")
    db.commit()
    db.close()
    store = UsageStore(tmp_path)
    assert append_all(store, range(1)) == [True]
    store.close()
    rows = {r.request_id: r.api_keys for r in read_records(store.path)}
    assert rows == {"old": "", "req-0": "abc"}


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "2m") -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_spills_and_the_rows_land_once_there_is_room(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        store = UsageStore(data, backoff_s=0.05, max_backoff_s=0.2)
        try:
            assert append_all(store, range(2)) == [True, True]
            filler = data / "filler"
            with open(filler, "wb") as out, contextlib.suppress(OSError):
                while True:  # until the kernel says ENOSPC
                    out.write(b"\0" * 65536)
                    out.flush()
            outcomes = append_all(store, range(2, 202))
            assert False in outcomes
            health = store.health()
            assert health.down is not None and "full" in health.down, health
            filler.unlink()
            wait_for(lambda: len(read_records(store.path)) == 202)
            wait_for(lambda: store.health().down is None)
        finally:
            store.close()


def test_a_read_only_disk_spills_and_the_rows_land_once_writable(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        # a long backoff: after a failure the writer closes its connection and waits 3 s, the
        # window in which nothing holds the file open and the kernel lets it go read-only
        store = UsageStore(data, busy_timeout_s=0.05, backoff_s=3.0, max_backoff_s=3.0)
        try:
            assert append_all(store, range(2)) == [True, True]
            with exclusive(store.path):
                assert append_all(store, range(2, 3)) == [False]
            subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
            assert append_all(store, range(3, 6)) == [False] * 3
            health = store.health()
            # SQLite's words for a read-only directory in WAL mode (no -shm file can be made)
            assert health.down is not None and "unable to open" in health.down, health
            subprocess.run(["mount", "-o", "remount,rw", str(data)], check=True)
            wait_for(lambda: len(read_records(store.path)) == 6)
        finally:
            store.close()


def test_an_unwritable_data_directory_is_refused_at_start(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "data") as data:
        subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
        with pytest.raises(sqlite3.OperationalError):
            UsageStore(data)


# --- through HTTP ------------------------------------------------------------------------------

def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")


def ask(url: str, i: int, stream: bool) -> tuple[int, str]:
    body = {"model": "default", "max_tokens": 3, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"q{i}"}]}
    with httpx.Client(timeout=60) as client:
        if not stream:
            r = client.post(f"{url}/v1/chat/completions", json=body)
            return r.status_code, r.text
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            return r.status_code, "".join(r.iter_lines())


def test_a_locked_usage_database_never_holds_a_response(tmp_path: Path) -> None:
    gateway = Gateway(config(tmp_path, usage_wait_s=30))
    with running(gateway) as url:
        path = tmp_path / "usage.sqlite3"
        with exclusive(path):
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                answers = list(pool.map(lambda i: ask(url, i, bool(i % 2)), range(12)))
            assert [status for status, _ in answers] == [200] * 12
            assert all("[DONE]" in text for status, text in answers[1::2])
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert health.json()["reasons"] == {"usage_store": "usage_store_down"}
            assert "locked" in httpx.get(f"{url}/health/details").json()["problems"][
                "usage_store"]
            assert metric(url, "pipeline_usage_store_up") == 0
            assert metric(url, "pipeline_usage_records_total", outcome="spilled") == 12
        wait_for(lambda: len(read_records(path)) == 12)
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
        assert metric(url, "pipeline_usage_records_total", outcome="durable") == 12


# --- the engine watchdog -----------------------------------------------------------------------

class GatedBackend(ScriptedBackend):
    """A scripted backend whose forwards block, once ``block`` is set, until ``release``."""

    def __init__(self, vocab: int, a: int) -> None:
        super().__init__(vocab, peaked(vocab, lambda ids: a, 30.0), num_slots=4)
        self.block = threading.Event()
        self.release_gate = threading.Event()
        self.blocked = threading.Event()

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        if self.block.is_set():
            self.blocked.set()
            self.release_gate.wait(120)
        return super().forward(calls)


def gated_model() -> tuple[Pipeline, GatedBackend]:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = GatedBackend(tok.vocab_size, tok.encode_text("a")[0])
    return build(TINY_MODEL_DIR, backend=backend), backend


def test_a_stalled_step_fails_its_requests_and_a_fresh_engine_takes_over(tmp_path: Path) -> None:
    pipe, backend = gated_model()
    gateway = Gateway(config(tmp_path, stall_timeout_s=0.3, restart_delay_s=0.0),
                      lambda f, c: pipe)
    try:
        with running(gateway) as url:
            assert ask(url, 0, False)[0] == 200
            backend.block.set()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                stuck = [pool.submit(ask, url, i, bool(i % 2)) for i in range(1, 5)]
                assert backend.blocked.wait(30)
                answers = [f.result(timeout=60) for f in stuck]  # the watchdog answers them
            streamed, plain = answers[0::2], answers[1::2]  # i odd streams
            assert [status for status, _ in plain] == [503, 503]
            assert all("stalled" in json.loads(text)["error"]["message"] for _, text in plain)
            # a stream had begun: its error comes as the last event
            assert all(status == 200 and "stalled" in text for status, text in streamed)
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503
            assert health.json()["models"]["default"] == "restarting"
            assert health.json()["reasons"] == {"engine:default": "stalled"}
            details = httpx.get(f"{url}/health/details")  # the operator's (an open server)
            assert "stalled: step" in details.json()["problems"]["engine:default"]
            assert "chatcmpl-" not in details.text
            # which requests were stuck is the server's log's business, not every client's:
            # /health needs no key, and the 503s go to other clients
            assert "chatcmpl-" not in health.text
            assert all("chatcmpl-" not in json.loads(text)["error"]["message"]
                       for _, text in plain)
            assert ask(url, 9, False)[0] == 503  # no fresh engine while the step holds on
            backend.block.clear()
            backend.release_gate.set()  # the step returns; the fresh engine starts
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200)
            assert ask(url, 10, False)[0] == 200
            assert gateway.models["default"].restarts == 1
            assert backend.busy_slots == 0  # the abandoned requests' slots came back
    finally:
        backend.release_gate.set()
        gateway.close()


def test_a_stall_timeout_is_validated() -> None:
    for bad in (0, -1, True, "5"):
        with pytest.raises(InvalidValueError, match="stall_timeout_s"):
            ServerConfig(models={"d": None}, stall_timeout_s=bad)  # type: ignore[arg-type]


def test_the_engine_reports_the_step_in_progress_by_its_own_clock() -> None:
    now = [0]
    pipe, backend = gated_model()
    assert pipe.engine is not None
    pipe.engine.close()
    clocked = pipe.engine = pipe.engine.fresh(clock=lambda: now[0])
    stopped: list[str] = []
    clocked.on_stop = stopped.append
    try:
        assert clocked.stall() is None
        backend.block.set()
        handle = pipe.submit("hi", max_tokens=2)
        assert backend.blocked.wait(30)
        now[0] = 7_500_000_000
        stall = clocked.stall()
        assert stall is not None and stall.running_s == 7.5
        assert stall.phase == "the model's forward" and stall.request_ids == (handle.request_id,)
        clocked.abandon(f"stalled: {stall.describe()}")
        with pytest.raises(RequestFailed, match="the engine stopped: stalled: step"):
            handle.result(timeout=10)
        assert stopped and stopped[0].startswith("stalled: step")
        with pytest.raises(EngineClosed):
            pipe.submit("again", max_tokens=2)
        with pytest.raises(StepStillRunning):
            clocked.fresh()
        backend.release_gate.set()
        wait_for(lambda: not clocked.stepping)
        assert backend.busy_slots == 0  # the step returned and freed its request's slot
        pipe.engine = clocked.fresh()
        backend.block.clear()
        assert pipe.generate("hi", max_tokens=2).usage.completion_tokens == 2
    finally:
        backend.release_gate.set()
        pipe.close()


def test_a_client_that_leaves_frees_its_admission_place_before_the_next_step(
        tmp_path: Path) -> None:
    pipe, backend = gated_model()
    gateway = Gateway(config(tmp_path, num_slots=1, max_queue=0), lambda f, c: pipe)
    try:
        with running(gateway) as url:
            body = {"model": "default", "max_tokens": 500, "stream": True,
                    "messages": [{"role": "user", "content": "go"}]}
            with httpx.Client(timeout=30) as client:
                with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    lines = r.iter_lines()
                    assert sum(1 for _, line in zip(range(4), lines) if line) >= 2
                    backend.block.set()  # the step in progress now holds on
                    assert backend.blocked.wait(30)
            # the client left while the engine cannot notice: its place is free already
            served = gateway.models["default"]
            wait_for(lambda: served.inflight == 0)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                later = pool.submit(ask, url, 1, False)
                wait_for(lambda: len(gateway.admission.flights) == 2 or later.done())
                backend.block.clear()
                backend.release_gate.set()
                assert later.result(timeout=60)[0] == 200
    finally:
        backend.release_gate.set()
        gateway.close()


def test_a_server_deadline_ends_a_request_with_what_it_wrote(tmp_path: Path) -> None:
    from tests.http_support import endless_model
    pipe, _ = endless_model(delay_s=0.01)
    gateway = Gateway(config(tmp_path, request_deadline_s=0.3), lambda f, c: pipe)
    with running(gateway) as url:
        body = {"model": "default", "max_tokens": 3000,
                "messages": [{"role": "user", "content": "go"}]}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "length"
        assert 0 < answer["usage"]["completion_tokens"] < 3000
        assert choice["message"]["content"] == "a" * answer["usage"]["completion_tokens"]
    with pytest.raises(InvalidValueError, match="request_deadline_s"):
        ServerConfig(models={"d": None}, request_deadline_s=0)


# --- a frozen engine process -------------------------------------------------------------------

Ask = Callable[[], object]


def asks(url: str) -> dict[str, Ask]:
    """One request in each dialect, streamed and not, by the official SDKs (no retries), by
    name: each returns what the client got (a streamed reply's last chunk, or final
    message), or raises what the SDK raises."""
    import anthropic
    import openai

    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    claude = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    args: dict[str, Any] = {"model": "default", "max_tokens": 2000,
                            "messages": [{"role": "user", "content": "Tell me a story."}]}

    def openai_stream() -> object:
        return list(chat.chat.completions.create(**args, stream=True))[-1]

    def anthropic_stream() -> object:
        with claude.messages.stream(**args) as stream:
            return stream.get_final_message()

    return {"openai": lambda: chat.chat.completions.create(**args),
            "openai stream": openai_stream,
            "anthropic": lambda: claude.messages.create(**args),
            "anthropic stream": anthropic_stream}


def answer_all(gateway: Gateway, url: str) -> dict[str, tuple[float, object]]:
    """Send every one of :func:`asks` at once; once all four are in flight, switch the stall
    watchdog on (``stall_timeout_s`` 1.5 s): what each got (or raised), and how long after
    the switch."""
    import attrs

    requests = asks(url)  # the SDKs load before the clock starts

    def answered(ask: Ask) -> tuple[float, object]:
        try:
            got = ask()
        except Exception as exc:  # what the client sees is the verdict
            got = exc
        return time.monotonic(), got

    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(answered, ask) for name, ask in requests.items()}
        wait_for(lambda: len(gateway.admission.flights) == len(requests) or any(
            f.done() for f in futures.values()))
        gateway.supervisor.config = attrs.evolve(gateway.config, stall_timeout_s=1.5)
        switched = time.monotonic()
        return {name: (f.result(timeout=120)[0] - switched, f.result()[1])
                for name, f in futures.items()}


def frozen(engine: object) -> ProcessEngine:
    """``engine``, a child process, stopped by SIGSTOP (a cgroup freeze, a swap storm)
    while idle: no step has begun."""
    assert isinstance(engine, ProcessEngine)
    os.kill(engine.pid, signal.SIGSTOP)
    return engine


def replaced(gateway: Gateway, url: str, old: ProcessEngine) -> None:
    """The watchdog killed ``old`` and a fresh child serves."""
    import openai

    served = gateway.models["default"]
    wait_for(lambda: served.restarts == 1, timeout=120)
    assert httpx.get(f"{url}/health").status_code == 200
    new = served.pipeline.engine  # type: ignore[union-attr]
    assert isinstance(new, ProcessEngine) and new.pid != old.pid and new.alive
    assert not Path(f"/proc/{old.pid}").exists()  # SIGKILL ends a stopped process
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    reply = chat.chat.completions.create(model="default", max_tokens=3, messages=[
        {"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_requests_to_a_frozen_idle_engine_process_fail_retryably_and_a_fresh_one_serves(
        tmp_path: Path) -> None:
    import anthropic
    import openai

    gateway = Gateway(config(tmp_path, engine_process=True, restart_delay_s=0.0))
    try:
        with running(gateway) as url:
            old = frozen(gateway.models["default"].pipeline.engine)  # type: ignore[union-attr]
            answers = answer_all(gateway, url)
            for name, (after, got) in answers.items():
                assert after < 1.5 + 10, (name, after)  # the stall timeout, and a margin
                # a 503 the SDKs retry; a stream (its 200 sent) ends in its error event
                if name == "openai":
                    assert isinstance(got, openai.InternalServerError), got
                    assert got.status_code == 503
                elif name == "anthropic":
                    assert isinstance(got, anthropic.ServiceUnavailableError), got
                    assert got.status_code == 503
                else:
                    assert isinstance(got, (openai.APIError, anthropic.APIStatusError)), got
                body: Any = got.body
                if name.startswith("openai"):
                    assert body["type"] == "service_unavailable"
                else:
                    assert body["type"] == "error" and body["error"]["type"] == "api_error"
                assert "retry the request" in str(got) and "stopped responding" in str(got)
            rows = read_records(tmp_path / "usage.sqlite3")
            assert len(rows) == 4 and all(
                r.finish_reason == "error" and "stalled: the engine process has" in (r.error or
                "") and "(4 requests)" in (r.error or "") for r in rows), rows
            replaced(gateway, url, old)
    finally:
        gateway.close()


def test_a_deadline_before_the_stall_timeout_ends_requests_to_a_frozen_engine_process(
        tmp_path: Path) -> None:
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from pipeline.runtime.parent import DEADLINE_GRACE_S

    gateway = Gateway(config(tmp_path, engine_process=True, restart_delay_s=0.0,
                             request_deadline_s=0.3))
    try:
        with running(gateway) as url:
            old = frozen(gateway.models["default"].pipeline.engine)  # type: ignore[union-attr]
            answers = answer_all(gateway, url)
            for name, (after, got) in answers.items():
                assert after < 0.3 + DEADLINE_GRACE_S + 10, (name, after)
                # as the child would have ended them: cut off, with nothing written
                if name.startswith("anthropic"):
                    assert isinstance(got, Message), got
                    assert got.stop_reason == "max_tokens" and got.usage.output_tokens == 0
                else:
                    assert isinstance(got, (ChatCompletion, ChatCompletionChunk)), got
                    assert got.choices[0].finish_reason == "length"
                    assert got.usage is None or got.usage.completion_tokens == 0
            replaced(gateway, url, old)  # the watchdog, switched on since, replaced it
    finally:
        gateway.close()
