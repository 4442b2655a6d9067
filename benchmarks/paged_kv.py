"""Benchmark: decode speed over the paged KV cache, against a baseline checkout in the same run.

For the tiny model (``build("tiny")``) and the default model (SmolLM2-135M, GGUF), batch 1 and
batch 8, greedy decode of ``--new`` tokens after a ``--prompt``-token prompt, timed at the
backend (one ``forward`` of one :class:`~pipeline.contracts.model.ModelCall` per sequence per step,
the shape every engine step has), in these layouts of the KV memory:

- ``slot``: no block tables; the backend reserves a contiguous window per slot (what the
  current engine gets);
- ``run``: the caller's tables, each sequence one run of consecutive blocks (read as views);
- ``manager``: the caller's tables from a :class:`~pipeline.engine.blocks.BlockManager`: prompts
  allocated one after another, then grown token by token in one batch, as an engine would,
  in a pool of twice the default size (its placement leaves each prompt room to grow);
- ``tight``: the same in the default pool (8 windows just long enough): some prompts get
  placed right after others, so those grow into a second run and are gathered;
- ``scattered``: a random permutation of the pool (every read is a gather).

With ``--baseline SRC`` (the ``src`` folder of another checkout, e.g. the commit before paging)
the ``slot`` figure is also measured there, each model in a fresh interpreter, alternating
baseline and current ``--rounds`` times. Time is the decoding thread's CPU time (one torch
thread by default), so other processes on a shared machine inflate it far less than wall
time; each figure is the best of every repeat of every round, and the table gives its ratio
to the baseline. ``/proc/loadavg`` is recorded before and after. Writes
``benchmarks/results/paged_kv.json`` (``--out``).

Run: ``PYTHONPATH=src python benchmarks/paged_kv.py --baseline /path/to/old/src``.
``--smoke``: the same code in seconds on the tiny model (a 16-token prompt, 4 new tokens, one
repeat and round, no baseline, measured in this process rather than a child): it checks the
script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "paged_kv.json"
MODELS = {"tiny": "tiny", "default": "smollm2"}
MODES = ("slot", "run", "manager", "tight", "scattered")


def loadavg() -> str:
    """The first three fields of ``/proc/loadavg`` (empty where there is none)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ""


def child(model: str, prompt_len: int, new: int, repeats: int, threads: int) -> dict[str, Any]:
    """In this interpreter: tokens/s per mode and batch for ``model`` (slot mode only where
    the code under test has no block tables)."""
    import attrs
    import torch

    from pipeline import build
    from pipeline.contracts.model import ModelCall

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    paged = "blocks" in {f.name for f in attrs.fields(ModelCall)}
    window = prompt_len + new * repeats + 16
    with build(MODELS[model], options={"num_slots": 8, "max_context": window}) as pipe:
        first = pipe.engine.backend
        rng = random.Random(0)
        prompts = [tuple(rng.randrange(first.vocab_size) for _ in range(prompt_len))
                   for _ in range(8)]
        out: dict[str, Any] = {}
        for mode in (MODES if paged else MODES[:1]):
            backend = first if mode == "slot" else _fresh(first, 2 if mode == "manager" else 1)
            out[mode] = _decode_rates(backend, mode, prompts, new, repeats)
    return out


def _fresh(backend: Any, factor: int) -> Any:
    """A backend over the same weights with a pool of its own (to hand to its caller),
    ``factor`` times the default size."""
    from backends.torch.backend import TorchBackend

    return TorchBackend(backend.model, backend.snapshot, num_slots=8,
                        max_context=backend.max_context, kv_blocks=factor * backend.num_blocks)


def _decode_rates(backend: Any, mode: str, prompts: list[tuple[int, ...]], new: int,
                  repeats: int) -> dict[str, float]:
    """Prefill all prompts once, then time ``new`` greedy steps at batch 1 and 8,
    ``repeats`` times each (truncating back to the prompt in between): best tokens/s."""
    from pipeline.contracts.model import ModelCall

    slots = [backend.allocate() for _ in prompts]
    tables = _Tables(backend, mode, slots, len(prompts[0]), new * repeats + 1)
    p = len(prompts[0])
    z = backend.forward([ModelCall(s, ids, 0, (p - 1,), blocks=tables.at(s, p))
                         for s, ids in zip(slots, prompts)] if tables.paged else
                        [ModelCall(s, ids, 0, (p - 1,)) for s, ids in zip(slots, prompts)])
    rates = {}
    for batch in (1, 8):
        best = 0.0
        warm = [ModelCall(s, (0,), p, (0,), **tables.kw(s, p + 1)) for s in slots[:batch]]
        backend.forward(warm)                 # untimed: first-call allocations and caches
        for s in slots[:batch]:
            backend.truncate(s, p)
            tables.truncate(s, p)
        for _ in range(repeats):
            ids = [int(row.argmax()) for row in z[:batch]]
            start = time.thread_time()
            for step in range(new):
                n = p + step
                calls = [ModelCall(s, (t,), n, (0,), **tables.kw(s, n + 1))
                         for s, t in zip(slots[:batch], ids)]
                ids = [int(row.argmax()) for row in backend.forward(calls)]
            best = max(best, batch * new / (time.thread_time() - start))
            rates[f"runs_b{batch}"] = statistics.mean(tables.runs(backend, c) for c in calls)
            for s in slots[:batch]:
                backend.truncate(s, p)
                tables.truncate(s, p)
        rates[f"b{batch}"] = best
    return rates


def _runs(table: tuple[int, ...]) -> int:
    """Runs of consecutive blocks in ``table`` (1: read as a view)."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:]))


class _Tables:
    """Block tables for a mode (none for ``slot``)."""

    def __init__(self, backend: Any, mode: str, slots: list[int], prompt_len: int,
                 room: int) -> None:
        self.paged = mode != "slot"
        self.mode = mode
        if not self.paged:
            return
        from pipeline.engine.blocks import BlockManager

        bs = backend.block_size
        self.bs = bs
        per = -(-(prompt_len + room) // bs)
        order = list(range(backend.num_blocks))
        if mode == "scattered":
            random.Random(1).shuffle(order)
        self.fixed = {s: tuple(order[i * per:(i + 1) * per]) for i, s in enumerate(slots)}
        self.kv = BlockManager(backend.num_blocks, bs, snapshot=backend.snapshot)
        if mode in ("manager", "tight"):
            for s in slots:
                self.kv.allocate(s, prompt_len)

    def at(self, slot: int, length: int) -> tuple[int, ...]:
        if self.mode in ("manager", "tight"):
            return self.kv.grow(slot, max(length, self.kv.length(slot)))
        return self.fixed[slot][:-(-length // self.bs)]

    def kw(self, slot: int, length: int) -> dict[str, Any]:
        return {"blocks": self.at(slot, length)} if self.paged else {}

    def runs(self, backend: Any, call: Any) -> float:
        """Runs of blocks the call's sequence is read from (NaN where the code under test
        has no blocks)."""
        if self.paged:
            return _runs(call.blocks)
        own = getattr(backend, "own_blocks", None)
        if own is None:
            return float("nan")
        return _runs(own.table(call.slot)[:-(-(call.start + 1) // backend.block_size)])

    def truncate(self, slot: int, length: int) -> None:
        if self.mode in ("manager", "tight"):
            self.kv.truncate(slot, length)


def run_child(src: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter with ``src`` first on the path."""
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, __file__, "--child", model, "--prompt",
                          str(args.prompt), "--new", str(args.new), "--repeats",
                          str(args.repeats), "--threads", str(args.threads)],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{model} under {src} failed:\n{out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="src folder of the checkout to compare against")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model, in this process, no baseline")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.prompt, args.new, args.repeats, args.threads)))
        return
    if args.smoke:
        args.models, args.prompt, args.new, args.repeats, args.rounds = ["tiny"], 16, 4, 1, 1
        args.baseline = None
    out = args.out or (Path(tempfile.gettempdir()) / "paged_kv-smoke.json" if args.smoke
                       else RESULTS)
    here = str(Path(__file__).resolve().parent.parent / "src")
    trees = {"current": here, **({"baseline": args.baseline} if args.baseline else {})}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {t: {m: [] for m in args.models}
                                                        for t in trees}
    load = {"before": loadavg()}
    for _ in range(args.rounds):
        for model in args.models:
            for tree, src in trees.items():
                runs[tree][model].append(
                    child(model, args.prompt, args.new, args.repeats, args.threads)
                    if args.smoke else run_child(src, model, args))
    load["after"] = loadavg()
    table = summarize(runs)
    report(table, load, args)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out.write_text(json.dumps({"loadavg": load, "settings": settings, "best": table,
                               "runs": runs}, indent=2))
    print(f"wrote {out}")


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]
              ) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
    """Best tokens/s per tree, model, mode and batch, over rounds."""
    out: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
    for tree, models in runs.items():
        for model, results in models.items():
            for mode in results[0]:
                for batch in results[0][mode]:
                    cell = max(r[mode][batch] for r in results)
                    out.setdefault(tree, {}).setdefault(model, {}).setdefault(mode, {})[
                        batch] = cell
    return out


def report(table: dict[str, Any], load: dict[str, str], args: argparse.Namespace) -> None:
    """Print tokens/s per model, mode and batch, and the ratio to the baseline's slot mode."""
    print(f"decode tok/s (thread CPU time), prompt {args.prompt}, {args.new} new tokens, best "
          f"of {args.repeats} x {args.rounds} rounds, {args.threads} thread(s); "
          f"loadavg {load['before']} -> {load['after']}")
    print(f"{'model':<9}{'layout':<11}{'b1':>9}{'b8':>9}{'b1/base':>9}{'b8/base':>9}"
          f"{'runs b1':>9}{'runs b8':>9}")
    base = table.get("baseline", {})
    for model, modes in table["current"].items():
        if model in base:
            r = base[model]["slot"]
            print(f"{model:<9}{'baseline':<11}{r['b1']:>9.1f}{r['b8']:>9.1f}")
        for mode, r in modes.items():
            ratio = ("".join(f"{r[b] / base[model]['slot'][b]:>9.3f}" for b in ("b1", "b8"))
                     if model in base else " " * 18)
            print(f"{model:<9}{mode:<11}{r['b1']:>9.1f}{r['b8']:>9.1f}{ratio}"
                  f"{r['runs_b1']:>9.2f}{r['runs_b8']:>9.2f}")


if __name__ == "__main__":
    main()
