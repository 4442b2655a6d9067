"""Tune the Triton MoE's launch configs for one layer shape and write the JSON table.

For each batch size M, every config of the search space runs the whole Triton MoE on random
inputs; a config whose output differs from the torch reference (``moe_forward``) beyond the
dtype's tolerance, or that the GPU cannot launch (out of shared memory, ...), is dropped;
the fastest of the rest is written to the table
``E={E},N={I},device_name={device},dtype={dtype}.json`` that
:class:`backends.triton_moe.configs.ConfigTables` reads (nearest M at run time).

Run on a GPU::

    python benchmarks/moe_tune.py --experts 8 --top-k 2 --hidden 4096 --intermediate 14336 \\
        [--dtype bfloat16] [--batch-sizes 1 16 64 ...] [--out src/backends/triton_moe/configs]

``--quick`` searches a small space (minutes on one GPU instead of hours).
``--cpu-smoke`` tunes under the Triton interpreter (device name ``interpreter``, a small
search space, float32/float16); also writes ``--trials FILE`` with every measured config.
``--smoke`` is its smallest run, without the shape arguments (E=4, top-2, H=64, I=32, float32,
M=1; trials in ``OUT/trials.json`` unless ``--trials`` says; a few seconds): no GPU code runs,
and the output says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_common import (
    Shape, make_problem, make_weights, rel_err, smoke_mode, time_eager_us, time_graph_us,
)

SMOKE = smoke_mode(sys.argv)  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402

from backends.torch.moe import RoutingSpec, moe_forward  # noqa: E402
from backends.triton_moe import ConfigKey, LaunchConfig, TritonMoe  # noqa: E402
from backends.triton_moe.configs import PACKAGE_TABLES, write_table  # noqa: E402
from backends.triton_moe.launch import device_name  # noqa: E402

GPU_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
GPU_SPACE = dict(block_m=(16, 32, 64, 128), block_n=(32, 64, 128, 256), block_k=(64, 128, 256),
                 group_m=(1, 16, 32), num_warps=(4, 8), num_stages=(2, 3, 4))
QUICK_SPACE = dict(block_m=(16, 64, 128), block_n=(64, 128), block_k=(64, 128), group_m=(1, 16),
                   num_warps=(4,), num_stages=(3,))
SMOKE_SPACE = dict(block_m=(16, 32), block_n=(64,), block_k=(32, 64), group_m=(1,),
                   num_warps=(4,), num_stages=(3,))
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-5}


def space(grid: dict[str, tuple[int, ...]], m: int, top_k: int) -> list[LaunchConfig]:
    """Every config of ``grid``, without row blocks far larger than the M*K routed rows."""
    rows = m * top_k
    out = []
    for values in itertools.product(*grid.values()):
        cfg = LaunchConfig(**dict(zip(grid, values)))
        if cfg.block_m <= max(16, triton.next_power_of_2(rows)):
            out.append(cfg)
    return out


def trial(cfg: LaunchConfig, problem: Any, reference: Any, shape: Shape, *, on_gpu: bool,
          repeats: int) -> dict[str, Any]:
    """Time one config; ``us`` is None when it cannot launch or is wrong."""
    moe = TritonMoe(config=cfg)
    routing = RoutingSpec(renormalize=True)

    def call() -> Any:
        return moe(problem.hidden, problem.logits, problem.w_gate_up, problem.w_down,
                   top_k=shape.top_k, routing=routing)

    row: dict[str, Any] = {"config": cfg.to_dict(), "us": None}
    try:
        err = rel_err(call(), reference)
    except Exception as exc:  # OutOfResources and the like: the config does not fit
        return {**row, "error": type(exc).__name__}
    row["rel_err"] = err
    if err > TOLERANCE[problem.hidden.dtype]:
        return {**row, "error": "wrong result"}
    graph = time_graph_us(call) if on_gpu else None
    row["us"] = graph if graph is not None else time_eager_us(call, on_gpu=on_gpu,
                                                               repeats=repeats)
    row["timing"] = "graph" if graph is not None else ("eager" if on_gpu else "wall")
    return row


def tune(shape: Shape, dtype: torch.dtype, batches: list[int], grid: dict[str, Any], *,
         on_gpu: bool, repeats: int) -> tuple[dict[int, LaunchConfig], list[dict[str, Any]]]:
    """The fastest correct config per batch size, and every trial."""
    device = "cuda" if on_gpu else "cpu"
    weights = make_weights(shape, dtype, device)
    best: dict[int, LaunchConfig] = {}
    trials = []
    for m in batches:
        problem = make_problem(shape, m, weights)
        reference = moe_forward(problem.hidden, problem.logits, problem.w_gate_up,
                                problem.w_down, top_k=shape.top_k,
                                routing=RoutingSpec(renormalize=True))
        rows = [{"M": m, **trial(cfg, problem, reference, shape, on_gpu=on_gpu,
                                 repeats=repeats)} for cfg in space(grid, m, shape.top_k)]
        timed = [r for r in rows if r["us"] is not None]
        if not timed:
            raise SystemExit(f"no config of the search space works at M={m}")
        best[m] = LaunchConfig.from_dict(min(timed, key=lambda r: r["us"])["config"])
        trials += rows
        print(f"M={m}: {best[m]} ({len(timed)}/{len(rows)} configs ran)")
    return best, trials


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls on the CPU")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder of the table (default {PACKAGE_TABLES}; with --smoke a "
                             "temporary folder)")
    parser.add_argument("--trials", type=Path, help="also write every trial as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help=f"the small search space ({len(space(QUICK_SPACE, 4096, 1))} "
                             "configs) instead of the full one")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tune under the Triton interpreter (no GPU needed)")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest --cpu-smoke run, shape arguments not needed: "
                             "seconds, and no GPU code")
    args = parser.parse_args(argv)
    args.out = args.out or (Path(tempfile.gettempdir()) / "moe_tune-smoke" if args.smoke
                            else PACKAGE_TABLES)
    if args.smoke:
        args.experts, args.top_k, args.hidden, args.intermediate = (
            args.experts or 4, args.top_k or 2, args.hidden or 64, args.intermediate or 32)
        args.dtype, args.batch_sizes = "float32", args.batch_sizes or [1]
        args.trials = args.trials or args.out / "trials.json"
    missing = [f"--{name.replace('_', '-')}" for name in ("experts", "top_k", "hidden",
                                                          "intermediate")
               if getattr(args, name) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    on_gpu = not SMOKE
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or pass --cpu-smoke")
    shape = Shape("tuned", args.experts, args.top_k, args.hidden, args.intermediate)
    batches = args.batch_sizes or list(GPU_BATCHES if on_gpu else (1, 16))
    best, trials = tune(shape, getattr(torch, args.dtype), batches,
                        (QUICK_SPACE if args.quick else GPU_SPACE) if on_gpu else SMOKE_SPACE,
                        on_gpu=on_gpu,
                        repeats=args.repeats)
    device = device_name(torch.device("cuda" if on_gpu else "cpu"))
    key = ConfigKey(shape.experts, shape.intermediate, device, args.dtype)
    path = write_table(args.out, key, best, triton.__version__)
    print(f"wrote {path}")
    if args.trials:
        args.trials.parent.mkdir(parents=True, exist_ok=True)
        args.trials.write_text(json.dumps(trials, indent=1) + "\n")
        print(f"wrote {args.trials}")
    if SMOKE:
        print("the GPU part was not run: tuned under the Triton interpreter on the CPU "
              "(device name 'interpreter'; the timings mean nothing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
