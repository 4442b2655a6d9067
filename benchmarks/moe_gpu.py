"""Benchmark on a GPU: the Triton MoE against the torch reference MoE, bfloat16.

In one run, for Qwen3-30B-A3B experts (E=128, top-8, H=2048, I=768) and Mixtral-8x7B experts
(E=8, top-2, H=4096, I=14336) at M in {1, 4, 16, 64, 256, 1024, 4096} tokens:

- parity: the Triton output against the torch reference (``moe_forward``) in the same dtype,
  and both against a float32 reference (relative max error);
- time per call (µs) of ``TritonMoe`` and of ``moe_forward`` (which uses ``torch._grouped_mm``
  for bfloat16 on CUDA where this torch has it; the JSON records whether it does);
- achieved memory bandwidth (weights of the experts actually routed to, plus activations)
  as a fraction of the H200's 4.8 TB/s, and TFLOP/s as a fraction of its 989 TFLOP/s dense
  bfloat16 peak;
- the goals: >= 70 % of HBM bandwidth at M <= 16 on Mixtral, >= 40 % of bf16 peak at
  M >= 1024, never slower than the torch reference.

Prints a table and writes JSON (default ``benchmarks/results/moe_gpu.json``).
Run on a GPU: ``python benchmarks/moe_gpu.py [--tune] [--configs DIR] [--out FILE]``;
``--tune`` first tunes each shape at the benchmark's token counts (``moe_tune.py``'s quick
space) and writes those tables next to the JSON, in ``moe_tables/``.
``--cpu-smoke`` runs the same code on tiny shapes through the Triton interpreter in
float32/float16 (the interpreter has no bfloat16 dot), to check the script without a GPU;
its timings and fractions mean nothing. ``--smoke`` is its smallest run (float32, one token
count, no tuning; a few seconds): no GPU code runs (no CUDA timing or graphs), and the output
says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_common import (
    H200_BF16_DENSE_FLOPS, H200_HBM_BYTES_PER_S, Shape, bytes_moved, flops, make_problem,
    make_weights, rel_err, smoke_mode, time_eager_us, time_graph_us,
)

SMOKE = smoke_mode(sys.argv)  # before triton is imported

import torch  # noqa: E402

from backends.torch.moe import RoutingSpec, moe_forward, route  # noqa: E402
from backends.triton_moe import ConfigKey, TritonMoe  # noqa: E402
from backends.triton_moe.configs import write_table  # noqa: E402
from backends.triton_moe.launch import device_name  # noqa: E402

GPU_SHAPES = (Shape("qwen3-30b-a3b", 128, 8, 2048, 768), Shape("mixtral-8x7b", 8, 2, 4096, 14336))
GPU_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
SMOKE_SHAPES = (Shape("qwen3-like-tiny", 16, 8, 64, 32), Shape("mixtral-like-tiny", 4, 2, 64, 48))
SMOKE_TOKENS = (1, 5, 16)
ROUTING = RoutingSpec(renormalize=True)     # both checkpoints renormalize the top-k weights
PARITY_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-5}
RESULTS = Path(__file__).parent / "results" / "moe_gpu.json"


def measure(shape: Shape, m: int, weights: tuple[Any, Any], weights32: tuple[Any, Any],
            moe: TritonMoe, *, on_gpu: bool, graphs: bool, repeats: int) -> dict[str, Any]:
    """One row: parity, timings and roofline fractions for ``m`` tokens of ``shape``."""
    p = make_problem(shape, m, weights)
    call = {"top_k": shape.top_k, "routing": ROUTING}
    ours = moe(p.hidden, p.logits, p.w_gate_up, p.w_down, **call)
    ref = moe_forward(p.hidden, p.logits, p.w_gate_up, p.w_down, **call)
    ref32 = moe_forward(p.hidden.float(), p.logits.float(), *weights32, **call)
    calls = {"triton": lambda: moe(p.hidden, p.logits, p.w_gate_up, p.w_down, **call),
             "torch": lambda: moe_forward(p.hidden, p.logits, p.w_gate_up, p.w_down, **call)}
    eager = {name: time_eager_us(fn, on_gpu=on_gpu, repeats=repeats)
             for name, fn in calls.items()}
    graph = {name: time_graph_us(fn) if on_gpu and graphs else None
             for name, fn in calls.items()}
    # compare like with like: CUDA graphs when both calls can be captured, else eager
    how = "graph" if None not in graph.values() else "eager"
    chosen = graph if how == "graph" else eager
    triton_us, torch_us = chosen["triton"], chosen["torch"]
    best_triton = graph["triton"] or eager["triton"]
    _, ids = route(p.logits, top_k=shape.top_k, routing=ROUTING)
    used = int(ids.unique().numel())
    moved = bytes_moved(shape, m, used, p.hidden.element_size())
    work = flops(shape, m)
    err = rel_err(ours, ref)
    return {
        "shape": shape.name, "M": m, "experts_used": used, "bytes": moved, "flops": work,
        "triton_us": triton_us, "torch_us": torch_us, "timing": how if on_gpu else "wall",
        "speedup": torch_us / triton_us,
        "triton_eager_us": eager["triton"], "torch_eager_us": eager["torch"],
        "triton_graph_us": graph["triton"], "torch_graph_us": graph["torch"],
        "hbm_fraction": moved / (best_triton * 1e-6) / H200_HBM_BYTES_PER_S,
        "tflops": work / (best_triton * 1e-6) / 1e12,
        "peak_fraction": work / (best_triton * 1e-6) / H200_BF16_DENSE_FLOPS,
        "rel_err_vs_torch": err, "triton_rel_err_vs_fp32": rel_err(ours, ref32),
        "torch_rel_err_vs_fp32": rel_err(ref, ref32),
        "parity_ok": err <= PARITY_TOL[p.hidden.dtype],
    }


def goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The issue's three targets, judged on the rows."""
    mixtral_small = [r for r in rows if r["shape"].startswith("mixtral") and r["M"] <= 16]
    large = [r for r in rows if r["M"] >= 1024]
    return {
        "hbm_70pct_mixtral_m_le_16": bool(mixtral_small) and all(
            r["hbm_fraction"] >= 0.70 for r in mixtral_small),
        "bf16_peak_40pct_m_ge_1024": bool(large) and all(
            r["peak_fraction"] >= 0.40 for r in large),
        "never_slower_than_torch": all(r["triton_us"] <= r["torch_us"] for r in rows),
        "parity": all(r["parity_ok"] for r in rows),
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    head = ("| shape | M | timing | triton µs | torch µs | speedup | HBM frac | TFLOP/s "
            "| peak frac | rel err |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['shape']} | {r['M']} | {r['timing']} | {r['triton_us']:.1f} | "
             f"{r['torch_us']:.1f} | "
             f"{r['speedup']:.2f} | {r['hbm_fraction']:.3f} | {r['tflops']:.1f} | "
             f"{r['peak_fraction']:.3f} | {r['rel_err_vs_torch']:.1e} |" for r in rows]
    return "\n".join([head, *lines])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every shape and token count; returns the report written as JSON."""
    on_gpu = not SMOKE
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --cpu-smoke")
    if args.smoke:
        args.dtypes, args.tokens, args.tune = ["float32"], [1], False
    device = "cuda" if on_gpu else "cpu"
    dtypes = [getattr(torch, d) for d in args.dtypes] if args.dtypes else (
        [torch.bfloat16] if on_gpu else [torch.float32, torch.float16])
    shapes, tokens = (GPU_SHAPES, GPU_TOKENS) if on_gpu else (SMOKE_SHAPES, SMOKE_TOKENS)
    tokens = tuple(args.tokens) if args.tokens else tokens
    tuned = args.out.parent / "moe_tables"
    moe = TritonMoe([tuned, *(Path(f) for f in args.configs)] if args.tune else
                    [Path(f) for f in args.configs])
    rows, tables = [], []
    for dtype in dtypes:
        for shape in shapes:
            if args.tune:
                tables.append(str(quick_tune(shape, dtype, tokens, tuned, on_gpu=on_gpu)))
            weights = make_weights(shape, dtype, device)
            weights32 = tuple(w.float() for w in weights)
            for m in tokens:
                row = measure(shape, m, weights, weights32, moe, on_gpu=on_gpu,
                              graphs=not args.no_graphs, repeats=args.repeats)
                rows.append({"dtype": str(dtype).removeprefix("torch."), **row})
            del weights, weights32
    return {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter)",
        "cpu_smoke": SMOKE, "gpu_run": on_gpu, "torch": torch.__version__,
        "grouped_mm_available": hasattr(torch, "_grouped_mm"),
        "peaks": {"hbm_bytes_per_s": H200_HBM_BYTES_PER_S,
                  "bf16_dense_flops": H200_BF16_DENSE_FLOPS},
        "tuned_tables": tables, "rows": rows, "goals": goals(rows),
    }


def quick_tune(shape: Shape, dtype: torch.dtype, tokens: tuple[int, ...], folder: Path, *,
               on_gpu: bool) -> Path:
    """Tune ``shape`` at exactly these token counts (``moe_tune.py``'s quick space, or its
    smoke space on the CPU) and write the table into ``folder``."""
    import moe_tune
    import triton

    grid = moe_tune.QUICK_SPACE if on_gpu else moe_tune.SMOKE_SPACE
    best, _ = moe_tune.tune(shape, dtype, list(tokens), grid, on_gpu=on_gpu, repeats=1)
    device = device_name(torch.device("cuda" if on_gpu else "cpu"))
    key = ConfigKey(shape.experts, shape.intermediate, device, str(dtype).removeprefix("torch."))
    return write_table(folder, key, best, triton.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes through the Triton interpreter, no GPU needed")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest --cpu-smoke run (float32, one token count, no "
                             "tuning): seconds, and no GPU code")
    parser.add_argument("--configs", action="append", default=[],
                        help="folder of tuned launch tables (searched first; repeatable)")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls on the CPU")
    parser.add_argument("--tokens", type=int, nargs="+", help="token counts M to run")
    parser.add_argument("--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tune", action="store_true",
                        help="first tune each shape at these token counts (moe_tune.py's "
                             "quick space) and use those tables")
    parser.add_argument("--no-graphs", action="store_true",
                        help="time eagerly (launch overhead included), not CUDA graphs")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    args = parser.parse_args(argv)
    args.out = args.out or (Path(tempfile.gettempdir()) / "moe_gpu-smoke.json" if args.smoke
                            else RESULTS)
    report = run(args)
    for dtype in sorted({r["dtype"] for r in report["rows"]}):
        print(f"\n{report['device']}, {dtype}\n")
        print(table([r for r in report["rows"] if r["dtype"] == dtype]))
    print("\ngoals:", json.dumps(report["goals"]))
    if SMOKE:
        print("the GPU part was not run: the kernels ran under the Triton interpreter on the "
              "CPU (no CUDA timing, graphs or roofline; the figures mean nothing)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if report["goals"]["parity"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
