"""A script that streams and ends without closing its pipeline exits cleanly: the engine is
closed at interpreter exit instead of being left inside torch while the runtime finalizes
(which aborted the process, "terminate called without an active exception", status 134,
in about two runs of three)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from pipeline import build
p = build("tiny")
for d in p.stream("hi", max_tokens=4):
    pass
print("streamed")
"""


def test_streaming_then_exiting_without_close_exits_cleanly() -> None:
    runs = [subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-500:]
        assert out.strip() == "streamed" and "terminate called" not in err
