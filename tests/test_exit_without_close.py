"""A script that streams and ends without closing its pipeline exits cleanly, whatever its
strategy: the engine is closed at interpreter exit instead of being left inside torch while
the runtime finalizes (which aborted the process, "terminate called without an active
exception", status 134, in about two runs of three).

Every strategy's pipeline is built and streamed in one interpreter, and none is closed, so the
interpreter exits with eight engines alive at once (each still holding its model); the script
prints a line per strategy, so a failure names the last one that streamed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pipeline import build
pipes = []
for pair in sys.argv[1:]:
    model, strategy = pair.split(":")
    p = build(model, strategy=strategy)
    for d in p.stream("hi", max_tokens=8, seed=0):
        pass
    pipes.append(p)  # kept alive, never closed
    print("streamed", model, strategy, flush=True)
"""

RUNS = [("tiny", "autoregressive"), ("tiny", "speculative"),
        ("tiny-masked", "llada"), ("tiny-masked", "fast_dllm"), ("tiny-masked", "dfm"),
        ("tiny-continuous", "ddpm"), ("tiny-continuous", "ddim"), ("tiny-flow", "flow")]


def test_streaming_then_exiting_without_close_exits_cleanly_for_every_strategy() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, *(f"{m}:{s}" for m, s in RUNS)],
                         capture_output=True, text=True, timeout=300)
    want = [f"streamed {model} {strategy}" for model, strategy in RUNS]
    assert run.returncode == 0 and "terminate called" not in run.stderr, (
        f"exit status {run.returncode}, stdout {run.stdout!r}, stderr ...{run.stderr[-800:]}")
    assert run.stdout.splitlines() == want
