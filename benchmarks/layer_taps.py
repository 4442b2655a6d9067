"""Benchmark: what layer taps cost per decode step, and what the transformers backend costs
against the torch backend on the same model, same run.

Recording levels, each the whole engine (``pipeline.generate``) on one model, greedy,
``ignore_eos``, the question "Why is the sky usually blue?":

- ``digest``: the default (no taps: the backend's tap is None, the model's forward checks
  one attribute per layer);
- ``taps``: ``recording="taps"``: every layer's hidden state at the step's position, hashed,
  with its max |x| and rms, at every step;
- ``taps+tensors``: ``taps`` with ``tap_tensors`` keeping one step's every layer whole.

Decode milliseconds per token come from the completion's timings ((total - first token) over
tokens - 1). Rounds interleave the levels (each round starts at another) so each sees the
same load; a figure is the median over rounds. ``--backends torch,transformers`` measures
the digest level on both backends of a Hugging Face folder (``--model``), one request and
``--batch`` requests at once (aggregate decode tokens/s).

"Off costs nothing" compares the ``digest`` figure with the same script's at a commit before
the taps existed (the script runs there unchanged: ``--levels digest``), on the same machine
in one sitting (docs/performance.md has the command and the figures).

Run: ``.venv/bin/python benchmarks/layer_taps.py [--model smollm2] [--rounds 5]
[--tokens 64] [--levels digest,taps,taps+tensors] [--backends torch]``; ``--smoke``: the
same code in seconds on the tiny model (one round of 4 tokens): it checks the script, its
figures mean nothing. Prints a table and writes ``--out`` (default
``benchmarks/results/layer_taps.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "layer_taps.json"
QUESTION = "Why is the sky usually blue?"
LEVELS = ("digest", "taps", "taps+tensors")


def _options(level: str) -> dict[str, Any]:
    if level == "digest":
        return {}
    if level == "taps":
        return {"recording": "taps"}
    return {"recording": "taps", "tap_tensors": "2:0-999"}


def _decode_ms(done: Any) -> float:
    t = done.timings
    n = len(done.token_ids)
    return 1e3 * (t.total_s - (t.first_token_s or 0.0)) / max(n - 1, 1)


def measure(model: str | None, backend: str | None, levels: list[str], rounds: int,
            tokens: int) -> dict[str, list[float]]:
    """Each level's decode ms/token per round, on one built pipeline."""
    from pipeline import build

    kwargs: dict[str, Any] = {"options": {"num_slots": 1}}
    if backend is not None:
        kwargs["backend"] = backend
    figures: dict[str, list[float]] = {level: [] for level in levels}
    with build(model, **kwargs) as pipe:
        pipe.generate(QUESTION, max_tokens=4, temperature=0)  # warm up
        for r in range(rounds):
            order = levels[r % len(levels):] + levels[:r % len(levels)]
            for level in order:
                done = pipe.generate(QUESTION, max_tokens=tokens, temperature=0,
                                     ignore_eos=True, **_options(level))
                figures[level].append(_decode_ms(done))
    return figures


def batch_rate(model: str | None, backend: str, batch: int, rounds: int, tokens: int
               ) -> list[float]:
    """Aggregate decode tokens/s of ``batch`` requests at once, per round."""
    import time

    from pipeline import build

    rates = []
    with build(model, backend=backend, options={"num_slots": batch}) as pipe:
        pipe.generate(QUESTION, max_tokens=4, temperature=0)  # warm up
        for r in range(rounds):
            started = time.perf_counter()
            handles = [pipe.submit(f"{QUESTION} ({r}.{i})", max_tokens=tokens, temperature=0,
                                   ignore_eos=True) for i in range(batch)]
            made = sum(len(h.result().token_ids) for h in handles)
            rates.append(made / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--backends", default=None,
                        help="also compare these backends at the digest level (a folder)")
    parser.add_argument("--batch", type=int, default=8,
                        help="requests at once for the backends' aggregate rate")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.rounds, args.tokens, args.batch = "tiny", 1, 4, 2
        args.backends = args.backends or "torch,transformers"
        args.out = args.out or Path(tempfile.gettempdir()) / "layer_taps-smoke.json"
    args.out = args.out or RESULTS
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    levels = [lv for lv in args.levels.split(",") if lv]
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown:
        parser.error(f"unknown level(s) {unknown}; known: {', '.join(LEVELS)}")
    figures = measure(args.model, None, levels, args.rounds, args.tokens)
    report: dict[str, Any] = {
        "model": args.model or "smollm2", "rounds": args.rounds, "tokens": args.tokens,
        "levels": {lv: {"decode_ms": statistics.median(v), "runs": v}
                   for lv, v in figures.items()}}
    base = report["levels"].get("digest", {}).get("decode_ms")
    print(f"{'level':<14}{'decode ms/token':>16}{'vs digest':>11}")
    for lv, row in report["levels"].items():
        ratio = row["decode_ms"] / base if base else float("nan")
        row["vs_digest"] = ratio
        print(f"{lv:<14}{row['decode_ms']:>16.2f}{ratio:>11.2f}")
    if args.backends:
        backends = {}
        for name in args.backends.split(","):
            runs = measure(args.model, name, ["digest"], args.rounds, args.tokens)["digest"]
            rates = batch_rate(args.model, name, args.batch, args.rounds, args.tokens)
            backends[name] = {"decode_ms": statistics.median(runs), "runs": runs,
                              "batch": args.batch,
                              "batch_tokens_per_s": statistics.median(rates)}
        report["backends"] = backends
        print(f"{'backend':<14}{'decode ms/token':>16}{f'{args.batch} at once, tok/s':>22}")
        for name, row in backends.items():
            print(f"{name:<14}{row['decode_ms']:>16.2f}{row['batch_tokens_per_s']:>22.1f}")
    report["loadavg"] = {"before": load_before,
                         "after": Path("/proc/loadavg").read_text().split()[:3]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"load {' '.join(load_before)} -> {' '.join(report['loadavg']['after'])}; "
          f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
