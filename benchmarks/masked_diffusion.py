"""Benchmark: the masked-diffusion samplers beside autoregressive decoding, same prompts, one run.

Models: ``tiny`` (the 6.3 M-parameter autoregressive model) with its ``autoregressive``
strategy, and ``tiny-masked`` (2.8 M parameters, the same corpus and tokenizer) with each
sampler setting in ``SETTINGS``. For every setting and prompt, one greedy request (temperature
0; ``dfm`` and random remasking draw from the seed) of at most ``--max-tokens`` tokens, alone
in the engine. Reported per setting, summed over the prompts:

* ``forwards/token`` — model calls (prefill, denoising passes, block writes, decode steps)
  per generated token, from the trace;
* ``tok/s`` — generated tokens per second of wall time (one request at a time; the fastest
  of ``--rounds`` rounds, as the machine may be shared);
* ``AR nll`` — the quality proxy: the mean negative log-likelihood (nats per token) of the
  generated tokens under the autoregressive model, given the prompt (lower is more like what
  the AR model would say; it favours the AR model's own output by construction).

Prints a table and writes ``benchmarks/results/masked_diffusion.json``.

Run: ``.venv/bin/python benchmarks/masked_diffusion.py [--max-tokens 32]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import build
from pipeline.protocols import ModelCall
from pipeline.types import Completion, GenerationConfig

PROMPTS = ("What is a list comprehension?", "What does the json module do?",
           "Explain the with statement.", "What is the os module for?")
SETTINGS: list[dict[str, Any]] = [
    {"model": "tiny", "strategy": "autoregressive"},
    {"model": "tiny-masked", "strategy": "llada", "block_length": 8, "steps": 8},
    {"model": "tiny-masked", "strategy": "llada", "block_length": 8, "steps": 4},
    {"model": "tiny-masked", "strategy": "llada", "block_length": 8, "steps": 2},
    {"model": "tiny-masked", "strategy": "llada", "block_length": 16, "steps": 16},
    {"model": "tiny-masked", "strategy": "llada", "block_length": 8, "steps": 8,
     "options": {"remasking": "random"}},
    {"model": "tiny-masked", "strategy": "fast_dllm", "block_length": 8,
     "options": {"threshold": 0.9}},
    {"model": "tiny-masked", "strategy": "fast_dllm", "block_length": 8,
     "options": {"threshold": 0.3}},
    {"model": "tiny-masked", "strategy": "dfm", "block_length": 8, "steps": 8},
    {"model": "tiny-masked", "strategy": "dfm", "block_length": 8, "steps": 4},
]


def label(setting: dict[str, Any]) -> str:
    """A short name for a setting."""
    parts = [setting["strategy"]]
    if "block_length" in setting:
        parts.append(f"L{setting['block_length']}")
    if "steps" in setting:
        parts.append(f"S{setting['steps']}")
    parts += [f"{k}={v}" for k, v in setting.get("options", {}).items()]
    return " ".join(parts)


def ar_nll(scorer: Any, prompt_ids: list[int], output: list[int]) -> tuple[float, int]:
    """Summed NLL of ``output`` after ``prompt_ids`` under the AR backend, and its length."""
    if not output:
        return 0.0, 0
    ids = prompt_ids + output
    slot = scorer.allocate()
    try:
        wanted = tuple(range(len(prompt_ids) - 1, len(ids) - 1))
        logits = scorer.forward([ModelCall(slot, tuple(ids), 0, wanted)])       # [n, V]
    finally:
        scorer.release(slot)
    logp = torch.log_softmax(logits.double(), -1)
    target = torch.tensor(output)
    return float(-logp.gather(1, target[:, None]).sum()), len(output)


def run(setting: dict[str, Any], scorer: Any, max_tokens: int, rounds: int) -> dict[str, Any]:
    """All prompts through one setting; the summed counts (times: the fastest round)."""
    kw = {k: setting[k] for k in ("block_length", "steps") if k in setting}
    pipe = build(setting["model"], strategy=setting["strategy"],
                 strategy_options=setting.get("options"), **kw)
    tokens = forwards = 0
    nll = 0.0
    replies = []
    config = GenerationConfig(max_tokens=max_tokens, temperature=0.0, seed=1)
    with pipe:
        pipe.generate(PROMPTS[0], max_tokens=4, temperature=0)  # warm-up
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            for prompt in PROMPTS:
                pipe.generate([{"role": "user", "content": prompt}], config)
            times.append(time.perf_counter() - started)
        seconds = min(times)
        for prompt in PROMPTS:
            done: Completion = pipe.generate([{"role": "user", "content": prompt}], config,
                                             recording="full")
            prompt_ids = list(next(e for e in done.trace if e.event_type == "input.tokenized")
                              .payload["input_ids"])
            forwards += 1 + sum(1 for e in done.trace if e.event_type == "decode.completed")
            tokens += len(done.token_ids)
            nll += ar_nll(scorer, prompt_ids, list(done.token_ids))[0]
            replies.append(done.text)
    return {"setting": label(setting), "tokens": tokens, "forwards": forwards,
            "forwards_per_token": forwards / max(tokens, 1), "tok_s": tokens / seconds,
            "ar_nll": nll / max(tokens, 1), "replies": replies}


def main() -> None:
    """Run every setting, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per setting")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with build("tiny") as ar:
        scorer = ar.engine.backend
        rows = [run(s, scorer, args.max_tokens, args.rounds) for s in SETTINGS]
    print(f"{'setting':32} {'tokens':>6} {'fwd/tok':>8} {'tok/s':>7} {'AR nll':>7}")
    for r in rows:
        print(f"{r['setting']:32} {r['tokens']:6d} {r['forwards_per_token']:8.2f} "
              f"{r['tok_s']:7.1f} {r['ar_nll']:7.2f}")
    out = Path(__file__).parent / "results" / "masked_diffusion.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"max_tokens": args.max_tokens, "rounds": args.rounds,
                               "prompts": PROMPTS,
                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
