"""What ``/health`` tells a stranger, and what only the operator sees.

An engine stops with a failure whose text names a request id (as a stall's log line does).
Without a key, ``GET /health`` gives the state and a reason class only; the 503 another client
gets while the engine restarts names no request; ``GET /health/details`` is refused without
a key and gives the failure's text with one. Oracle: the request id is searched for in every
byte served.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from transports.http.serving_errors import failure_class
from tests.http_support import config, fragile_model, running
from transports.http import Gateway

SECRET = "req-0123456789abcdef"
KEY = "sk-operator-key"


def test_a_stranger_gets_a_reason_class_and_the_operator_gets_why(tmp_path: Path) -> None:
    pipe, _, armed = fragile_model(f"the step of {SECRET} met a fault")
    gateway = Gateway(config(tmp_path, restart_delay_s=30.0, api_keys=[KEY]),
                      lambda f, c: pipe)
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "default", "max_tokens": 50,
            "messages": [{"role": "user", "content": "hi"}]}
    with running(gateway) as url, httpx.Client(base_url=url, timeout=10) as client:
        assert client.get("/health").json() == {"status": "ok", "models": {"default": "ready"}}
        armed.set()
        failed = client.post("/v1/chat/completions", json=body, headers=auth)
        assert failed.status_code == 503 and SECRET not in failed.text
        deadline = time.monotonic() + 10
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert health.status_code == 503 and SECRET not in health.text
        assert health.json() == {"status": "engine_stopped",
                                 "models": {"default": "restarting"},
                                 "reasons": {"engine:default": "engine_stopped"}}
        other = client.post("/v1/chat/completions", json=body, headers=auth)
        assert other.status_code == 503 and SECRET not in other.text
        assert "(engine_stopped); a fresh one is starting" in other.json()["error"]["message"]
        assert client.get("/health/details").status_code == 401
        details = client.get("/health/details", headers=auth)
        assert details.status_code == 503
        assert SECRET in details.json()["engine_failures"]["default"]


def test_failure_classes() -> None:
    assert failure_class("stalled: a step ran 12 s") == "stalled"
    assert failure_class("stalled: the engine process has not heart-beaten for 2.0 s "
                         "(0 requests)") == "unresponsive"
    assert failure_class("a rank of the parallel group stopped answering (x)") == "rank_lost"
    assert failure_class("the engine process was killed by SIGKILL") == "engine_stopped"
