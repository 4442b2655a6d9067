"""Benchmark: the cost of the batch-invariant mode (``BackendOptions(batch_invariant=...)``).

For each model, builds the pipeline twice in one process, invariant off and on, and times the
same work with each, interleaved (off, on, off, on, ...) so machine load hits both alike:

- ``prefill``: one prompt of about ``--prompt`` tokens, greedy, one new token (time to the
  first token);
- ``decode``: ``--tokens`` greedy tokens after a short prompt, one request alone (ms per token
  past the first);
- ``decode x8``: eight such requests at once (ms per step, each step decodes eight rows).

Reports the best of ``--repeat`` runs per cell and the on/off ratio. Prints a table, the load
average before and after, and writes ``benchmarks/results/batch_invariance.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/batch_invariance.py [--models smollm2,tiny]
[--threads 2] [--repeat 5]``; ``--smoke``: the same code in seconds on the tiny model (one
repeat, a 16-token prompt, 4 tokens; checks the script, its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import build
from pipeline.options import BackendOptions
from pipeline.pipe import Pipeline

RESULTS = Path(__file__).parent / "results"
WORDS = "the river ran past the old mill where a miller kept bees and wrote letters".split()


def _prompt(tokens: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens))


def _prefill(p: Pipeline, prompt: str) -> float:
    t = time.perf_counter()
    p.generate(prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - t


def _decode(p: Pipeline, tokens: int, width: int) -> float:
    """Seconds per decode step past the first token, ``width`` requests at once."""
    handles = [p.submit(f"Tell me about item {i}.", max_tokens=tokens, temperature=0,
                        ignore_eos=True) for i in range(width)]
    done = [h.result() for h in handles]
    steps = min(len(c.token_ids) for c in done) - 1
    total = max(c.timings.total_s - c.timings.first_token_s for c in done)
    return total / max(1, steps)


def measure(model: str, dtype: str | None, args: argparse.Namespace) -> dict[str, Any]:
    pipes = {inv: build(model, options=BackendOptions(dtype=dtype, batch_invariant=inv))
             for inv in (False, True)}
    prompt = _prompt(args.prompt)
    cells: dict[str, dict[bool, float]] = {"prefill": {}, "decode": {}, "decode x8": {}}
    try:
        for p in pipes.values():  # warm-up
            _prefill(p, prompt)
            _decode(p, 4, 1)
        for _ in range(args.repeat):
            for inv, p in pipes.items():
                for name, run in (("prefill", lambda: _prefill(p, prompt)),
                                  ("decode", lambda: _decode(p, args.tokens, 1)),
                                  ("decode x8", lambda: _decode(p, args.tokens, 8))):
                    took = run()
                    cells[name][inv] = min(cells[name].get(inv, float("inf")), took)
        used = pipes[True].model_info().dtype
    finally:
        for p in pipes.values():
            p.close()
    return {"model": model, "dtype": used,
            "cells": {k: {"off_ms": v[False] * 1e3, "on_ms": v[True] * 1e3,
                          "ratio": v[True] / v[False]} for k, v in cells.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,tiny,tiny:float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None, help=f"JSON file (default "
                        f"{RESULTS / 'batch_invariance.json'}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: one repeat, 16-token prompt, 4 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.repeat, args.prompt, args.tokens = "tiny", 1, 16, 4
    out = args.out or (Path(tempfile.gettempdir()) / "batch_invariance-smoke.json"
                       if args.smoke else RESULTS / "batch_invariance.json")
    torch.set_num_threads(args.threads)
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    rows = []
    for item in args.models.split(","):
        model, _, dtype = item.partition(":")
        rows.append(measure(model, dtype or None, args))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(f"threads {args.threads}; load average before {' '.join(load_before)}, "
          f"after {' '.join(load_after)}")
    print(f"{'model':<10} {'dtype':<9} {'work':<10} {'off ms':>9} {'on ms':>9} {'on/off':>7}")
    for row in rows:
        for name, cell in row["cells"].items():
            print(f"{row['model']:<10} {row['dtype']:<9} {name:<10} {cell['off_ms']:>9.2f} "
                  f"{cell['on_ms']:>9.2f} {cell['ratio']:>7.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": args.threads, "load_before": load_before,
                               "load_after": load_after, "prompt_tokens": args.prompt,
                               "decode_tokens": args.tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
