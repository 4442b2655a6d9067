"""Benchmark: what running oneDNN products on row buckets costs a prefill, same run.

:mod:`backends.torch.packed` pads every oneDNN product's rows to a bucket (8, 16, 32, 64, then
multiples of 64) so the primitive cache stays small under varied traffic. The padding is extra
arithmetic: this times a one-shot prefill of each ``--lengths`` prompt on the default model
(its packed float32 weights) and on the tiny model (bfloat16 ``F.linear``) with the buckets
and with exact row counts, interleaved, ``--repeats`` times each, and reports the median
ratio. Prints a table and writes ``benchmarks/results/row_buckets.json``.

Run: ``.venv/bin/python benchmarks/row_buckets.py [--lengths 65,100,200,300,450]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import backends.torch.packed as packed
from pipeline import build

RESULTS = Path(__file__).parent / "results" / "row_buckets.json"


def prefill_s(pipe: Any, length: int) -> float:
    ids = [(7 * i) % 1000 + 100 for i in range(length)]
    start = time.perf_counter()
    pipe.generate(ids, max_tokens=1, temperature=0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="65,100,200,300,450")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="default,tiny")
    args = parser.parse_args()
    bucket = packed.row_bucket
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        with build(None if model == "default" else model) as pipe:
            for length in map(int, args.lengths.split(",")):
                times: dict[str, list[float]] = {"buckets": [], "exact": []}
                prefill_s(pipe, length)  # warm both shapes' primitives
                for _ in range(args.repeats):
                    for mode in ("buckets", "exact"):
                        packed.row_bucket = bucket if mode == "buckets" else (lambda n: n)
                        times[mode].append(prefill_s(pipe, length))
                packed.row_bucket = bucket
                b, e = statistics.median(times["buckets"]), statistics.median(times["exact"])
                rows.append({"model": model, "prompt_tokens": length, "rows_run": bucket(length),
                             "buckets_ms": round(b * 1e3, 1), "exact_ms": round(e * 1e3, 1),
                             "ratio": round(b / e, 3)})
                print(rows[-1], flush=True)
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"\nthreads {torch.get_num_threads()}, load {' '.join(load)}")
    print(f"{'model':>8} {'tokens':>6} {'rows':>5} {'buckets ms':>10} {'exact ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['model']:>8} {r['prompt_tokens']:>6} {r['rows_run']:>5} {r['buckets_ms']:>10} "
              f"{r['exact_ms']:>9} {r['ratio']:>6}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows, "loadavg": load,
                                   "threads": torch.get_num_threads()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
