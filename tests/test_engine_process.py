"""The engine in a child process (:mod:`pipeline.runtime.parent`), killed for real.

Oracles: the same model on the in-process engine (tokens and trace for the same greedy
request), the kernel (a SIGKILL the child cannot catch, its exit status), the HTTP streams as
a client reads them, and the usage rows a separate read of the database returns. No verdict
rests on a duration: every wait is a bound on something that must happen.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.builder import build
from pipeline.runtime.parent import DEADLINE_GRACE_S, ProcessEngine, Unresponsive
from pipeline.runtime.wire import EngineRecipe
from pipeline.errors import BackendError, EngineClosed, RequestFailed
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.options import BackendOptions
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from tests.http_support import config, running
from transports.http import Gateway, ServerConfig
from transports.http.accounting.usage import read_records

NO_EOS = {"stoppers": ["max_tokens", "stop_strings", "deadline"], "replace_stoppers": True}
"""Stoppers without the end-of-sequence one: a request runs to its max_tokens, so it is
surely still running when the engine dies."""


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def engine() -> Any:
    started = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=4)))
    pipe = started.pipeline()
    yield pipe
    pipe.close()


def test_the_child_engine_gives_the_in_process_engines_tokens_and_trace(engine: Pipeline
                                                                        ) -> None:
    local = build(TINY_MODEL_DIR, options=BackendOptions(num_slots=4))
    try:
        for prompt in ("Hello, who are you?", "Count to five."):
            want = local.generate(prompt, max_tokens=16, temperature=0, seed=3)
            got = engine.generate(prompt, max_tokens=16, temperature=0, seed=3)
            assert got.token_ids == want.token_ids and got.text == want.text
            assert [e.event_type for e in got.trace] == [e.event_type for e in want.trace]
            assert [e.event_id for e in got.trace] == list(range(1, len(got.trace) + 1))
        deltas = list(engine.stream("Say hi", max_tokens=6, temperature=0))
        assert deltas[-1].final and sum(len(d.token_ids) for d in deltas) == 6
    finally:
        local.close()


def test_layer_taps_are_recorded_in_the_child_as_in_process(engine: Pipeline) -> None:
    """The parent's face of the child's backend declares its taps, so a ``taps`` request is
    accepted and recorded in the child, the same bits as in this process."""
    local = build(TINY_MODEL_DIR, options=BackendOptions(num_slots=4))
    try:
        want = local.generate("Hello", max_tokens=3, temperature=0, recording="taps")
        got = engine.generate("Hello", max_tokens=3, temperature=0, recording="taps")
    finally:
        local.close()
    taps = [[e.payload["taps"] for e in run.trace if "taps" in e.payload]
            for run in (want, got)]
    assert len(taps[1]) == 3 and taps[0] == taps[1]
    assert engine.engine is not None and len(engine.engine.backend.tap_names()) == 13


def test_cancelling_in_the_parent_stops_the_request_in_the_child(engine: Pipeline) -> None:
    handle = engine.submit("Tell me a story.", max_tokens=4000, temperature=0)
    it = handle.deltas(timeout=60)
    next(it)
    handle.cancel()
    done = handle.result(timeout=60)
    assert done.finish_reason.value == "cancelled" and len(done.token_ids) < 4000


def test_an_engine_call_runs_on_the_childs_backend(engine: Pipeline) -> None:
    from transports.http.dialects.embeddings import pooled

    local = build(TINY_MODEL_DIR, options=BackendOptions(num_slots=1))
    try:
        ids = (5, 6, 7, 8)
        assert engine.engine is not None and local.engine is not None
        got = engine.engine.call(functools.partial(pooled, engine.engine.backend, ids))
        want = local.engine.call(functools.partial(pooled, local.engine.backend, ids))
        assert torch.equal(got.result(60), want.result(60))
    finally:
        local.close()


def test_requests_sharing_an_id_each_get_their_own_answer(engine: Pipeline) -> None:
    asks = [("Hello", 5), ("Count to ten.", 7)]
    handles = [engine.submit(p, max_tokens=n, min_tokens=n, temperature=0, request_id="same")
               for p, n in asks]
    with build(TINY_MODEL_DIR, options=BackendOptions(num_slots=4)) as local:  # the oracle
        for handle, (prompt, n) in zip(handles, asks):
            want = local.generate(prompt, max_tokens=n, min_tokens=n, temperature=0)
            assert handle.result(timeout=60).token_ids == want.token_ids


def test_what_cannot_cross_is_refused_at_the_door_and_the_engine_goes_on(engine: Pipeline
                                                                         ) -> None:
    import datetime

    from pipeline.errors import InvalidValueError
    from transports.http.dialects.embeddings import pooled

    process = engine.engine
    assert isinstance(process, ProcessEngine)
    with pytest.raises(InvalidValueError,
                       match="cannot be sent to the engine process: .*date is not plain data"):
        engine.submit("hi", max_tokens=2, template_kwargs={"when": datetime.date(2026, 1, 1)})
    with pytest.raises(InvalidValueError, match="cannot be sent to the engine process"):
        process.call(lambda: 1)
    # the child's own error comes back whole (its type, field and message), nothing else fails
    bad = process.call(functools.partial(pooled, process.backend, (10**9,)))
    with pytest.raises(InvalidValueError) as caught:
        bad.result(timeout=60)
    assert caught.value.field == "token_ids"
    assert process.alive and len(engine.generate("ok", max_tokens=3).token_ids) == 3


def test_a_frozen_child_never_holds_a_caller() -> None:
    started, pipe, _ = _endless_child()
    os.kill(started.pid, signal.SIGSTOP)  # a cgroup freeze, a swap storm
    returned = threading.Event()

    def caller() -> None:
        handles = [pipe.submit("word " * 1500, max_tokens=4000) for _ in range(12)]
        for handle in handles:
            handle.cancel()
        pipe.close()  # kills the child once its own timeout passes
        returned.set()

    try:
        threading.Thread(target=caller, daemon=True).start()
        assert returned.wait(60), "a frozen child held a submit, a cancel or close"
        assert not started.alive
    finally:
        with contextlib.suppress(OSError):
            os.kill(started.pid, signal.SIGKILL)


def _endless_child() -> tuple[ProcessEngine, Pipeline, list[str]]:
    """A child engine of two slots whose requests never stop at EOS, its pipeline, and the
    reasons its ``on_stop`` was called with."""
    started = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=2),
                                               dict(NO_EOS)))
    stopped: list[str] = []
    started.on_stop = stopped.append
    return started, started.pipeline(), stopped


def test_a_killed_child_fails_its_requests_and_a_fresh_one_serves() -> None:
    started, pipe, stopped = _endless_child()
    try:
        handles = [pipe.submit(f"Story {i}", max_tokens=4000, temperature=0) for i in range(3)]
        first = handles[0].deltas(timeout=60)
        next(first)                                  # running (two slots, one queued)
        os.kill(started.pid, signal.SIGKILL)
        rest = list(first)
        assert rest[-1].finish_reason is not None and rest[-1].finish_reason.value == "error"
        for handle in handles:
            with pytest.raises(RequestFailed, match="the engine stopped: the engine process "
                                                    "was killed by SIGKILL"):
                handle.result(timeout=60)
        assert handles[0].state.value == "failed"
        wait_for(lambda: bool(stopped))  # on_stop runs after the requests were failed
        assert len(stopped) == 1 and "SIGKILL" in stopped[0]
        assert not started.alive
        with pytest.raises(EngineClosed, match="SIGKILL"):
            pipe.submit("more", max_tokens=2)
        pipe.restart_engine()
        assert pipe.engine is not started and pipe.engine is not None and pipe.engine.alive
        assert len(pipe.generate("Hi", max_tokens=3, temperature=0).token_ids) == 3
        # a stalled step is abandoned by killing the process, which a thread cannot be
        fresh = pipe.engine
        assert isinstance(fresh, ProcessEngine)
        handle = pipe.submit("Story", max_tokens=4000, temperature=0)
        next(handle.deltas(timeout=60))
        fresh.abandon("stalled: step 9 has run 130.0 s")
        with pytest.raises(RequestFailed, match="the engine stopped: stalled: step 9"):
            handle.result(timeout=60)
        assert fresh.failure == "stalled: step 9 has run 130.0 s" and not fresh.alive
        wait_for(lambda: len(stopped) == 2)
        assert stopped[-1] == fresh.failure
    finally:
        pipe.close()


def test_a_child_that_cannot_load_is_an_error_naming_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    before = open_descriptors()
    with pytest.raises(BackendError, match="could not load its model.*NoSuchModel"):
        ProcessEngine.start(EngineRecipe(tmp_path))
    assert not engine_descriptors(open_descriptors() - before)  # closed with the failure


# --- descriptors and liveness ------------------------------------------------------------------

def open_descriptors() -> set[str]:
    """This process's open descriptors as the kernel lists them (``/proc/self/fd``): each as
    ``number -> what``, a socket or file named by its inode, so a number reused by another
    file is another entry."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            found.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
    return found


def engine_descriptors(descriptors: set[str]) -> set[str]:
    """The sockets and unlinked temporary files among ``descriptors``."""
    return {d for d in descriptors if "socket:" in d or "(deleted)" in d}


def test_a_dead_childs_descriptors_are_closed_when_it_dies() -> None:
    gc.disable()  # what closes them is the engine, never the collector
    try:
        before = open_descriptors()
        started = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=1)))
        stopped: list[str] = []
        started.on_stop = stopped.append
        opened = open_descriptors() - before
        # the socket, the figures file and its map (the child's standard streams are ours)
        assert len(engine_descriptors(opened)) == 3, opened
        os.kill(started.pid, signal.SIGKILL)
        wait_for(lambda: bool(stopped))  # on_stop runs once the descriptors are closed
        assert not opened & open_descriptors()
        assert started.steps == 0 and started.stall() is None  # its last figures, kept
        again = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=1)))
        opened = open_descriptors() - before
        assert len(engine_descriptors(opened)) == 3, opened
        again.close()
        assert not opened & open_descriptors()
    finally:
        gc.enable()


def process_state(pid: int) -> str:
    """The kernel's one-letter state of process ``pid`` (``T``: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_a_frozen_idle_child_is_unresponsive_by_the_engines_clock() -> None:
    from pipeline.contracts.request import RuntimeLimits

    now = [0]
    started = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=2)),
                                  clock=lambda: now[0])
    pipe = started.pipeline()
    try:
        assert started.stall() is None
        now[0] = 60 * 10**9  # a minute on the engine's clock: a child that beats is heard
        wait_for(lambda: started.stall() is None, timeout=10)
        os.kill(started.pid, signal.SIGSTOP)  # idle, no step begun: a cgroup freeze
        wait_for(lambda: process_state(started.pid) == "T")
        started.stall()  # the last heartbeat it wrote is seen now
        now[0] += 3 * 10**9
        stall = started.stall()
        assert isinstance(stall, Unresponsive) and stall.running_s == 3.0
        assert stall.describe() == ("the engine process has given no sign of life for 3.0 s "
                                    "(0 requests)")
        # a deadline the child cannot keep is kept here, as the in-process engine keeps one
        # for a request that got no token (the oracle: one queued behind a full backend)
        with build(TINY_MODEL_DIR, options=BackendOptions(num_slots=1)) as local:
            blocker = local.submit("Story", max_tokens=4000, ignore_eos=True)
            want = local.submit("Hello", max_tokens=4000, ignore_eos=True,
                                limits=RuntimeLimits(deadline_s=0.05))
            want.result(timeout=60)
            blocker.cancel()
        handle = pipe.submit("Hello", max_tokens=4000, ignore_eos=True,
                             limits=RuntimeLimits(deadline_s=0.05))
        got = handle.result(timeout=0.05 + DEADLINE_GRACE_S + 30)
        expected = want.result()
        assert (got.finish_reason, got.stop_reason, got.error) == (
            expected.finish_reason, expected.stop_reason, expected.error)
        assert handle.state is want.state and got.usage.prompt_tokens == \
            expected.usage.prompt_tokens
        assert [d.finish_reason for d in handle.pushed()][-1] is \
            want.pushed()[-1].finish_reason
        end = [e.payload for e in got.trace if e.event_type == "generation.finished"]
        oracle = [e.payload for e in expected.trace if e.event_type == "generation.finished"]
        assert [(p["reason"], p["detail"], p["state"]) for p in end] == \
            [(p["reason"], p["detail"], p["state"]) for p in oracle]
        # still the child's until it answers: the stall names it, for the log only
        now[0] += 10**9
        stall = started.stall()
        assert stall is not None and stall.running_s == 4.0
        assert stall.request_ids == (handle.request_id,)
        assert handle.request_id not in stall.describe()
        assert handle.request_id in stall.describe_for_log()
        other = pipe.submit("Hi", max_tokens=2)
        started.abandon(f"stalled: {stall.describe()}")
        with pytest.raises(RequestFailed, match="the engine stopped: stalled: the engine "
                                                "process has given no sign of life"):
            other.result(timeout=60)
        pipe.restart_engine()  # SIGKILL ends a stopped process: the old one is gone
        assert not Path(f"/proc/{started.pid}").exists()
        assert pipe.engine is not started and pipe.engine is not None
        assert len(pipe.generate("Hi", max_tokens=3, temperature=0).token_ids) == 3
    finally:
        with contextlib.suppress(OSError):
            os.kill(started.pid, signal.SIGKILL)
        pipe.close()


def wedge_on_usr1() -> None:
    """In the child (a recipe's setup): SIGUSR1 wedges its main thread, the one that takes up
    this process's messages, while its engine and publisher threads go on."""
    signal.signal(signal.SIGUSR1, _wedge)


def _wedge(signum: int, frame: object) -> None:
    time.sleep(3600)


def test_a_child_that_takes_up_no_work_is_unresponsive_though_it_beats() -> None:
    now = [0]
    started = ProcessEngine.start(EngineRecipe(TINY_MODEL_DIR, BackendOptions(num_slots=2),
                                               setup=(wedge_on_usr1,)), clock=lambda: now[0])
    pipe = started.pipeline()
    try:
        assert len(pipe.generate("Hi", max_tokens=2).token_ids) == 2
        os.kill(started.pid, signal.SIGUSR1)  # its receiver wedges, at the latest on this:
        handle = pipe.submit("Hi", max_tokens=2)
        now[0] = 5 * 10**9

        def heard() -> bool:  # its heartbeat goes on: only the work untaken is reported
            stall = started.stall()
            return stall is not None and stall.phase == "has not taken up the work sent to it"

        wait_for(heard, timeout=30)
        stall = started.stall()
        assert stall is not None and stall.running_s == 5.0
        assert stall.describe() == ("the engine process has not taken up the work sent to it "
                                    "for 5.0 s (1 requests)")
        started.abandon(f"stalled: {stall.describe()}")
        with pytest.raises(RequestFailed, match="has not taken up the work sent to it"):
            handle.result(timeout=60)
    finally:
        pipe.close()


# --- over HTTP, under load ---------------------------------------------------------------------

def endless_builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    """The server's own engine-process path, with requests that never stop at EOS."""
    return ProcessEngine.start(EngineRecipe(folder, cfg.backend_options(), dict(NO_EOS))
                               ).pipeline()


def _stream(url: str, dialect: str, i: int, begun: threading.Event) -> tuple[int, list[str],
                                                                                float]:
    """One streamed request read to its end: status, its data/event lines, and when its
    error event arrived (``time.monotonic``; 0 if none)."""
    if dialect == "openai":
        path, body = "/v1/chat/completions", {"model": "default", "max_tokens": 4000,
                                              "stream": True, "messages": [
                                                  {"role": "user", "content": f"story {i}"}]}
    else:
        path, body = "/v1/messages", {"model": "default", "max_tokens": 4000, "stream": True,
                                      "messages": [{"role": "user", "content": f"story {i}"}]}
    lines, error_at = [], 0.0
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + path, json=body) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if '"text"' in line or '"content"' in line:
                    begun.set()
                if not error_at and ("event: error" in line or line.startswith('data: {"error"')):
                    error_at = time.monotonic()
            return r.status_code, lines, error_at


def test_killing_the_engine_process_under_load(tmp_path: Path) -> None:
    gateway = Gateway(config(tmp_path, num_slots=8, models={"default": TINY_MODEL_DIR},
                             restart_delay_s=1.0), endless_builder)
    try:
        with running(gateway) as url:
            served = gateway.models["default"]
            assert served.pipeline is not None
            old = served.pipeline.engine
            assert isinstance(old, ProcessEngine)
            dialects = ["openai", "anthropic"] * 3
            begun = [threading.Event() for _ in dialects]
            with concurrent.futures.ThreadPoolExecutor(len(dialects)) as pool:
                streams = [pool.submit(_stream, url, d, i, begun[i])
                           for i, d in enumerate(dialects)]
                assert all(b.wait(60) for b in begun), "every stream is under way"
                killed_at = time.monotonic()
                os.kill(old.pid, signal.SIGKILL)
                answers = [s.result(timeout=120) for s in streams]  # nothing hangs
            for dialect, (status, lines, error_at) in zip(dialects, answers):
                assert status == 200 and error_at >= killed_at, (dialect, lines[-3:])
                text = "\n".join(lines)
                # the client hears that the engine stopped and to retry; the reason (the
                # signal) is in the log and the usage record, not sent out
                assert "a fresh one is starting: retry the request" in text
                if dialect == "openai":  # the error is the stream's last event
                    assert json.loads(lines[-1][len("data: "):])["error"]["type"] == \
                        "service_unavailable"
                else:
                    assert "event: error" in text and "message_stop" not in text
            health = httpx.get(f"{url}/health")
            assert health.status_code == 503
            assert health.json()["models"]["default"] == "restarting"
            assert health.json()["reasons"] == {"engine:default": "engine_stopped"}
            assert "SIGKILL" in httpx.get(f"{url}/health/details").json()["problems"][
                "engine:default"]
            path = tmp_path / "usage.sqlite3"
            wait_for(lambda: len(read_records(path)) == len(dialects))
            rows = read_records(path)
            assert all(r.finish_reason == "error" and "SIGKILL" in (r.error or "")
                       for r in rows)
            assert sorted(r.endpoint for r in rows) == (["chat.completions"] * 3
                                                        + ["messages"] * 3)
            wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=120)
            new = served.pipeline.engine
            assert isinstance(new, ProcessEngine) and new.pid != old.pid and new.alive
            assert served.restarts == 1
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "default", "max_tokens": 4, "messages": [
                    {"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        gateway.close()


def test_the_servers_engine_process_option_serves_from_a_child(tmp_path: Path) -> None:
    gateway = Gateway(config(tmp_path, num_slots=2, engine_process=True))
    try:
        with running(gateway) as url:
            engine = gateway.models["default"].pipeline.engine  # type: ignore[union-attr]
            assert isinstance(engine, ProcessEngine) and engine.pid != os.getpid()
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "default", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            e = httpx.post(f"{url}/v1/embeddings", timeout=60,
                           json={"model": "default", "input": "hello"})
            assert e.status_code == 200 and len(e.json()["data"][0]["embedding"]) == 192
            gateway.supervisor.release_in_children()  # what the watchdog does when traffic stops
            from pipeline.process_memory import release_free_memory
            assert engine.call(release_free_memory).result(60) is True
            assert engine.alive
    finally:
        gateway.close()
    assert not engine.alive


# --- device faults ------------------------------------------------------------------------------

def cuda_fault() -> None:
    """What torch raises after a kernel's illegal memory access (run in the child)."""
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


class FaultyBackend(ScriptedBackend):
    """A scripted backend whose forwards raise ``error`` once ``fail`` is set."""

    def __init__(self, vocab: int, error: Exception) -> None:
        super().__init__(vocab, peaked(vocab, lambda ids: 5, 30.0), num_slots=2)
        self.error, self.fail = error, threading.Event()

    def forward(self, calls: Any) -> torch.Tensor:
        if self.fail.is_set():
            raise self.error
        return super().forward(calls)


@pytest.mark.parametrize("error, fatal", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("shape mismatch"), False),
])
def test_a_device_fault_stops_the_engine_and_other_errors_fail_only_their_requests(
        error: Exception, fatal: bool) -> None:
    from stages.tokenize import HFTokenizer

    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    backend = FaultyBackend(tok.vocab_size, error)
    pipe = build(TINY_MODEL_DIR, backend=backend)
    stopped: list[str] = []
    assert pipe.engine is not None
    pipe.engine.on_stop = stopped.append
    try:
        handle = pipe.submit("hi", max_tokens=1000, temperature=0)
        next(handle.deltas(timeout=60))
        backend.fail.set()
        with pytest.raises(RequestFailed) as caught:
            handle.result(timeout=60)
        if fatal:
            assert "the engine stopped: DeviceFault: device fault in the model's forward" \
                in str(caught.value)
            wait_for(lambda: bool(stopped))  # on_stop runs after the requests were failed
            assert "DeviceFault" in stopped[0]
            assert not pipe.engine.alive  # type: ignore[union-attr]
        else:
            assert "backend error" in str(caught.value) and pipe.engine.alive and not stopped
    finally:
        pipe.close()


def test_a_device_fault_in_the_child_ends_it_and_its_requests() -> None:
    started, pipe, stopped = _endless_child()
    try:
        handle = pipe.submit("Story", max_tokens=4000, temperature=0)
        next(handle.deltas(timeout=60))
        call = started.call(cuda_fault)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            call.result(timeout=60)
        with pytest.raises(RequestFailed, match="DeviceFault: device fault in an engine call"):
            handle.result(timeout=60)
        wait_for(lambda: bool(stopped))  # on_stop runs after the requests were failed
        assert "DeviceFault" in stopped[0] and started.failure == stopped[0]
        assert not started.alive
    finally:
        pipe.close()
