"""Benchmark: autoregressive vs continuous diffusion vs flow on the same prompts, same run.

The three small models trained on the same corpus with the same tokenizer: ``tiny`` (AR),
``tiny-continuous`` (``ddim``, ``ddpm``) and ``tiny-flow`` (``flow``, Euler and Heun), each
answering the same questions (``--tokens`` at most, seeded). For each setting: model forwards
per generated token (every ``decode.completed``: a denoising pass, a block's write, or an AR
step; prefill excluded), generated tokens per second (wall clock of the whole request), and a
quality proxy, the perplexity of the output under the AR model given the prompt (lower is
more like the corpus; the AR model's own samples are the reference). Prints a table and
writes ``benchmarks/results/continuous.json``.

Run: ``.venv/bin/python benchmarks/continuous.py [--tokens 48] [--threads 1]``
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import build
from pipeline.protocols import ModelCall

PROMPTS = ("What is the os module?", "Explain the assert statement.", "What does str.split do?",
           "Tell me about the with statement.", "What is a generator?")
SETTINGS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("AR (sampled, T=0.7)", "tiny", "autoregressive", {}),
    ("DDIM 20 steps", "tiny-continuous", "ddim", {"steps": 20}),
    ("DDIM 8 steps", "tiny-continuous", "ddim", {"steps": 8}),
    ("DDPM 20 steps", "tiny-continuous", "ddpm", {"steps": 20}),
    ("flow Euler 16", "tiny-flow", "flow", {"steps": 16, "solver": "euler"}),
    ("flow Heun 8", "tiny-flow", "flow", {"steps": 8, "solver": "heun"}),
)


def perplexity(judge: Any, prompt_ids: list[int], output: list[int]) -> float:
    """exp(mean NLL) of ``output`` after ``prompt_ids`` under the judge's backend."""
    if not output:
        return float("nan")
    backend = judge.engine.backend
    slot = backend.allocate()
    try:
        ids = prompt_ids + output
        m = len(prompt_ids)
        logits = backend.forward([ModelCall(slot, tuple(ids), 0, tuple(range(m - 1, len(ids) - 1)))])
        nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(output))
        return math.exp(float(nll))
    finally:
        backend.release(slot)


def run(setting: tuple[str, str, str, dict[str, Any]], judge: Any, tokens: int) -> dict[str, Any]:
    label, model, strategy, options = setting
    forwards = generated = 0
    seconds, ppls, samples = 0.0, [], []
    with build(model, strategy=strategy, strategy_options=options) as pipe:
        pipe.generate("warm up", max_tokens=4, seed=0)
        for i, prompt in enumerate(PROMPTS):
            start = time.perf_counter()
            done = pipe.generate(prompt, max_tokens=tokens, seed=i, temperature=0.7,
                                 recording="full")
            seconds += time.perf_counter() - start
            forwards += sum(e.event_type == "decode.completed" for e in done.trace)
            generated += len(done.token_ids)
            prompt_ids = next(e.payload["input_ids"] for e in done.trace
                              if e.event_type == "input.tokenized")
            ppls.append(perplexity(judge, list(prompt_ids), list(done.token_ids)))
            samples.append({"prompt": prompt, "reply": done.text})
    finite = [p for p in ppls if math.isfinite(p)]
    return {"setting": label, "model": model, "strategy": strategy, "options": options,
            "tokens": generated, "forwards_per_token": forwards / max(generated, 1),
            "tokens_per_s": generated / seconds,
            "ar_perplexity": math.exp(sum(map(math.log, finite)) / len(finite)) if finite
            else float("nan"), "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48, help="max tokens per answer")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with build("tiny", options={"num_slots": 1, "dtype": "float32"}) as judge:
        rows = [run(s, judge, args.tokens) for s in SETTINGS]
    print(f"{'setting':22} {'tokens':>6} {'fwd/token':>10} {'tokens/s':>9} {'AR ppl':>9}")
    for r in rows:
        print(f"{r['setting']:22} {r['tokens']:6d} {r['forwards_per_token']:10.2f} "
              f"{r['tokens_per_s']:9.1f} {r['ar_perplexity']:9.1f}")
    out = Path(__file__).parent / "results" / "continuous.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"tokens": args.tokens, "threads": args.threads, "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
