"""Benchmark: the grammar processor's per-step cost relative to a decode step, default model.

The embedded default model (``build()``, SmolLM2-135M, V = 49,152), batch 1 and 8, same run.
``decode``: B requests submitted together (``ignore_eos``, ``--tokens`` each) run in
lockstep; a step is (total - first token) / (tokens - 1) of a request, median of the B.
``grammar``: the pipeline's own ``grammar`` processor on B rows of a constrained request, at
every step of a valid output's token path (each row's matcher advanced by one token per
step, its bitmask computed and applied to ``[B, V]`` logits), median per step, for each
constraint kind: a JSON schema, any JSON object (the repeated-key guard working), a regular
expression, a choice among 24 strings, and a forced Hermes tool call (a Lark grammar with an
embedded schema); each with a roomy ``max_tokens`` (1024) and with a budget that leaves only
four tokens of slack beside the output (the closing path measured and the likeliest
structure-opening tokens checked at every step: the steering's worst case). The ratio is
grammar / decode; the goal is at most 10 %. Prints a table and writes
``benchmarks/results/grammar_cost.json`` (with ``/proc/loadavg`` before and after).

Run: ``.venv/bin/python benchmarks/grammar_cost.py [--tokens 64] [--rounds 3]``;
``--smoke``: the same code in seconds on the tiny model (V = 6,144; batch 1 and 2, one round of
4 tokens):
it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline import Grammar, build
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
from stages.structured import GrammarProcessor

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


def kinds(tok: Any) -> list[tuple[str, Grammar, str, tuple[int, ...]]]:
    """(name, grammar, a valid output, forced prefix ids) per constraint kind."""
    from pipeline.contracts.request import ToolSpec
    from pipeline.tools.choice import special_marker
    from pipeline.tools.grammars import HermesCalls

    words = [f"option number {i}" for i in range(24)]
    tool = ToolSpec("get_weather", "Weather", {"type": "object", "required": ["city", "unit"],
                                               "properties": {"city": {"type": "string"},
                                                              "unit": {"enum": ["c", "f"]}}})
    forced = HermesCalls().forced([tool], parallel=False, marker=special_marker(tok))
    call = forced.prefix + '{"name": "get_weather", "arguments": {"city": "Paris", ' \
                           '"unit": "c"}}\n</tool_call>'
    prefix = tuple(tok.encode_text(forced.prefix, special=True))
    return [("json_schema", Grammar.json_schema(SCHEMA), INSTANCE, ()),
            ("json_object", Grammar.json_object(), INSTANCE, ()),
            ("regex", Grammar.regex(r"[A-Z][a-z]+( [A-Z][a-z]+)*, [0-9]{5}"),
             "Ada Lovelace Byron, 12345", ()),
            ("choice", Grammar.choice(words), words[17], ()),
            ("tool_call", forced.grammar, call, prefix)]


def grammar_step(proc: GrammarProcessor, grammar: Grammar, path: list[int], batch: int,
                 vocab: int, round_: int, max_tokens: int) -> float:
    config = GenerationConfig(grammar=grammar, max_tokens=max_tokens)
    logits = torch.randn(batch, vocab)
    times = []
    for t in range(len(path)):
        rows = tuple(Row(f"r{round_}-{max_tokens}-{b}", config, (1,), path[:t], t + 1, b,
                         frozenset({2})) for b in range(batch))
        t0 = time.perf_counter()
        proc(Scores(logits), Batch(rows, vocab))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])   # the first step compiles the grammar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--model", default=None,
                        help="what build() takes (default: the default model)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/grammar_cost.json; with --smoke a "
                             "temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: batch 1 and 2, one round of 4 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.tokens, args.rounds, args.batches = "tiny", 4, 1, [1, 2]
    args.out = args.out or (Path(tempfile.gettempdir()) / "grammar_cost-smoke.json"
                            if args.smoke else
                            Path(__file__).parent / "results" / "grammar_cost.json")
    before = _loadavg()
    rows = []
    with build(args.model, options={"num_slots": 8}) as pipe:
        tok = pipe.stages.tokenizer
        assert tok is not None
        proc = GrammarProcessor(tok)
        print(f"{'batch':>5} {'kind':>12} {'budget':>7} {'decode ms':>10} {'mask ms':>8} "
              f"{'ratio':>7}")
        for batch in args.batches:
            decode_step(pipe, batch, 8)                                   # warm-up
            dec = statistics.median(decode_step(pipe, batch, args.tokens)
                                    for _ in range(args.rounds))
            for name, grammar, output, prefix in kinds(tok):
                path = list(prefix) + tok.encode_text(output[len(tok.decode(list(prefix))):]
                                                      if prefix else output)
                for budget, max_tokens in (("roomy", 1024), ("tight", len(path) + 4)):
                    gram = statistics.median(
                        grammar_step(proc, grammar, path, batch, tok.vocab_size, r, max_tokens)
                        for r in range(args.rounds))
                    rows.append({"batch": batch, "kind": name, "budget": budget,
                                 "decode_step_ms": dec * 1e3, "grammar_step_ms": gram * 1e3,
                                 "ratio": gram / dec, "path_tokens": len(path)})
                    print(f"{batch:>5} {name:>12} {budget:>7} {dec * 1e3:10.2f} "
                          f"{gram * 1e3:8.3f} {gram / dec:7.1%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "loadavg_before": before,
                                    "loadavg_after": _loadavg(), "vocab": tok.vocab_size,
                                    "model": args.model or "default", "smoke": args.smoke},
                                   indent=1))
    print(f"loadavg before {' '.join(before)}, after {' '.join(_loadavg())}; wrote {args.out}")


if __name__ == "__main__":
    main()
