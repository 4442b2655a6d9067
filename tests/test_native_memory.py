"""The server's native-memory bounds, in a fresh interpreter (they are process-wide): the
caches' capacities reach the environment oneDNN and ideep read, an operator's own value is
kept, and glibc accepts the thresholds and the trim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, os
from backends.torch.native_memory import bound_native_caches, release_free_memory
bounds = bound_native_caches(primitive_cache=64, mmap_threshold=128 * 1024)
print(json.dumps({"onednn": os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"],
                  "ideep": os.environ["LRU_CACHE_CAPACITY"], "cache": bounds.primitive_cache,
                  "mmap": bounds.mmap_threshold, "trim": release_free_memory()}))
"""


def run(**env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env={**clean, **env},
                          capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_the_caps_reach_the_environment_and_glibc_takes_the_thresholds() -> None:
    got = run()
    assert got == {"onednn": "64", "ideep": "64", "cache": 64, "mmap": 128 * 1024,
                   "trim": True}


def test_an_operators_own_capacity_is_kept() -> None:
    got = run(ONEDNN_PRIMITIVE_CACHE_CAPACITY="512", LRU_CACHE_CAPACITY="8")
    assert (got["onednn"], got["ideep"], got["cache"]) == ("512", "8", 512)
