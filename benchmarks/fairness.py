"""Benchmark: decoding requests' inter-token latency while a long prompt arrives, same run.

Four greedy requests decode on the embedded default model (``build()``, SmolLM2) with
``ignore_eos``. Phase ``solo``: they decode alone. Phase ``arrival``: the same four, and once
each has 16 tokens a ``--prompt-tokens`` prompt arrives (one new token asked). Inter-token
latency is read from each request's trace: the gaps between consecutive ``token.selected``
events (the engine's clock), over the window from the long request's admission
(``prefill.started``) to its first token. The ratio is the p99 gap with the arrival over the
p99 gap alone (the goal: at most 2). The long prompt's time to first token is reported too.

Configurations: ``paced`` (the default engine: the step budget bounds latency,
``step_latency_ratio=1.5``), ``tokens-only`` (pacing off: the token budget and a 512-token chunk
only, the behaviour before pacing) and ``tokens-only-4096`` (pacing off, one 4,096-token chunk).
Rounds interleave the configurations. Prints a table and writes
``benchmarks/results/fairness.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/fairness.py [--rounds 3] [--prompt-tokens 4096]``;
``--smoke``: the same code in seconds on the tiny model (``paced`` once, a 160-token prompt,
a few dozen tokens; checks the script, its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline import build
from pipeline.engine import EngineConfig
from pipeline.contracts.output import Completion

CONFIGS: dict[str, EngineConfig] = {
    "paced": EngineConfig(),
    "tokens-only": EngineConfig(step_latency_ratio=None),
    "tokens-only-4096": EngineConfig(token_budget=4200, max_prefill_chunk=4096,
                                     step_latency_ratio=None),
}
OPTIONS = {"num_slots": 5, "kv_cache_bytes": 2 << 30}
"""Five slots (four decoding, one long prompt) with room for a 4,096-token prompt each."""
SMOKE_OPTIONS = {"num_slots": 5, "max_context": 1024}
"""The same slots on the tiny model, each window room for the smoke run's prompt."""
QUESTION = "Write a long story about a lighthouse keeper and the sea."


def _selected_ns(done: Completion) -> list[int]:
    return [e.monotonic_ns for e in done.trace if e.event_type == "token.selected"]


def _gaps(times: list[int], start: int, end: int) -> list[float]:
    """Seconds between consecutive tokens whose later token falls in [start, end]."""
    return [(b - a) / 1e9 for a, b in zip(times, times[1:]) if start <= b <= end]


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def _long_prompt(pipe: Any, tokens: int) -> str:
    """A user message whose rendered prompt has about ``tokens`` tokens."""
    words = ("the keeper watched the grey water turn under a low sky while gulls circled "
             "the rocks and the lamp turned slowly through the night ")
    text = ""
    while pipe.count_tokens(text) < tokens:
        text += words
    return text


def one_run(config: EngineConfig, long_text: str | None, decode_tokens: int,
            model: str | None = None, options: dict[str, Any] = OPTIONS) -> dict[str, Any]:
    """Four requests decoding ``decode_tokens`` each (with ``long_text`` arriving once they are
    under way, when given) on ``model`` (None: the default model): p99 and median gap."""
    with build(model, engine=config, options=options) as pipe:
        pipe.generate("warm up", max_tokens=4, temperature=0)
        handles = [pipe.submit(f"{QUESTION} ({i})", max_tokens=decode_tokens, temperature=0,
                               ignore_eos=True) for i in range(4)]
        long = None
        if long_text is not None:
            counts = [0] * len(handles)
            for i, h in enumerate(handles):
                def count(delta: Any, i: int = i) -> None:
                    counts[i] += len(delta.token_ids)
                h.add_listener(count)
            while min(counts) < 16:  # each decoding request is well under way
                time.sleep(0.02)
            long = pipe.submit(long_text, max_tokens=1, temperature=0)
        done = [h.result() for h in handles]
        long_done = long.result() if long is not None else None
    times = [_selected_ns(d) for d in done]
    if long_done is not None:
        started = next(e.monotonic_ns for e in long_done.trace
                       if e.event_type == "prefill.started")
        first = next(e.monotonic_ns for e in long_done.trace
                     if e.event_type == "token.selected")
        window = (started, first)
        ttft = long_done.timings.first_token_s
        prompt_tokens = long_done.usage.prompt_tokens
    else:
        window = (min(t[8] for t in times), max(t[-1] for t in times))
        ttft, prompt_tokens = None, 0
    gaps = [g for t in times for g in _gaps(t, *window)]
    return {"p99_s": _p99(gaps), "median_s": statistics.median(gaps), "gaps": len(gaps),
            "long_ttft_s": ttft, "long_prompt_tokens": prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/fairness.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: paced once, 160-token prompt")
    args = parser.parse_args()
    model, options, solo_tokens, arrival_tokens = None, OPTIONS, 160, 400
    if args.smoke:
        args.rounds, args.prompt_tokens, args.configs = 1, 160, ["paced"]
        model, options, solo_tokens, arrival_tokens = "tiny", SMOKE_OPTIONS, 16, 64
    args.out = args.out or (Path(tempfile.gettempdir()) / "fairness-smoke.json" if args.smoke
                            else Path(__file__).parent / "results" / "fairness.json")
    with build(model, options=options) as pipe:
        long_text = _long_prompt(pipe, args.prompt_tokens)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in args.configs}
    for r in range(args.rounds):
        names = args.configs[r % len(args.configs):] + args.configs[:r % len(args.configs)]
        for name in names:
            config = CONFIGS[name]
            solo = one_run(config, None, solo_tokens, model, options)
            arrival = one_run(config, long_text, arrival_tokens, model, options)
            rows[name].append({"solo": solo, "arrival": arrival,
                               "ratio": arrival["p99_s"] / solo["p99_s"],
                               "loadavg": os.getloadavg()})
            print(f"round {r + 1} {name}: solo p99 {solo['p99_s'] * 1e3:.1f} ms, with the "
                  f"{arrival['long_prompt_tokens']}-token arrival p99 "
                  f"{arrival['p99_s'] * 1e3:.1f} ms (x{rows[name][-1]['ratio']:.2f}), long "
                  f"TTFT {arrival['long_ttft_s']:.2f} s, load {os.getloadavg()[0]:.1f}",
                  flush=True)
    print()
    print("| configuration | solo p99 ITL | p99 ITL with arrival | ratio (median) | long TTFT |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, runs in rows.items():
        ratio = statistics.median(x["ratio"] for x in runs)
        solo = statistics.median(x["solo"]["p99_s"] for x in runs)
        arr = statistics.median(x["arrival"]["p99_s"] for x in runs)
        ttft = statistics.median(x["arrival"]["long_ttft_s"] for x in runs)
        summary[name] = {"ratio_median": ratio, "solo_p99_s": solo, "arrival_p99_s": arr,
                         "long_ttft_s": ttft}
        print(f"| {name} | {solo * 1e3:.1f} ms | {arr * 1e3:.1f} ms | {ratio:.2f} | "
              f"{ttft:.2f} s |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": rows,
                                    "model": model or "default", "smoke": args.smoke,
                                    "prompt_tokens": args.prompt_tokens,
                                    "machine": platform.platform(),
                                    "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
