"""Benchmark: time to first token with and without a prefix-cache hit, same run.

The embedded default model (``build()``, SmolLM2). A shared document of ``--prefix-tokens``
tokens (the system message) is followed by a short question (about 32 tokens). ``cold``: the
document has never been seen (a fresh pipeline, so an empty cache); ``warm``: the same
pipeline answered another question about the same document just before, so every full
block of the shared part is cached and only the tail is computed. TTFT is the request's own
time to its first token (``Completion.timings.first_token_s``); ``cached_tokens`` comes from
its usage. Rounds alternate; the ratio is the median of per-round cold/warm ratios. Prints a
table and writes ``benchmarks/results/prefix_cache.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/prefix_cache.py [--rounds 3] [--prefix-tokens 2048]``;
``--smoke``: the same code in seconds on the tiny model (one round, a 64-token document): it
checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pipeline import build

OPTIONS = {"num_slots": 2, "kv_cache_bytes": 1 << 30}
SMOKE_OPTIONS = {"num_slots": 2}
"""The tiny model's default pool: room enough for the smoke run's short document."""
SENTENCE = ("The lighthouse on the northern cape was built of grey granite in the year the "
            "harbour froze, and its keeper wrote down every ship that passed. ")
QUESTIONS = ("In one sentence: what was the lighthouse built of, and when was that?",
             "In one sentence: what did the keeper of the lighthouse write down each day?")


def _document(pipe: Any, tokens: int) -> str:
    text = ""
    while pipe.count_tokens(text) < tokens:
        text += SENTENCE
    return text


def _ask(pipe: Any, document: str, question: str) -> tuple[float, int]:
    done = pipe.generate([{"role": "system", "content": document},
                          {"role": "user", "content": question}], max_tokens=1, temperature=0)
    return float(done.timings.first_token_s), int(done.usage.cached_tokens or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--model", default=None,
                        help="what build() takes (default: the default model)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/prefix_cache.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: one round, a 64-token document")
    args = parser.parse_args()
    options = OPTIONS
    if args.smoke:
        args.model, args.rounds, args.prefix_tokens, options = "tiny", 1, 64, SMOKE_OPTIONS
    args.out = args.out or (Path(tempfile.gettempdir()) / "prefix_cache-smoke.json"
                            if args.smoke else
                            Path(__file__).parent / "results" / "prefix_cache.json")
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        with build(args.model, options=options) as pipe:
            document = _document(pipe, args.prefix_tokens)
            prompt = pipe.count_tokens([{"role": "system", "content": document},
                                        {"role": "user", "content": QUESTIONS[1]}])
            cold, cold_cached = _ask(pipe, document, QUESTIONS[0])   # an empty cache
            warm, warm_cached = _ask(pipe, document, QUESTIONS[1])   # the document cached
        runs.append({"cold_s": cold, "warm_s": warm, "ratio": cold / warm,
                     "prompt_tokens": prompt, "cached_tokens": warm_cached,
                     "cold_cached_tokens": cold_cached, "loadavg": os.getloadavg()})
        print(f"round {r + 1}: prompt {prompt} tokens, cold TTFT {cold * 1e3:.0f} ms, warm "
              f"{warm * 1e3:.0f} ms ({warm_cached} cached), x{cold / warm:.1f}, load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    ratio = statistics.median(x["ratio"] for x in runs)
    print("\n| prompt tokens | cached (warm) | cold TTFT | warm TTFT | ratio (median) |")
    print("|---|---|---|---|---|")
    print(f"| {runs[-1]['prompt_tokens']} | {runs[-1]['cached_tokens']} | "
          f"{statistics.median(x['cold_s'] for x in runs) * 1e3:.0f} ms | "
          f"{statistics.median(x['warm_s'] for x in runs) * 1e3:.0f} ms | {ratio:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "ratio_median": ratio,
                                    "model": args.model or "default", "smoke": args.smoke},
                                   indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
