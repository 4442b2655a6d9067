"""Benchmark: autoregressive, masked diffusion, continuous diffusion and flow, one run.

The four small models ship in the package, trained on the same corpus with the same tokenizer
(the masked one adds ``<|mask|>``): ``tiny`` (autoregressive, 6.3 M parameters),
``tiny-masked`` (masked diffusion, 2.8 M), ``tiny-continuous`` (diffusion over embeddings,
2.9 M) and ``tiny-flow`` (rectified flow over embeddings, 2.9 M). Every setting in
``SETTINGS`` answers the same ``PROMPTS`` (eight in the corpus's style, two outside it), one
request at a time, at most ``--max-tokens`` tokens each, request i seeded with i. Reported
per setting, summed over the prompts:

* ``fwd/tok`` — model forwards per generated token, counted from the traces (prefill chunks,
  denoising passes, block writes, decode steps); ``pos/tok`` — positions those forwards fed
  per generated token (a diffusion pass feeds its whole block);
* ``tok/s`` — generated tokens per second of wall time and ``tok/cpu-s`` per second of this
  process's CPU time (steadier on a shared machine), each the best of ``--rounds`` rounds;
* ``AR ppl`` — the quality proxy: the perplexity of the output under the tiny AR model given
  the same prompt (one forward of the AR backend, independent of any sampler); ``dist-2`` —
  the share of distinct token bigrams in the outputs (low: repetition, which a perplexity
  rewards).

``EXTRA_SETTINGS`` (shorter ``ddim`` blocks, with and without self-conditioning) run only when
named with ``--settings``.

Then the held-out likelihood of each family where it has one (``iterative_bounds.py``): the
AR model's exact NLL per token and the masked model's diffusion bound (Monte Carlo, with its
standard error) on the held-out conversations of the training scripts, whole and cut to their
first ``--held-out-window`` tokens (the masked model never saw a position past 127); none for
continuous diffusion and flow. Prints two tables, writes ``benchmarks/results/iterative.json`` with the
replies, the machine's load average before and after, and the command.

Run (niced: the machine may be shared)::

    nice -n 10 .venv/bin/python benchmarks/iterative.py [--max-tokens 48] [--rounds 3]

``--smoke`` runs the same code in seconds (one setting per family, one prompt of at most 6
tokens, one round, one held-out conversation cut to 16 tokens, two draws): it checks the
script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from backends.torch.backend import TorchBackend
from iterative_bounds import ar_held_out, ar_nll, held_out_conversations, masked_held_out
from pipeline import build
from pipeline.events import Event
from pipeline.model_paths import TINY_MASKED_MODEL_DIR, TINY_MODEL_DIR, generation_marker
from pipeline.contracts.output import Completion
from pipeline.contracts.request import GenerationConfig

PROMPTS = (
    "What is the json module?", "Explain the with statement.", "What does os.path.join do?",
    "Tell me about the random module.", "How does the assert statement work?",
    "What is the re module for?", "Describe the for statement.", "What does math.sqrt do?",
    "Why is the sky usually blue? Answer in one sentence.",   # outside the corpus
    "Write a short poem about the sea.",                      # outside the corpus
)


@dataclass(frozen=True)
class Setting:
    """One way to generate: a model, a strategy and its settings, the sampling config."""

    label: str
    family: str
    model: str
    strategy: str
    steps: int | None = None                 # build(steps=): masked diffusion
    block_length: int | None = None          # build(block_length=): masked diffusion
    options: dict[str, Any] = field(default_factory=dict)   # strategy_options
    temperature: float = 0.0


SMOKE_SETTINGS = ("AR greedy", "llada L8 S4", "ddim L16 S20", "flow heun L16 S8")
"""One setting of each family: what ``--smoke`` runs."""
SETTINGS: tuple[Setting, ...] = (
    Setting("AR greedy", "autoregressive", "tiny", "autoregressive"),
    Setting("AR sampled T=0.7", "autoregressive", "tiny", "autoregressive", temperature=0.7),
    Setting("llada L8 S8", "masked", "tiny-masked", "llada", 8, 8),
    Setting("llada L8 S4", "masked", "tiny-masked", "llada", 4, 8),
    Setting("llada random L8 S8", "masked", "tiny-masked", "llada", 8, 8,
            {"remasking": "random"}),
    Setting("llada random L8 S4", "masked", "tiny-masked", "llada", 4, 8,
            {"remasking": "random"}),
    Setting("fast_dllm L8 th=0.9", "masked", "tiny-masked", "fast_dllm", None, 8,
            {"threshold": 0.9}),
    Setting("fast_dllm L8 th=0.5", "masked", "tiny-masked", "fast_dllm", None, 8,
            {"threshold": 0.5}),
    Setting("dfm L8 S8", "masked", "tiny-masked", "dfm", 8, 8),
    Setting("ddim L16 S20", "continuous", "tiny-continuous", "ddim",
            options={"steps": 20, "block_length": 16}),
    Setting("ddpm L16 S20", "continuous", "tiny-continuous", "ddpm",
            options={"steps": 20, "block_length": 16}),
    Setting("flow euler L16 S16", "flow", "tiny-flow", "flow",
            options={"steps": 16, "solver": "euler", "block_length": 16}),
    Setting("flow heun L16 S8", "flow", "tiny-flow", "flow",
            options={"steps": 8, "solver": "heun", "block_length": 16}),
)
# Not in the default run; name them with --settings (docs/continuous_models.md uses them).
EXTRA_SETTINGS: tuple[Setting, ...] = (
    Setting("ddim L4 S20", "continuous", "tiny-continuous", "ddim",
            options={"steps": 20, "block_length": 4}),
    Setting("ddim L4 S20 no self-cond", "continuous", "tiny-continuous", "ddim",
            options={"steps": 20, "block_length": 4, "self_condition": False}),
)


def model_calls(trace: Sequence[Event]) -> dict[str, int]:
    """The forwards a request's trace records, by kind, and the positions they fed.

    One request at a time, so every ``prefill.*`` / ``decode.completed`` event is one
    backend forward of its own: ``passes`` read the cache and write nothing (denoising),
    ``writes`` are decode steps and block writes.
    """
    counts = {"prefill": 0, "passes": 0, "writes": 0, "positions": 0}
    for e in trace:
        if e.event_type in ("prefill.chunk", "prefill.completed"):
            counts["prefill"] += 1
            counts["positions"] += int(e.payload["tokens"])
        elif e.event_type == "decode.completed":
            counts["passes" if e.payload.get("write") is False else "writes"] += 1
            counts["positions"] += len(e.payload.get("token_ids", (0,)))
    return counts


def distinct_bigrams(outputs: Sequence[Sequence[int]]) -> float:
    """Distinct token bigrams over all bigrams, each output's own bigrams (nan: none)."""
    grams = [tuple(o[i:i + 2]) for o in outputs for i in range(len(o) - 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def generate_round(pipe: Any, setting: Setting, prompts: Sequence[str],
                   max_tokens: int) -> tuple[list[Completion], float, float]:
    """Every prompt once, request i seeded with i: (completions, wall s, CPU s)."""
    wall, cpu = time.perf_counter(), time.process_time()
    done = []
    for i, prompt in enumerate(prompts):
        config = GenerationConfig(max_tokens=max_tokens, temperature=setting.temperature, seed=i)
        done.append(pipe.generate([{"role": "user", "content": prompt}], config))
    return done, time.perf_counter() - wall, time.process_time() - cpu


def run_setting(setting: Setting, prompts: Sequence[str], max_tokens: int, rounds: int,
                scorer: TorchBackend) -> dict[str, Any]:
    """All prompts through one setting, ``rounds`` times; counts, times, quality, replies."""
    with build(setting.model, strategy=setting.strategy, steps=setting.steps,
               block_length=setting.block_length,
               strategy_options=setting.options or None) as pipe:
        pipe.generate("warm up", max_tokens=4, seed=0)
        runs = [generate_round(pipe, setting, prompts, max_tokens) for _ in range(rounds)]
        prompt_ids = [list(pipe.tokenize([{"role": "user", "content": p}]).input_ids)
                      for p in prompts]
    done = runs[-1][0]
    outputs = [list(c.token_ids) for c in done]
    calls = [model_calls(c.trace) for c in done]
    tokens = sum(map(len, outputs))
    nll = [ar_nll(scorer, p, o) for p, o in zip(prompt_ids, outputs)]
    total = {k: sum(c[k] for c in calls) for k in calls[0]}
    forwards = total["prefill"] + total["passes"] + total["writes"]
    per = max(tokens, 1)
    return {
        **asdict(setting), "tokens": tokens, "forwards": total,
        "forwards_per_token": forwards / per, "positions_per_token": total["positions"] / per,
        "tokens_per_s": tokens / min(r[1] for r in runs),
        "tokens_per_cpu_s": tokens / min(r[2] for r in runs),
        "round_seconds": [[round(r[1], 4), round(r[2], 4)] for r in runs],
        "same_output_every_round": all([list(c.token_ids) for c in r[0]] == outputs
                                       for r in runs),
        "ar_perplexity": float(torch.tensor(sum(nll) / per).exp()) if tokens else float("nan"),
        "distinct_bigrams": distinct_bigrams(outputs),
        "replies": [{"prompt": p, "text": c.text, "tokens": len(c.token_ids),
                     "finish": c.finish_reason.value, "ar_nll": round(n, 4)}
                    for p, c, n in zip(prompts, done, nll)],
    }


def held_out_bounds(limit: int | None, draws: int, block_length: int,
                    window: int) -> dict[str, Any]:
    """Each family's held-out likelihood where it has one (see ``iterative_bounds``), on the
    whole conversations and, when ``window`` > 0, on each one's first ``window`` tokens: the
    masked model was trained on rows of 128 tokens and never saw a later position."""
    docs, stats = held_out_conversations(limit)
    ar = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=1, dtype="float32")
    masked = TorchBackend.from_dir(TINY_MASKED_MODEL_DIR, num_slots=1, dtype="float32")
    marker = generation_marker(TINY_MASKED_MODEL_DIR)
    assert marker is not None, "the masked model lost its pipeline_generation marker"
    scopes = {"whole conversations": docs}
    if window:
        scopes[f"first {window} tokens"] = [d[:window] for d in docs]
    started = time.perf_counter()
    results = {scope: {"tiny": ar_held_out(ar, ds),
                       "tiny-masked": masked_held_out(masked, ds, int(marker["mask_token_id"]),
                                                      block_length, draws)}
               for scope, ds in scopes.items()}
    return {"data": stats, "seconds": round(time.perf_counter() - started, 1),
            "scopes": results, "none_computed": ["tiny-continuous", "tiny-flow"]}


def loadavg() -> str:
    """The first three fields of /proc/loadavg (1, 5, 15 minutes), or a note without it."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unavailable"


def print_tables(rows: Sequence[dict[str, Any]], bounds: dict[str, Any] | None) -> None:
    """The settings table, then the held-out table."""
    print(f"{'setting':24} {'tokens':>6} {'fwd/tok':>7} {'pos/tok':>7} {'tok/s':>7} "
          f"{'tok/cpu-s':>9} {'AR ppl':>8} {'dist-2':>6}")
    for r in rows:
        print(f"{r['label']:24} {r['tokens']:6d} {r['forwards_per_token']:7.2f} "
              f"{r['positions_per_token']:7.2f} {r['tokens_per_s']:7.1f} "
              f"{r['tokens_per_cpu_s']:9.1f} {r['ar_perplexity']:8.1f} "
              f"{r['distinct_bigrams']:6.2f}")
    if bounds is None:
        return
    data = bounds["data"]
    print(f"\nheld out: {data['conversations']} conversations, {data['tokens']} tokens "
          f"(corpus matches training: {data['corpus_matches_training']})")
    for scope, models in bounds["scopes"].items():
        print(f"{scope} ({models['tiny']['tokens']} tokens scored), nats/token:")
        for name, b in models.items():
            print(f"  {name:12} {b['bound']:40} {b['nats_per_token']:7.3f} "
                  f"± {b['standard_error']:.3f}")
    print(f"no bound computed: {', '.join(bounds['none_computed'])}")


def pick(names: Sequence[str] | None) -> list[Setting]:
    """The settings named (labels, exactly), or all of ``SETTINGS``; an unknown name is an
    error."""
    if not names:
        return list(SETTINGS)
    known = {s.label: s for s in SETTINGS + EXTRA_SETTINGS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    return [known[n] for n in names]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line flags; the defaults are the documented run."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer at most")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per setting")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS),
                        help=f"use the first N prompts (1..{len(PROMPTS)})")
    parser.add_argument("--settings", nargs="+", metavar="LABEL", help="only these settings")
    parser.add_argument("--held-out-docs", type=int, default=None,
                        help="held-out conversations to score (default: all); 0 skips them")
    parser.add_argument("--draws", type=int, default=4,
                        help="Monte-Carlo draws per block of the masked bound (>= 2)")
    parser.add_argument("--elbo-block-length", type=int, default=8,
                        help="block length of the masked bound (the model's default: 8)")
    parser.add_argument("--held-out-window", type=int, default=128,
                        help="also score each held-out conversation's first N tokens (the "
                             "masked model's training row length); 0 skips that")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/iterative.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: one setting per family, one short prompt, one round, "
                             "one held-out conversation")
    args = parser.parse_args(argv)
    if args.smoke:
        args.settings, args.prompts, args.max_tokens, args.rounds = list(SMOKE_SETTINGS), 1, 6, 1
        args.held_out_docs, args.held_out_window, args.draws = 1, 16, 2
    args.out = args.out or (Path(tempfile.gettempdir()) / "iterative-smoke.json" if args.smoke
                            else Path(__file__).parent / "results" / "iterative.json")
    for name, low in (("max_tokens", 1), ("rounds", 1), ("draws", 2), ("threads", 1),
                      ("elbo_block_length", 1)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}, got {args.prompts}")
    if args.held_out_window == 1 or args.held_out_window < 0:
        parser.error(f"--held-out-window must be 0 or >= 2, got {args.held_out_window}")
    if args.held_out_docs is not None and args.held_out_docs < 0:
        parser.error(f"--held-out-docs must be >= 0, got {args.held_out_docs}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every setting and the held-out bounds; print the tables, write the JSON."""
    args = parse_args(argv)
    settings = pick(args.settings)
    torch.set_num_threads(args.threads)
    before, started = loadavg(), time.perf_counter()
    prompts = PROMPTS[:args.prompts]
    scorer = TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=1, dtype="float32")
    rows = [run_setting(s, prompts, args.max_tokens, args.rounds, scorer) for s in settings]
    bounds = (None if args.held_out_docs == 0 else
              held_out_bounds(args.held_out_docs, args.draws, args.elbo_block_length,
                              args.held_out_window))
    print_tables(rows, bounds)
    report = {
        "command": " ".join(["benchmarks/iterative.py", *(argv if argv is not None
                                                          else sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads,
                    "python": platform.python_version(), "torch": torch.__version__,
                    "loadavg_before": before, "loadavg_after": loadavg(),
                    "seconds": round(time.perf_counter() - started, 1)},
        "prompts": list(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds,
        "rows": rows, "held_out": bounds}
    print(f"\nload average before {before}, after {report['machine']['loadavg_after']}; "
          f"{report['machine']['seconds']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
