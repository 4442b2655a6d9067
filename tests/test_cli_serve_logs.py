"""``pipeline serve``'s log as an operator reads it: the real command in a subprocess on a free
port with the tiny model, its standard error read line by line.

Oracles: transformers' own parameter count of the same checkpoint, the checkpoint's config
(architecture, dtype), the OpenAI SDK's view of each response (id and usage), and the HTTP
status each request got. Every line must be in the one log format (no uvicorn lines of its
own) and there must be exactly one access line per request.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest

from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.output import FinishReason

RUN = [sys.executable, "-m", "pipeline", "serve", "--host", "127.0.0.1", "--port", "0"]
KEY = "sk-test-logs"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) "
                  r"(pipeline\.serve(?:\.access)?|uvicorn\.\w+): (.*)$")
# a field's value is one token, or a JSON string (``reason=``: a 4xx's message, escaped)
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]\S*)')
ACCESS = re.compile(rf"^(GET|HEAD|POST) (\S+) (\d{{3}}) (\d+\.\d)ms((?: {FIELD.pattern})*)$")
LISTEN = re.compile(r"listening on (http://127\.0\.0\.1:(\d+)) \(models: (.*)\)$")


class Log:
    """A server's standard error, read on a thread, line by line."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        """The first line (seen or to come) that ``pattern`` matches in its message."""
        deadline = time.monotonic() + timeout
        for line in self.lines:
            found = re.search(pattern, line)
            if found:
                return found
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no log line matched {pattern!r}:\n" + "\n".join(self.lines)
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"the server ended; no line matched {pattern!r}:\n" + \
                "\n".join(self.lines)
            self.lines.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def drain(self, quiet_s: float = 1.0) -> None:
        """Take every line that arrives until ``quiet_s`` pass without one."""
        while True:
            try:
                line = self._queue.get(timeout=quiet_s)
            except queue.Empty:
                return
            if line is None:
                return
            self.lines.append(line)

    def access(self) -> list[tuple[str, str, int, dict[str, str]]]:
        """(method, path, status, fields) of each access line so far."""
        out = []
        for line in self.lines:
            parsed = LINE.match(line)
            assert parsed, f"a line outside the log format: {line!r}"
            if parsed.group(2) == "pipeline.serve.access":
                found = ACCESS.match(parsed.group(3))
                assert found, f"a malformed access line: {line!r}"
                fields = {name: json.loads(value) if value.startswith('"') else value
                          for name, value in FIELD.findall(found.group(5))}
                out.append((found.group(1), found.group(2), int(found.group(3)), fields))
        return out


@contextmanager
def serving(data_dir: Path, *models: str) -> Iterator[tuple[str, Log]]:
    args = [a for m in models for a in ("--model", m)] + ["--data-dir", str(data_dir)]
    server = subprocess.Popen(RUN + args, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PIPELINE_API_KEYS": KEY})
    assert server.stderr is not None
    log = Log(server.stderr)
    try:
        url = log.wait_for(LISTEN.pattern).group(1)
        yield url, log
    finally:
        server.terminate()  # this test's own child, by its handle
        server.wait(timeout=60)


@pytest.fixture(scope="module")
def tiny_parameters() -> int:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(TINY_MODEL_DIR))
    return int(model.num_parameters())


def test_startup_lines_and_one_access_line_per_request(tiny_parameters: int,
                                                        tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    with serving(tmp_path, "tiny") as (url, log):
        page = log.wait_for(r"chat page: (\S+) ").group(1)
        assert page == url + "/" and "<html" in httpx.get(page).text.lower()
        ready = log.wait_for(r"model 'tiny' ready in (\d+\.\d\d) s: (.*)$")
        sampling = log.wait_for(r"model 'tiny' samples by default with (.*) \((.*)\)$")
        generation = json.loads((TINY_MODEL_DIR / "generation_config.json").read_text())
        assert sampling.group(2) == "generation_config.json"
        assert f"temperature {generation['temperature']}" in sampling.group(1)
        what = ready.group(2)
        assert float(ready.group(1)) > 0
        assert what.startswith(f"{config['architectures'][0]}, ")
        assert f"({tiny_parameters}), " in what
        assert f"{config['dtype']} on cpu" in what
        weights = re.search(r"weights (\d+\.\d) MiB \((\d+) bytes\)", what)
        assert weights and int(weights.group(2)) == 2 * tiny_parameters  # bfloat16
        assert abs(float(weights.group(1)) - 2 * tiny_parameters / 2**20) < 0.06
        assert "window 4096 tokens, 8 slots" in what
        log.wait_for(r"loading model 'tiny' \(tiny\) on cpu")

        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        auth = {"authorization": f"Bearer {KEY}"}
        messages = [{"role": "user", "content": "Say something."}]
        plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                               temperature=0)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert plain.usage is not None and usage is not None
        with httpx.stream("POST", url + "/v1/chat/completions", headers=auth, json={
                "model": "tiny", "messages": messages, "max_tokens": 3000, "min_tokens": 2900,
                "stream": True}, timeout=60) as left:
            seen = [line for line, _ in zip(left.iter_lines(), range(6)) if line]
        with pytest.raises(httpx.TimeoutException):  # leaves before its answer is ready
            httpx.post(url + "/v1/chat/completions", headers=auth, timeout=0.5, json={
                "model": "tiny", "messages": messages, "max_tokens": 3000, "min_tokens": 2900})
        missing = httpx.get(url + "/v1/no-such-thing", headers=auth)
        refused = httpx.post(url + "/v1/chat/completions", json={"model": "tiny"},
                             headers={"authorization": "Bearer wrong"})
        assert (missing.status_code, refused.status_code) == (404, 401)
        log.wait_for(r"GET /v1/no-such-thing 404")
        log.wait_for(r"POST /v1/chat/completions 401")
        log.wait_for(r"POST /v1/chat/completions 499")  # written once its usage is known
        log.drain()
    lines = log.access()  # in the order responses ended, not the order requests came
    assert sorted((m, p, s) for m, p, s, _ in lines) == sorted([
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 499),
        ("GET", "/v1/no-such-thing", 404), ("POST", "/v1/chat/completions", 401),
        ("GET", "/", 200)])
    by_id = {fields["request_id"]: (status, fields) for _, _, status, fields in lines}
    for response, counts, n in ((plain, plain.usage, 7), (chunks[0], usage, 9)):
        status, fields = by_id[response.id]
        assert status == 200 and fields["model"] == "tiny" and fields["finish"] == "length"
        assert int(fields["prompt_tokens"]) == counts.prompt_tokens
        assert int(fields["completion_tokens"]) == counts.completion_tokens == n
        assert fields["client"].startswith("127.0.0.1:")
    stream_id = json.loads(seen[0].removeprefix("data: "))["id"]
    status, fields = by_id[stream_id]  # the stream the client left
    assert status == 200 and int(fields["completion_tokens"]) >= len(seen) - 1  # role chunk
    cancelled = [(s, f) for _, _, s, f in lines if f.get("finish") == "cancelled"]
    assert sorted(s for s, _ in cancelled) == [200, 499]  # then the wait it left
    for _, fields in cancelled:
        assert fields["request_id"].startswith("chatcmpl-")
        assert int(fields["prompt_tokens"]) == plain.usage.prompt_tokens
        assert 0 < int(fields["completion_tokens"]) < 2900
    unanswered = [f for _, _, s, f in lines if s in (404, 401)]
    assert len(unanswered) == 2
    assert all(f["request_id"] == "-" and "prompt_tokens" not in f for f in unanswered)
    # each 4xx says why: what its error body told the client
    whys = {s: (f.get("error"), f.get("reason")) for _, _, s, f in lines if s >= 400}
    assert whys[404] == ("not_found", missing.json()["error"]["message"])
    assert whys[401] == ("invalid_api_key", refused.json()["error"]["message"])
    assert whys[499] == ("client_closed_request", None)


def test_access_lines_of_choices_completions_traces_and_the_page(tmp_path: Path) -> None:
    """A request of several choices is one line: its ``x-request-id``, the usage its response
    reports (each prompt once, every choice's completion tokens summed) and its choices'
    finish reasons in choice order; ``/v1/completions`` likewise; the page and the traces
    started no generation."""
    openai = pytest.importorskip("openai")
    with serving(tmp_path, "tiny") as (url, log):
        log.wait_for(r"model 'tiny' ready in")
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        auth = {"authorization": f"Bearer {KEY}"}
        messages = [{"role": "user", "content": "Name three colours."}]
        expected: dict[str, tuple[str, object, list[str | None]]] = {}

        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, n=3, max_tokens=12, temperature=1.0, seed=5,
            stop=["e"])
        chat = raw.parse()
        assert raw.headers["x-request-id"] == chat.id
        expected[chat.id] = ("/v1/chat/completions", chat.usage,
                             [c.finish_reason for c in sorted(chat.choices,
                                                              key=lambda c: c.index)])

        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, n=2, max_tokens=10, temperature=1.0, seed=9,
            stream=True, stream_options={"include_usage": True})
        chunks = list(raw.parse())
        finishes: dict[int, str | None] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
        assert sorted(finishes) == [0, 1] and chunks[-1].usage is not None
        expected[raw.headers["x-request-id"]] = (
            "/v1/chat/completions", chunks[-1].usage, [finishes[0], finishes[1]])

        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=["Once upon a time", "The sky is"], n=2, max_tokens=6,
            temperature=1.0, seed=3, stop=["a"])
        batch = raw.parse()
        expected[raw.headers["x-request-id"]] = (
            "/v1/completions", batch.usage,
            [c.finish_reason for c in sorted(batch.choices, key=lambda c: c.index)])

        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="Once upon a time", n=2, max_tokens=5, temperature=1.0,
            seed=4, stream=True, stream_options={"include_usage": True})
        pieces = list(raw.parse())
        ends = {c.index: c.finish_reason for p in pieces for c in p.choices if c.finish_reason}
        assert pieces[-1].usage is not None
        expected[raw.headers["x-request-id"]] = (
            "/v1/completions", pieces[-1].usage, [ends[0], ends[1]])

        trace = httpx.get(f"{url}/traces/{chat.id}", headers=auth, timeout=60)
        unknown = httpx.get(f"{url}/traces/chatcmpl-none", headers=auth, timeout=60)
        page = httpx.get(url + "/", timeout=60)
        head = httpx.head(url + "/", timeout=60)
        assert (trace.status_code, unknown.status_code, page.status_code,
                head.status_code) == (200, 404, 200, 200)
        assert len(trace.text.splitlines()) > 3  # every choice's events
        log.wait_for(r"HEAD / 200")
        log.drain()
    log.drain()  # the server was sent SIGTERM: it says so before the signal ends it
    assert log.lines[-1].endswith(" INFO pipeline.serve: stopped")
    lines = log.access()
    generated = {f["request_id"]: (p, s, f) for _, p, s, f in lines if f["request_id"] != "-"}
    assert sorted(generated) == sorted(expected)
    for request_id, (path, usage, reasons) in expected.items():
        logged_path, status, fields = generated[request_id]
        assert (logged_path, status, fields["model"]) == (path, 200, "tiny")
        assert int(fields["prompt_tokens"]) == usage.prompt_tokens  # type: ignore[attr-defined]
        assert int(fields["completion_tokens"]) == usage.completion_tokens  # type: ignore[attr-defined]
        logged = [FinishReason(word) for word in fields["finish"].split(",")]
        assert [r.openai for r in logged] == reasons  # the library's reasons, in choice order
    others = sorted((m, p, s) for m, p, s, f in lines if f["request_id"] == "-")
    assert others == sorted([("GET", f"/traces/{chat.id}", 200),
                             ("GET", "/traces/chatcmpl-none", 404), ("GET", "/", 200),
                             ("HEAD", "/", 200)])
    assert all("prompt_tokens" not in f and "model" not in f
               for _, _, _, f in lines if f["request_id"] == "-")


def test_a_model_that_fails_is_logged_and_the_others_serve(tmp_path: Path) -> None:
    with serving(tmp_path, "tiny", "broken=/no/such/model") as (url, log):
        failed = log.wait_for(r"ERROR pipeline\.serve: model 'broken' failed to load: (.*)$")
        assert "no such folder or file" in failed.group(1)
        log.wait_for(r"model 'tiny' ready in")
        headers = {"authorization": f"Bearer {KEY}"}
        body = {"model": "tiny", "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]}
        ok = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        down = httpx.post(url + "/v1/chat/completions", json={**body, "model": "broken"},
                          headers=headers, timeout=60)
        assert ok.status_code == 200 and down.status_code == 503
        assert "no such folder or file" in down.json()["error"]["message"]
        log.wait_for(r"POST /v1/chat/completions 503")
        log.drain()
    # logged once, at once; the 503 a request for it gets is logged as a 5xx besides
    assert sum(" ERROR pipeline.serve: model 'broken' failed" in line for line in log.lines) == 1
    assert "Traceback" not in "\n".join(log.lines)


def test_no_model_left_exits_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(RUN + ["--model", "a=/no/such/model", "--model", "b=/nor/this",
                                 "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PIPELINE_API_KEYS": KEY})
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert lines[-1].startswith("pipeline serve: no model could be loaded ('a': ")
    assert "'b': " in lines[-1] and "no such folder or file" in lines[-1]
    assert all(LINE.match(line) for line in lines[:-1])
    assert sum(" ERROR pipeline.serve: model " in line for line in lines) == 2


@pytest.mark.parametrize("n, size, count", [
    (0, "0 B", "0"), (999, "999 B", "999"), (1023, "1023 B", "1.02K"), (1024, "1.0 KiB", "1.02K"),
    (12697728, "12.1 MiB", "12.7M"), (134515008, "128.3 MiB", "135M"),
    (7615616512, "7.1 GiB", "7.62B"), (3 * 2**40, "3.0 TiB", "3.3T"),
])
def test_sizes_read_as_people_write_them(n: int, size: str, count: str) -> None:
    from pipeline.contracts.model import human_bytes, human_count

    assert (human_bytes(n), human_count(n)) == (size, count)
