"""Shared by the Triton MoE benchmark and tuner: problems, timing, and the CPU-smoke switch.

``smoke_mode(argv)`` must run before anything imports triton: with ``--cpu-smoke`` (or
``--smoke``, the smallest such run) it sets ``TRITON_INTERPRET=1`` so the kernels run on the
CPU (tiny shapes; timings only exercise the code paths, they say nothing about a GPU).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

H200_HBM_BYTES_PER_S = 4.8e12
H200_BF16_DENSE_FLOPS = 989e12


def smoke_mode(argv: Sequence[str]) -> bool:
    """True (and the Triton interpreter switched on) when ``--cpu-smoke`` or ``--smoke`` is
    among ``argv``."""
    if "--cpu-smoke" in argv or "--smoke" in argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


@dataclass(frozen=True)
class Shape:
    """One MoE layer: experts, experts per token, hidden size, expert intermediate size."""

    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int

    @property
    def expert_elems(self) -> int:
        """Weight elements of one expert (gate, up and down)."""
        return 3 * self.hidden * self.intermediate


@dataclass
class Problem:
    """Random inputs and weights for one shape and token count."""

    hidden: Any        # [M, H]
    logits: Any        # [M, E]
    w_gate_up: Any     # [E, 2I, H]
    w_down: Any        # [E, H, I]


def make_weights(shape: Shape, dtype: Any, device: str, seed: int = 0) -> tuple[Any, Any]:
    """Expert weights at unit-variance-preserving scale."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w_gate_up = torch.randn((e, 2 * i, h), generator=gen, device=device, dtype=dtype)
    w_down = torch.randn((e, h, i), generator=gen, device=device, dtype=dtype)
    return w_gate_up.mul_(h ** -0.5), w_down.mul_(i ** -0.5)


def make_problem(shape: Shape, m: int, weights: tuple[Any, Any], seed: int = 1) -> Problem:
    """``m`` tokens with random hidden states and router logits."""
    import torch
    w_gate_up, _ = weights
    gen = torch.Generator(device=w_gate_up.device).manual_seed(seed + m)
    x = torch.randn((m, shape.hidden), generator=gen, device=w_gate_up.device,
                    dtype=w_gate_up.dtype)
    logits = torch.randn((m, shape.experts), generator=gen, device=w_gate_up.device,
                         dtype=w_gate_up.dtype)
    return Problem(x, logits, *weights)


def bytes_moved(shape: Shape, m: int, experts_used: int, elem_size: int) -> int:
    """Weights of the experts used, plus the input and output activations."""
    return elem_size * (experts_used * shape.expert_elems + 2 * m * shape.hidden)


def flops(shape: Shape, m: int) -> int:
    """Multiply-adds x 2 of the three projections for each of the m x K routed pairs."""
    return 2 * m * shape.top_k * shape.expert_elems


def time_eager_us(fn: Callable[[], Any], *, on_gpu: bool, repeats: int = 1) -> float:
    """Median time of one call in microseconds, launch overhead included.

    On a GPU: ``triton.testing.do_bench`` (L2 flushed before each call). On the CPU: wall
    time of ``repeats`` calls.
    """
    if on_gpu:
        import triton.testing
        return 1e3 * float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def syncs_with_host(fn: Callable[[], Any]) -> bool:
    """Whether ``fn`` waits for the GPU (``.item()``, ``bincount``, ...), found under torch's
    sync debug mode before any capture is tried: a capture that hits a sync can leave a
    CUDA error behind for later calls."""
    import torch
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(before)
        torch.cuda.synchronize()


def time_graph_us(fn: Callable[[], Any]) -> float | None:
    """Median GPU time of one call replayed from a CUDA graph (no launch overhead; L2 not
    flushed between replays), or None when the call cannot be captured (it syncs with the
    host)."""
    import triton.testing
    if syncs_with_host(fn):
        return None
    try:
        return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
    except Exception:
        return None


def rel_err(out: Any, ref: Any) -> float:
    """Max absolute difference over the reference's max magnitude."""
    diff = (out.double() - ref.double()).abs().max()
    return float(diff / ref.double().abs().max().clamp_min(1e-30))
