"""Benchmark: the int8 KV cache (``BackendOptions(kv_cache_dtype="int8")``) against full precision.

One run, one model (``--model``: a name or folder ``build`` takes; default ``smollm2``, the
embedded SmolLM2-135M-Instruct GGUF file), the same prompts through two backends that differ
only in the cache:

- **memory**: bytes a position's keys and values take over all layers (float32, bfloat16 and
  int8 with its scales), and the longest context one slot gets in 1 GiB of cache;
- **logit error**: each prompt prefilled, then ``--steps`` decode steps fed the full-precision
  cache's greedy tokens into both (teacher forcing, so both see the same inputs); the largest
  and mean absolute difference of the logits, over the logits' own spread (their standard
  deviation per row), and how often the argmax agrees step by step;
- **greedy agreement**: each prompt decoded freely (``--steps`` greedy tokens) with each cache;
  how many prompts give the same tokens, and the mean length of the common prefix;
- **decode speed**: tokens per second of the free-running decode with each cache.

Prints a table, writes ``benchmarks/results/kv_int8.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/kv_int8.py [--prompts 200] [--steps 32]``; ``--smoke``: the
tiny model, 3 prompts, 4 steps: it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from backends.torch.backend import position_bytes
from pipeline import build
from pipeline.pipe import Pipeline
from pipeline.contracts.model import ModelCall

SUBJECTS = ("cats", "the sea", "prime numbers", "music", "trees", "rain", "bread", "stars",
            "rivers", "glass", "winter", "bridges", "bees", "clocks", "paper", "salt", "wind",
            "maps", "lamps", "honey")
FORMS = ("Tell me about {}.", "Write one sentence about {}.", "Why do people like {}?",
         "Explain {} to a child.", "What is surprising about {}?", "List three facts about {}.",
         "Describe {} in a few words.", "How would you draw {}?", "Give a short poem on {}.",
         "What do {} and time have in common?")


def prompts(n: int) -> list[str]:
    """``n`` everyday questions (subjects × forms, in a fixed order)."""
    out = [f.format(s) for f in FORMS for s in SUBJECTS]
    return out[:n]


def teacher_forced(full: Pipeline, int8: Pipeline, text: str, steps: int
                   ) -> tuple[list[float], list[float], int]:
    """Per step: max |Δlogit| / std and mean |Δlogit| / std; argmax agreements."""
    ids = tuple(full.tokenize(text).input_ids)
    backends = [p.engine.backend for p in (full, int8)]  # type: ignore[union-attr]
    slots = [b.allocate() for b in backends]
    try:
        logits = [b.forward([ModelCall(s, ids, 0, (len(ids) - 1,))])[0]
                  for b, s in zip(backends, slots)]
        worst, mean, agree = [], [], 0
        at = len(ids)
        for _ in range(steps):
            a, q = logits[0].float(), logits[1].float()
            spread = float(a.std()) or 1.0
            diff = (a - q).abs()
            worst.append(float(diff.max()) / spread)
            mean.append(float(diff.mean()) / spread)
            token = int(a.argmax())
            agree += token == int(q.argmax())
            logits = [b.forward([ModelCall(s, (token,), at, (0,))])[0]
                      for b, s in zip(backends, slots)]
            at += 1
        return worst, mean, agree
    finally:
        for b, s in zip(backends, slots):
            b.release(s)


def free_running(pipe: Pipeline, texts: list[str], steps: int) -> tuple[list[tuple[int, ...]], float]:
    """Each prompt's greedy tokens, and decode tokens per second over all of them."""
    outs, tokens, seconds = [], 0, 0.0
    for text in texts:
        started = time.perf_counter()
        done = pipe.generate(text, max_tokens=steps, temperature=0, ignore_eos=True)
        seconds += time.perf_counter() - started
        outs.append(done.token_ids)
        tokens += len(done.token_ids)
    return outs, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "kv_int8.json")
    args = parser.parse_args()
    model, n, steps = ("tiny", 3, 4) if args.smoke else (args.model, args.prompts, args.steps)
    texts = prompts(n)
    options: dict[str, Any] = {"num_slots": 1}
    full = build(model, options=options)
    int8 = build(model, options={**options, "kv_cache_dtype": "int8"})
    try:
        backend = full.engine.backend  # type: ignore[union-attr]
        spec, dtype = backend.model.spec, backend.model.dtype
        memory = {name: position_bytes(spec, d, q) for name, d, q in (
            ("float32", torch.float32, False), ("bfloat16", torch.bfloat16, False),
            ("int8", dtype, True))}
        gib = {name: (1 << 30) // b for name, b in memory.items()}
        worst, mean, agree = [], [], 0
        for text in texts:
            w, m, a = teacher_forced(full, int8, text, steps)
            worst += w
            mean += m
            agree += a
        ref, full_rate = free_running(full, texts, steps)
        got, int8_rate = free_running(int8, texts, steps)
    finally:
        full.close()
        int8.close()
    same = sum(a == b for a, b in zip(ref, got))
    prefix = statistics.mean(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                             for a, b in zip(ref, got))
    report = {
        "model": model, "smoke": args.smoke, "prompts": n, "steps": steps,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "bytes_per_position": memory, "context_in_1_gib": gib,
        "logits": {"max_abs_over_std": max(worst), "mean_abs_over_std": statistics.mean(mean),
                   "argmax_agreement": agree / (n * steps)},
        "greedy": {"same_sequences": same, "of": n, "mean_common_prefix": prefix},
        "decode_tok_s": {"full": full_rate, "int8": int8_rate},
        "machine": platform.processor() or platform.machine(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3]
        if Path("/proc/loadavg").exists() else None,
    }
    print(f"{model}: {n} prompts, {steps} steps, compute dtype {report['compute_dtype']}")
    print(f"{'cache':>9} | bytes/position | context in 1 GiB")
    for name in memory:
        print(f"{name:>9} | {memory[name]:>14,} | {gib[name]:>16,}")
    print(f"logits, int8 vs full: max |diff|/std {max(worst):.4f}, mean "
          f"{statistics.mean(mean):.5f}; argmax agrees at {agree}/{n * steps} steps")
    print(f"greedy: {same}/{n} sequences identical, mean common prefix {prefix:.1f}/{steps}")
    print(f"decode tok/s: full {full_rate:.1f}, int8 {int8_rate:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
