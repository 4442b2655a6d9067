"""What ``/health`` tells a stranger, and what only the operator sees.

An engine stops with a failure whose text names a request id (as a stall's log line does).
Without a key, ``GET /health`` gives the state and a reason class only; the 503 another client
gets while the engine restarts names no request; ``GET /health/details`` is refused without
a key and gives the failure's text with one. Oracle: the request id is searched for in every
byte served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from pipeline.builder import build
from pipeline.errors import failure_class
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.testing import ScriptedBackend, peaked
from stages.tokenize import HFTokenizer
from tests.http_support import config, running
from transports.http import Gateway

SECRET = "req-0123456789abcdef"
KEY = "sk-operator-key"


class Fatal(BaseException):
    """Ends the engine thread (nothing in the loop catches a BaseException)."""


def test_a_stranger_gets_a_reason_class_and_the_operator_gets_why(tmp_path: Path) -> None:
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    a = tok.encode_text("a")[0]
    armed = threading.Event()

    def choose(ids: Sequence[int]) -> int:
        if armed.is_set():
            armed.clear()
            raise Fatal(f"the step of {SECRET} met a fault")
        return a

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0),
                              num_slots=2, delay_s=0.01)
    pipe = build(TINY_MODEL_DIR, backend=backend)
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
