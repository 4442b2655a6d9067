"""The usage store: a server killed with SIGKILL under load keeps the record of every request
whose response a client received in full (records are committed before the last byte)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.http_support import free_port
from transports.http.accounting.usage import read_records


def client_loop(url: str, worker: int, completed: list[str], stop: threading.Event) -> None:
    body = {"model": "default", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {worker}"}]}
    with httpx.Client(timeout=30) as client:
        for i in range(200):  # bounded: the test kills the server long before
            if stop.is_set():
                return
            try:
                if i % 2:
                    r = client.post(f"{url}/v1/chat/completions", json=body)
                    if r.status_code == 200:
                        completed.append(r.json()["id"])
                else:
                    ids, done = set(), False
                    with client.stream("POST", f"{url}/v1/chat/completions",
                                       json={**body, "stream": True}) as r:
                        for line in r.iter_lines():
                            if line == "data: [DONE]":
                                done = True
                            elif line.startswith("data: "):
                                ids.add(json.loads(line[6:])["id"])
                    if done:
                        completed.append(ids.pop())
            except httpx.HTTPError:
                return  # the server is gone


def test_sigkill_under_load_loses_no_completed_request(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "transports.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--data-dir", str(tmp_path), "--slots", "4"],
        env={**os.environ, "PIPELINE_API_KEYS": ""}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline and server.poll() is None, "server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        completed: list[str] = []
        stop = threading.Event()
        workers = [threading.Thread(target=client_loop, args=(url, w, completed, stop))
                   for w in range(6)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while len(completed) < 24:
            assert time.monotonic() < deadline, "too few requests completed"
            time.sleep(0.005)
        server.send_signal(signal.SIGKILL)  # under load: requests are in flight now
        server.wait(10)
        stop.set()
        for w in workers:
            w.join(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    records = {r.request_id: r for r in read_records(tmp_path / "usage.sqlite3")}
    assert len(completed) >= 24
    missing = [rid for rid in completed if rid not in records]
    assert missing == []
    for rid in completed:
        assert records[rid].completion_tokens == 3 and records[rid].model == "default"
        assert records[rid].finish_reason == "length" and records[rid].total_s > 0
