"""Benchmark: per-step cost of processor chain + selection against transformers, same run.

Times ``AutoregressiveStrategy.update`` (our chain with the default order, then the
``sample`` selector) and transformers' ``LogitsProcessorList`` followed by its selection
(``argmax`` for greedy; ``softmax`` + ``torch.multinomial`` for sampling) on the same logits,
at the Qwen vocabulary size V = 151,936 and batch sizes 1 and 16. Configurations:

- ``greedy``: temperature 0 (transformers: plain argmax);
- ``full``: repetition_penalty 1.1 over 200 previous tokens, temperature 0.8, top_k 50,
  top_p 0.9, min_p 0.05, then sampling;
- ``top_p_dense``: temperature 0.8, top_p 0.9 on the whole vocabulary, then sampling.

Logits are LM-like (a Zipf-shaped ranking plus noise, shuffled) and cloned before every call
outside the timed region (our processors work in place). Each figure is the median over
``--iters`` calls after ``--warmup``. The headline columns alternate ours and transformers call
by call, so both see the same machine load and each starts with caches the other just used
(the situation of a sampler after a forward pass); the "back to back" columns time each one
in its own loop with warm caches. Prints a table, writes ``benchmarks/results/processors.json``
(``--out``).

Run: ``.venv/bin/python benchmarks/processors.py [--iters 50] [--warmup 5]``; ``--smoke``: the
same code in seconds (V = 4,096, B = 1 and 4, two calls after one warm-up): it checks the
script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Batch, Row
from pipeline.contracts.request import GenerationConfig
from stages.process import DEFAULT_ORDER, ProcessorChain, make_processor
from stages.select import SamplingSelector
from stages.strategies import AutoregressiveStrategy

VOCAB = 151_936
SMOKE_VOCAB = 4096
HISTORY = 200
RESULTS = Path(__file__).parent / "results" / "processors.json"

CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "full": {"repetition_penalty": 1.1, "temperature": 0.8, "top_k": 50, "top_p": 0.9,
             "min_p": 0.05},
    "top_p_dense": {"temperature": 0.8, "top_p": 0.9},
}


def lm_like_logits(batch: int, generator: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """``[B, V]`` float32 logits shaped like a language model's: Zipf ranks plus noise."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.2 * torch.log(ranks)  # [V]
    rows = [base[torch.randperm(vocab, generator=generator)] for _ in range(batch)]
    noise = torch.randn(batch, vocab, generator=generator) * 0.5
    return torch.stack(rows) + noise + 10.0


def transformers_list(config: dict[str, Any]) -> LogitsProcessorList:
    """transformers' processors for ``config``, in the order ``generate`` builds them."""
    procs: list[Any] = []
    if config.get("repetition_penalty", 1.0) != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(config["repetition_penalty"]))
    if config.get("temperature", 1.0) not in (0.0, 1.0):
        procs.append(TemperatureLogitsWarper(config["temperature"]))
    if config.get("top_k", 0):
        procs.append(TopKLogitsWarper(config["top_k"]))
    if config.get("top_p", 1.0) < 1.0:
        procs.append(TopPLogitsWarper(config["top_p"]))
    if config.get("min_p", 0.0):
        procs.append(MinPLogitsWarper(config["min_p"]))
    return LogitsProcessorList(procs)


def transformers_step(config: dict[str, Any]) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """One transformers step: processors, then argmax or softmax + multinomial."""
    procs = transformers_list(config)
    greedy = config.get("temperature", 1.0) == 0.0

    def step(input_ids: torch.Tensor, logits: torch.Tensor) -> Any:
        scores = procs(cast(torch.LongTensor, input_ids), logits)
        if greedy:
            return torch.argmax(scores, dim=-1).tolist()
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1).tolist()

    return step


def our_batch(config: dict[str, Any], history: torch.Tensor, vocab: int = VOCAB) -> Batch:
    """A batch of rows with ``config`` and ``history [B, HISTORY]`` (half prompt, half output)."""
    cfg = GenerationConfig(**config)
    half = HISTORY // 2
    rows = tuple(
        Row(f"r{b}", cfg, tuple(history[b, :half].tolist()), tuple(history[b, half:].tolist()),
            step=half + 1, seed=1000 + b, eos_token_ids=frozenset({vocab - 1}))
        for b in range(history.shape[0]))
    return Batch(rows, vocab)


def _time(call: Callable[[torch.Tensor], Any], logits: torch.Tensor) -> float:
    """Milliseconds of one call on a fresh copy of ``logits`` (the copy is not timed)."""
    x = logits.clone()
    start = time.perf_counter()
    call(x)
    return (time.perf_counter() - start) * 1e3


def _medians(calls: dict[str, Callable[[torch.Tensor], Any]], logits: torch.Tensor,
             iters: int, warmup: int, interleave: bool) -> dict[str, float]:
    """Median ms per call of each of ``calls``: alternating call by call, or each in a row."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    if interleave:
        for i in range(warmup + iters):
            for name, call in calls.items():
                t = _time(call, logits)
                if i >= warmup:
                    times[name].append(t)
    else:
        for name, call in calls.items():
            runs = [_time(call, logits) for _ in range(warmup + iters)]
            times[name] = runs[warmup:]
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(config: dict[str, Any], batch: int, iters: int, warmup: int,
            vocab: int = VOCAB) -> dict[str, Any]:
    """Median milliseconds per step, ours and transformers, for one configuration.

    The headline figures alternate the two implementations call by call, so each runs right
    after the other's work, as a sampler runs right after a model's forward pass; the
    ``*_alone`` figures run each one back to back (warm caches), for comparison.
    """
    gen = torch.Generator().manual_seed(batch)
    logits = lm_like_logits(batch, gen, vocab)
    history = torch.randint(0, vocab, (batch, HISTORY), generator=gen)
    rows = our_batch(config, history, vocab)
    ours = AutoregressiveStrategy(ProcessorChain([make_processor(n) for n in DEFAULT_ORDER]),
                                  SamplingSelector())
    states = [ours.start(row, Forcing.none()) for row in rows.rows]
    theirs = transformers_step(config)
    torch.manual_seed(0)
    calls: dict[str, Callable[[torch.Tensor], Any]] = {
        "ours": lambda x: ours.update(states, rows.rows, torch.split(x, 1)),  # a [1, V] row each
        "transformers": lambda x: theirs(history, x),
    }
    mixed = _medians(calls, logits, iters, warmup, interleave=True)
    alone = _medians(calls, logits, iters, warmup, interleave=False)
    return {"B": batch, "ours_ms": mixed["ours"], "transformers_ms": mixed["transformers"],
            "ratio": mixed["ours"] / mixed["transformers"],
            "ours_alone_ms": alone["ours"], "transformers_alone_ms": alone["transformers"],
            "ratio_alone": alone["ours"] / alone["transformers"]}


def main() -> None:
    """Run every configuration at B = 1 and 16, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: V = 4,096, B = 1 and 4, two calls per figure after "
                             "one warm-up")
    args = parser.parse_args()
    vocab, batches = VOCAB, (1, 16)
    if args.smoke:
        args.iters, args.warmup, vocab, batches = 2, 1, SMOKE_VOCAB, (1, 4)
    out = args.out or (Path(tempfile.gettempdir()) / "processors-smoke.json" if args.smoke
                       else RESULTS)
    results = []
    print(f"{'config':<12} {'B':>3} {'ours ms':>10} {'transformers ms':>16} {'ratio':>7}"
          f"   {'(back to back:':>14} {'ours':>7} {'transformers':>12} {'ratio)':>7}")
    for name, config in CONFIGS.items():
        for batch in batches:
            row = {"config": name, **measure(config, batch, args.iters, args.warmup, vocab)}
            results.append(row)
            print(f"{name:<12} {batch:>3} {row['ours_ms']:>10.3f} "
                  f"{row['transformers_ms']:>16.3f} {row['ratio']:>7.3f}   {'':>14} "
                  f"{row['ours_alone_ms']:>7.3f} {row['transformers_alone_ms']:>12.3f} "
                  f"{row['ratio_alone']:>7.3f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "vocab_size": vocab, "smoke": args.smoke, "history_tokens": HISTORY, "iters": args.iters,
        "warmup": args.warmup, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "configs": CONFIGS, "results": results,
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
