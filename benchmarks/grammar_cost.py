"""Benchmark: the grammar processor's per-step cost relative to a decode step, default model.

The embedded default model (``build()``, SmolLM2-135M, V = 49,152), batch 1 and 8, same run.
``decode``: B requests submitted together (``ignore_eos``, ``--tokens`` each) run in
lockstep; a step is (total - first token) / (tokens - 1) of a request, median of the B.
``grammar``: the pipeline's own ``grammar`` processor on B rows of a JSON-schema request, at
every step of a valid instance's token path (each row's matcher advanced by one token per
step, its bitmask computed and applied to ``[B, V]`` logits), median per step. The ratio is
grammar / decode; the goal is at most 10 %. Prints a table and writes
``benchmarks/results/grammar_cost.json`` (with ``/proc/loadavg`` before and after).

Run: ``.venv/bin/python benchmarks/grammar_cost.py [--tokens 64] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import Grammar, build
from pipeline.protocols import Batch, Row, Scores
from pipeline.types import GenerationConfig
from stages.grammar import GrammarProcessor

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "properties": {
                             "city": {"type": "string"}, "zip": {"type": "string"}}}}}
INSTANCE = ('{"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "tags": ["mathematics", '
            '"analytical engine", "poetry", "notes"], "address": {"city": "London", '
            '"zip": "W1"}}')
ASK = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def decode_step(pipe: Any, batch: int, tokens: int) -> float:
    handles = [pipe.submit(ASK, max_tokens=tokens, ignore_eos=True, seed=s, temperature=1.0)
               for s in range(batch)]
    steps = []
    for h in handles:
        done = h.result()
        steps.append((done.timings.total_s - done.timings.first_token_s) /
                     (len(done.token_ids) - 1))
    return statistics.median(steps)


def grammar_step(proc: GrammarProcessor, path: list[int], batch: int, vocab: int,
                 round_: int) -> float:
    config = GenerationConfig(grammar=Grammar.json_schema(SCHEMA))
    logits = torch.randn(batch, vocab)
    times = []
    for t in range(len(path)):
        rows = tuple(Row(f"r{round_}-{b}", config, (1,), path[:t], t + 1, b, frozenset({2}))
                     for b in range(batch))
        t0 = time.perf_counter()
        proc(Scores(logits), Batch(rows, vocab))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])   # the first step compiles the grammar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "grammar_cost.json")
    args = parser.parse_args()
    before = _loadavg()
    rows = []
    with build(options={"num_slots": 8}) as pipe:
        tok = pipe.stages.tokenizer
        assert tok is not None
        proc = GrammarProcessor(tok)
        path = tok.encode_text(INSTANCE)
        for batch in (1, 8):
            decode_step(pipe, batch, 8)                                   # warm-up
            dec = statistics.median(decode_step(pipe, batch, args.tokens)
                                    for _ in range(args.rounds))
            gram = statistics.median(grammar_step(proc, path, batch, tok.vocab_size, r)
                                     for r in range(args.rounds))
            rows.append({"batch": batch, "decode_step_ms": dec * 1e3,
                         "grammar_step_ms": gram * 1e3, "ratio": gram / dec})
            print(f"batch {batch}: decode step {dec * 1e3:7.2f} ms   grammar mask "
                  f"{gram * 1e3:6.3f} ms   ratio {gram / dec:6.1%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "loadavg_before": before,
                                    "loadavg_after": _loadavg(), "vocab": 49152,
                                    "path_tokens": len(path)}, indent=1))
    print(f"loadavg before {' '.join(before)}, after {' '.join(_loadavg())}; wrote {args.out}")


if __name__ == "__main__":
    main()
