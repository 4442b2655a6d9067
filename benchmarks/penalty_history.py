"""Benchmark: a penalty step's cost against the length of the output, with and without state.

The three penalties (``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``) over
B rows at V = 49,152 (SmolLM2's vocabulary), after N committed output tokens (random ids, a
prompt of 200), one step at a time: the **ids path** rebuilds each row's tables from its ids
every step (what a row with no state gets), the **state path** reads each request's
:class:`~stages.process.penalties.TokenCounts`, advanced by the one token each step commits
(what the autoregressive and speculative strategies keep). Both paths give the same scores
(``tests/test_processor_state.py``); the check here repeats that on the timed inputs. Each
figure is the median of ``--iters`` steps after ``--warmup``. Prints a table, writes
``benchmarks/results/penalty_history.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/penalty_history.py [--iters 30]``; ``--smoke``: V = 4,096,
N up to 200, three steps: it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
from stages.process.chain import ProcessorChain
from stages.process.penalties import FrequencyPenalty, PresencePenalty, RepetitionPenalty

CONFIG = GenerationConfig(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)


def _rows(vocab: int, history: int, batch: int, chain: ProcessorChain
          ) -> tuple[list[Row], list[list[int]], list[dict[str, Any]]]:
    """Rows over live output lists (as the engine's are), and their states."""
    rng = random.Random(history)
    rows, outs, states = [], [], []
    for b in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(200)]
        out = [rng.randrange(vocab) for _ in range(history)]
        state = chain.start(Row(f"r{b}", CONFIG, prompt, [], 1, 0, frozenset({0})))
        for token in out:
            chain.advance(state, token)
        rows.append(Row(f"r{b}", CONFIG, prompt, out, history + 1, 0, frozenset({0})))
        outs.append(out)
        states.append(state)
    return rows, outs, states


def _time(step: Any, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(vocab: int, history: int, batch: int, iters: int, warmup: int) -> dict[str, Any]:
    """Median ms per step of the ids path and the state path, N = ``history`` (each path on
    rows of its own, one token committed per step)."""
    chain = ProcessorChain([RepetitionPenalty(), PresencePenalty(), FrequencyPenalty()])
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(history)) * 3
    rows, outs, _ = _rows(vocab, history, batch, chain)

    def ids_step() -> torch.Tensor:
        for out in outs:
            out.append(7)  # one token committed
        return chain(Scores(logits.clone()), Batch(tuple(rows), vocab)).values

    s_rows, s_outs, states = _rows(vocab, history, batch, chain)

    def state_step() -> torch.Tensor:
        for out, state in zip(s_outs, states):
            out.append(7)
            chain.advance(state, 7)
        stateful = tuple(r.with_states(s) for r, s in zip(s_rows, states))
        return chain(Scores(logits.clone()), Batch(stateful, vocab)).values

    ids_ms = _time(ids_step, iters, warmup)
    state_ms = _time(state_step, iters, warmup)
    return {"history": history, "batch": batch, "ids_ms": ids_ms, "state_ms": state_ms,
            "same_scores": _same(chain, s_rows, states, logits, vocab)}


def _same(chain: ProcessorChain, rows: list[Row], states: list[dict[str, Any]],
          logits: torch.Tensor, vocab: int) -> bool:
    """Whether the state path gives the scores the ids path gives on the same rows."""
    plain = chain(Scores(logits.clone()), Batch(tuple(rows), vocab)).values
    stateful = tuple(r.with_states(s) for r, s in zip(rows, states))
    return torch.equal(chain(Scores(logits.clone()), Batch(stateful, vocab)).values, plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "penalty_history.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    vocab, histories = (4096, (10, 200)) if args.smoke else (49152, (100, 1000, 4000, 16000))
    iters, warmup = (3, 1) if args.smoke else (args.iters, args.warmup)
    results = [measure(vocab, n, args.batch, iters, warmup) for n in histories]
    print(f"three penalties, B={args.batch}, V={vocab}, one thread (median ms per step)")
    print(f"{'output tokens':>14} | {'ids path':>9} | {'state path':>10} | same scores")
    for r in results:
        print(f"{r['history']:>14} | {r['ids_ms']:9.3f} | {r['state_ms']:10.3f} | "
              f"{r['same_scores']}")
    report = {"vocab_size": vocab, "smoke": args.smoke, "threads": 1,
              "machine": platform.processor() or platform.machine(),
              "loadavg": Path("/proc/loadavg").read_text().split()[:3]
              if Path("/proc/loadavg").exists() else None,
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
