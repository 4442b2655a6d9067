"""Benchmark: ``quantized_linear`` against dequantize-everything-then-``F.linear``.

For each matrix (SmolLM2-135M-sized: a 1536x576 MLP projection, a 49152x576 embedding / LM
head, and a 576x1536 down projection for the K-quants, whose rows must be whole 256-element
super-blocks) and each type, in one run on this machine:

- median and best wall time at T=1 and T=8 (calls interleaved round by round) of ``quantized_linear`` for several chunk sizes, of
  ``F.linear(x, w.dequantize())`` (dequantize every call), and of ``F.linear`` over a float32
  copy made once (the speed the float32 weight would give, at 4-8x the memory);
- the ratio of each median to dequantize+linear's and to the float32 linear's;
- peak extra resident memory of one call of each, measured in a child process per case:
  glibc's mmap threshold is fixed at 64 KiB (``MALLOC_MMAP_THRESHOLD_``) so every large
  temporary is mapped and unmapped, the peak-RSS mark is reset (``/proc/self/clear_refs``),
  and the answer is ``VmHWM`` after the call minus ``VmRSS`` before it.

Prints a table and writes ``benchmarks/results/gguf_quants.json`` (``--out``).
Run: ``PYTHONPATH=src .venv/bin/python benchmarks/gguf_quants.py [--quick]``. ``--smoke``: the
same code in seconds (a 64x256 matrix in Q8_0 and Q4_K, two chunk sizes, two rounds, each peak
measured in this process rather than a child): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from backends.gguf.quants import QuantizedWeight, quantized_linear, row_bytes

RESULTS = Path(__file__).parent / "results" / "gguf_quants.json"
CASES = [(1536, 576, QT.Q8_0), (1536, 576, QT.Q4_0), (49152, 576, QT.Q8_0),
         (49152, 576, QT.Q4_0), (576, 1536, QT.Q4_K), (576, 1536, QT.Q6_K)]
CHUNKS = [256 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20]
SMOKE_CASES = [(64, 256, QT.Q8_0), (64, 256, QT.Q4_K)]
SMOKE_CHUNKS = [4 << 10, 256 << 10]
HALF_OFFSETS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
BLOCK_BYTES = {QT.Q8_0: 34, QT.Q4_0: 18, QT.Q4_K: 144, QT.Q6_K: 210}


def random_weight(rows: int, cols: int, qtype: QT) -> QuantizedWeight:
    """Random blocks whose float16 scale fields are small finite values."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (rows, row_bytes(qtype, cols)), dtype=torch.uint8, generator=g)
    blocks = data.view(-1, BLOCK_BYTES[qtype])
    for at in HALF_OFFSETS[qtype]:
        half = (torch.rand(blocks.shape[0], 1, generator=g) * 0.02).half()
        blocks[:, at:at + 2] = half.view(torch.uint8)
    return QuantizedWeight(data, qtype, (rows, cols))


def variants(w: QuantizedWeight, x: torch.Tensor, chunks: list[int] = CHUNKS
             ) -> dict[str, Callable[[], Any]]:
    """The calls compared, by name."""
    dense = w.dequantize()
    out: dict[str, Callable[[], Any]] = {
        f"qlinear chunk={c >> 10}K": (lambda c=c: quantized_linear(x, w, chunk_bytes=c))
        for c in chunks}
    out["dequantize+linear"] = lambda: F.linear(x, w.dequantize())
    out["float32 linear (pre-dequantized)"] = lambda: F.linear(x, dense)
    return out


def timed(fns: dict[str, Callable[[], Any]], budget_s: float, min_rounds: int = 7
          ) -> dict[str, list[float]]:
    """Wall times (s) of each call, in interleaved rounds (every call once a round, so
    machine noise falls on all alike) until ``budget_s`` is spent, at least ``min_rounds``."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    begin = time.perf_counter()
    while (len(times[next(iter(fns))]) < min_rounds
           or time.perf_counter() - begin < budget_s):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child_peak(rows: int, cols: int, qtype: str, tokens: int, name: str,
               chunks: list[int] = CHUNKS) -> int:
    """In a child: the peak extra RSS (bytes) of one call of variant ``name``."""
    w = random_weight(rows, cols, QT[qtype])
    x = torch.randn(tokens, cols)
    fn = variants(w, x, chunks)[name]
    fn()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    result = fn()
    peak = (_status_kib("VmHWM") - before) * 1024
    del result
    return peak


def peak_extra(rows: int, cols: int, qtype: QT, tokens: int, name: str) -> int:
    """Peak extra RSS of one call, measured in a fresh child process (see module docstring)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    args = [sys.executable, __file__, "--child", str(rows), str(cols), qtype.name,
            str(tokens), name]
    run = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


def measure(quick: bool, smoke: bool = False) -> list[dict[str, Any]]:
    """Every case at T=1 and T=8 (``smoke``: the small cases, two rounds, peaks measured in
    this process)."""
    table = []
    chunks = SMOKE_CHUNKS if smoke else CHUNKS
    for rows, cols, qtype in SMOKE_CASES if smoke else CASES:
        w = random_weight(rows, cols, qtype)
        for tokens in (1, 8):
            x = torch.randn(tokens, cols)
            times = (timed(variants(w, x, chunks), 0.0, min_rounds=2) if smoke else
                     timed(variants(w, x), 1.0 if quick else 6.0))
            medians = {name: statistics.median(ts) for name, ts in times.items()}
            for name, ts in times.items():
                table.append(dict(
                    shape=f"{rows}x{cols}", qtype=qtype.name, T=tokens, variant=name,
                    median_ms=medians[name] * 1e3, min_ms=min(ts) * 1e3, calls=len(ts),
                    vs_dequantize=medians[name] / medians["dequantize+linear"],
                    vs_float32=medians[name] / medians["float32 linear (pre-dequantized)"],
                    peak_extra_mib=(child_peak(rows, cols, qtype.name, tokens, name, chunks)
                                    if smoke else
                                    peak_extra(rows, cols, qtype, tokens, name)) / 2**20,
                    weight_mib=w.nbytes / 2**20))
                print(_row(table[-1]), flush=True)
    return table


def _row(r: dict[str, Any]) -> str:
    return (f"{r['shape']:>10} {r['qtype']:>5} T={r['T']} {r['variant']:<33} "
            f"median {r['median_ms']:7.3f} ms (min {r['min_ms']:7.3f})  "
            f"x{r['vs_dequantize']:5.2f} of deq+linear  x{r['vs_float32']:5.1f} of f32  "
            f"peak +{r['peak_extra_mib']:6.2f} MiB (weight {r['weight_mib']:.2f} MiB)")


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        rows, cols, qtype, tokens, name = sys.argv[2:]
        print(child_peak(int(rows), int(cols), qtype, int(tokens), name))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: small matrices, two rounds, peaks in this process")
    args = parser.parse_args()
    out = args.out or (Path(tempfile.gettempdir()) / "gguf_quants-smoke.json" if args.smoke
                       else RESULTS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    table = measure(args.quick, args.smoke)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(threads=torch.get_num_threads(), smoke=args.smoke,
                                   rows=table), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
