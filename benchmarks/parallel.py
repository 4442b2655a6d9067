"""Benchmark: prefill and decode speed of one model split over 1, 2, ... ranks (tensor and expert
parallelism, :mod:`backends.torch.parallel`), and what the group's communication costs a step.

For each rank count W in ``--ranks`` (default ``1,2``) the same model runs the same work:

- **prefill**: one ``--prompt``-token prompt (tokens per second, best of ``--repeats``);
- **decode**: one sequence, ``--steps`` greedy steps after a short prompt (tokens per second,
  best of ``--repeats``);
- **communication**: on rank 0, the collectives one step makes, timed alone: the broadcast of
  the step's calls to the other ranks and the two all-reduces per layer (``[1, H]`` for a
  decode step, ``[T, H]`` for the prefill), against the step's time.

W = 1 runs in this process on ``--threads`` threads (default: all cores); W > 1 runs under
``torchrun --nproc-per-node W`` (gloo on a CPU, NCCL with ``--device cuda``: one GPU a rank),
each rank on ``threads / W`` threads, so the machine's cores are shared the same way. The
greedy tokens of every W must equal W = 1's.

Models: ``tiny`` (the shipped 4-layer Qwen3-MoE: experts split) and ``dense``, a random
Qwen3 written to a temporary folder (8 layers, hidden 1024, MLP 2816, 16 query and 8 key/value
heads: about 0.4 GB of float32 weights; heads and MLP split).

Prints a table, writes ``benchmarks/results/parallel.json`` (``--out``). Run:
``.venv/bin/python benchmarks/parallel.py [--ranks 1,2] [--device cuda --ranks 1,2,4,8]``;
``--smoke``: the tiny model, few tokens: it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.model import ModelCall, PrefillChunk
from random_checkpoint import random_qwen3

ROOT = Path(__file__).resolve().parents[1]


def random_dense(folder: Path) -> Path:
    """The random Qwen3 of the module docstring (float32 safetensors)."""
    return random_qwen3(folder, hidden=1024, layers=8, heads=16, kv_heads=8, head_dim=64,
                        vocab=8192, intermediate=2816, scale=0.03)


def measure(backend: Any, prompt: int, steps: int, repeats: int) -> dict[str, Any]:
    """Prefill and decode speed on ``backend`` (any rank count: rank 0's view)."""
    vocab = backend.vocab_size
    g = torch.Generator().manual_seed(0)
    long = torch.randint(0, vocab, (prompt,), generator=g).tolist()
    short = torch.randint(0, vocab, (8,), generator=g).tolist()
    prefill, decode, tokens = [], [], []
    for _ in range(repeats):
        slot = backend.allocate()
        start = time.perf_counter()
        backend.prefill([PrefillChunk(slot, tuple(long), 0, True)])
        prefill.append(prompt / (time.perf_counter() - start))
        backend.release(slot)
        slot = backend.allocate()
        z = backend.prefill([PrefillChunk(slot, tuple(short), 0, True)])[0]
        out = [int(z.argmax())]
        start = time.perf_counter()
        for _ in range(steps):
            out.append(int(backend.decode([slot], [out[-1]])[0].argmax()))
        decode.append(steps / (time.perf_counter() - start))
        backend.release(slot)
        tokens = out
    return {"prefill_tok_s": max(prefill), "decode_tok_s": max(decode), "tokens": tokens}


def communication(backend: Any, prompt: int, repeats: int) -> dict[str, float]:
    """Rank 0: the collectives of one decode step and of the prefill, timed alone (ms):
    ``ParallelTorchBackend.probe`` with the step's broadcast and two all-reduces a layer."""
    layers = backend.model.spec.num_layers
    out: dict[str, float] = {}
    for name, rows in (("decode", 1), ("prefill", prompt)):
        calls = [ModelCall(0, tuple(range(rows)), 0, (rows - 1,))]
        out[f"{name}_ms"] = min(backend.probe(rows, 2 * layers, calls)
                                for _ in range(repeats)) * 1e3
    return out


def rank_main(args: argparse.Namespace) -> None:
    """Under torchrun: every rank loads its part; rank 0 measures and writes ``--out``."""
    from backends.torch.parallel import join_group, parallel_backend

    device = args.device
    if device == "cuda":
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    shard = join_group(device=device)
    backend = parallel_backend(args.model, shard, num_slots=1, max_context=args.prompt + 64,
                               dtype="float32", device=device)
    result = measure(backend, args.prompt, args.steps, args.repeats)
    result["communication"] = communication(backend, args.prompt, args.repeats)
    args.out.write_text(json.dumps(result))
    backend.close()


def run(model: Path, ranks: int, args: argparse.Namespace, threads: int) -> dict[str, Any]:
    if ranks == 1:
        from backends.torch.backend import TorchBackend

        torch.set_num_threads(threads)
        backend = TorchBackend.from_dir(model, num_slots=1, max_context=args.prompt + 64,
                                        dtype="float32", device=args.device)
        result = measure(backend, args.prompt, args.steps, args.repeats)
        result["communication"] = {"decode_ms": 0.0, "prefill_ms": 0.0}
        return result
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, threads // ranks)),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(ranks), str(Path(__file__).resolve()),
                        "--rank-run", "--model", str(model), "--out", str(out),
                        "--prompt", str(args.prompt), "--steps", str(args.steps),
                        "--repeats", str(args.repeats), "--device", args.device],
                       env=env, cwd=ROOT, check=True, timeout=900)
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "parallel.json")
    args = parser.parse_args()
    if args.rank_run:
        rank_main(args)
        return
    if args.smoke:
        args.prompt, args.steps, args.repeats = 32, 4, 1
    counts = [int(n) for n in args.ranks.split(",")]
    with open("/proc/loadavg") as fh:
        load_before = fh.read().split()[:3]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"tiny": TINY_MODEL_DIR}
        if not args.smoke:
            models["dense"] = random_dense(Path(tmp) / "dense")
        for name, folder in models.items():
            base: list[int] | None = None
            for ranks in counts:
                r = run(folder, ranks, args, args.threads)
                base = r["tokens"] if base is None else base
                rows.append({"model": name, "ranks": ranks, **r,
                             "same_tokens": r["tokens"] == base})
    with open("/proc/loadavg") as fh:
        load_after = fh.read().split()[:3]
    print(f"{'model':6} {'ranks':>5} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'comm/decode step':>17} {'comm/prefill':>13} same")
    for r in rows:
        c = r["communication"]
        print(f"{r['model']:6} {r['ranks']:5} {r['prefill_tok_s']:14.1f} "
              f"{r['decode_tok_s']:13.1f} {c['decode_ms']:15.2f}ms {c['prefill_ms']:11.2f}ms "
              f"{r['same_tokens']}")
    print(f"threads {args.threads}; load before {' '.join(load_before)}, after "
          f"{' '.join(load_after)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"smoke": args.smoke, "threads": args.threads,
                                    "device": args.device, "load_before": load_before,
                                    "load_after": load_after, "rows": rows}, indent=2))
    if not all(r["same_tokens"] for r in rows):  # logits agree to ~1e-6: a near tie can flip
        print("note: a rank count's greedy tokens differ from one process's (a near tie)")


if __name__ == "__main__":
    main()
