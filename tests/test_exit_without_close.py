"""A script that streams and ends without closing its pipeline exits cleanly, whatever its
strategy: the engine is closed at interpreter exit instead of being left inside torch while
the runtime finalizes (which aborted the process, "terminate called without an active
exception", status 134, in about two runs of three).

One subprocess per strategy, all running at once, so the module costs about one interpreter
start and one model load."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
from pipeline import build
model, strategy = sys.argv[1], sys.argv[2]
p = build(model, strategy=strategy)
for d in p.stream("hi", max_tokens=8, seed=0):
    pass
print("streamed")
"""

RUNS = [("tiny", "autoregressive"), ("tiny", "speculative"),
        ("tiny-masked", "llada"), ("tiny-masked", "fast_dllm"), ("tiny-masked", "dfm"),
        ("tiny-continuous", "ddpm"), ("tiny-continuous", "ddim"), ("tiny-flow", "flow")]


def test_streaming_then_exiting_without_close_exits_cleanly_for_every_strategy() -> None:
    runs = {(model, strategy): subprocess.Popen(
        [sys.executable, "-c", SCRIPT, model, strategy], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for model, strategy in RUNS}
    failures = []
    for (model, strategy), run in runs.items():
        out, err = run.communicate(timeout=180)
        if run.returncode != 0 or out.strip() != "streamed" or "terminate called" in err:
            failures.append(f"{strategy} on {model}: exit status {run.returncode}, "
                            f"stdout {out.strip()!r}, stderr ...{err[-400:]}")
    assert not failures, "\n".join(failures)
