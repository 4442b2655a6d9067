"""The Triton MoE: operand checks, config choice, and the launch sequence.

Owns :func:`fused_experts` (routed tokens through the experts) and :class:`TritonMoe`, a
drop-in for :func:`backends.torch.moe.moe_forward` (same arguments, same result within
floating-point rounding) that the torch backend's model takes as its MoE function. Per call:

1. route: :func:`backends.triton_moe.routing.route` → weights, ids ``[T, K]``
2. align: :func:`backends.triton_moe.align.align` → pairs sorted by expert, runs padded
3. ``gate_up_kernel`` → ``act [P, I]`` (SiLU-and-multiply fused)
4. ``down_kernel`` → ``y [T*K, H]`` float32, routing weights applied
5. ``sum_topk_kernel`` → ``out [T, H]`` in the hidden dtype

Tensors run on a CUDA device, or on the CPU when the kernels were defined under the Triton
interpreter (``TRITON_INTERPRET=1`` before ``triton`` is imported), which has no bfloat16
``tl.dot``. Float32 dots use IEEE precision (no TF32), so float32 results match the oracle.

Example::

    moe = TritonMoe()
    out = moe(x, x @ router.T, w_gate_up, w_down, top_k=2,
              routing=RoutingSpec(renormalize=True))               # [T, H]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import triton

from backends.torch.moe import RoutingSpec
from backends.triton_moe import kernels
from backends.triton_moe.align import align
from backends.triton_moe.configs import (
    INTERPRETER_DEVICE, ConfigKey, ConfigTables, LaunchConfig,
)
from backends.triton_moe.routing import SoftmaxTopK, route
from pipeline.errors import BackendError, InvalidValueError

if TYPE_CHECKING:
    from backends.torch.model import MoeFunction

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def interpreted() -> bool:
    """Whether the kernels were defined under the Triton interpreter."""
    return type(kernels.gate_up_kernel).__name__ == "InterpretedFunction"


def device_name(device: torch.device) -> str:
    """The config tables' device key: the CUDA device's name, or ``interpreter``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return INTERPRETER_DEVICE


def check_operands(hidden: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor) -> None:
    """Raise :class:`~pipeline.errors.InvalidValueError` (shapes, dtypes, strides) or
    :class:`~pipeline.errors.BackendError` (device) for operands the kernels cannot take."""
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise InvalidValueError("moe operands", (hidden.dim(), w_gate_up.dim(), w_down.dim()),
                                "need hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]")
    (_, h), (e, two_i, h2) = hidden.shape, w_gate_up.shape
    if h2 != h or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise InvalidValueError("moe shapes", (tuple(hidden.shape), tuple(w_gate_up.shape),
                                               tuple(w_down.shape)),
                                "need hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]")
    dtypes = {hidden.dtype, w_gate_up.dtype, w_down.dtype}
    if len(dtypes) != 1 or hidden.dtype not in DTYPES:
        raise InvalidValueError("moe dtypes", sorted(str(d) for d in dtypes),
                                "need one of float32, float16, bfloat16 for all three")
    if any(t.stride(-1) != 1 for t in (hidden, w_gate_up, w_down)):
        raise InvalidValueError("moe strides", "last dim", "must be contiguous (stride 1)")
    _check_device(hidden, w_gate_up, w_down)


def _check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise InvalidValueError("moe devices", sorted(map(str, devices)), "must be one device")
    check_device(devices.pop(), tensors[0].dtype)


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Raise :class:`~pipeline.errors.BackendError` unless the kernels can run on ``device``
    in ``dtype``: any CUDA device, or the CPU under the interpreter without bfloat16."""
    if device.type == "cuda":
        return
    if device.type != "cpu" or not interpreted():
        raise BackendError(f"the Triton MoE needs a CUDA device (got {device}); on a CPU set "
                           "TRITON_INTERPRET=1 before triton is imported")
    if dtype == torch.bfloat16:
        raise BackendError("the Triton interpreter has no bfloat16 dot: use float32 or "
                           "float16 on the CPU, bfloat16 on a GPU")


def fused_experts(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  config: LaunchConfig) -> torch.Tensor:
    """``sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = ids[t, k]``.

    ``hidden [T, H]``, ``weights [T, K]`` (any float dtype; used in float32), ``ids [T, K]``
    (integers in ``0..E-1``), ``w_gate_up [E, 2I, H]``, ``w_down [E, H, I]``; returns
    ``[T, H]`` in the hidden dtype. Expert weights and hidden states are assumed checked
    (:func:`check_operands`); ids outside ``0..E-1`` are not detected (that would need a
    read-back to the host).
    """
    if ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != hidden.shape[0] \
            or ids.is_floating_point():
        raise InvalidValueError("routing", (tuple(weights.shape), tuple(ids.shape)),
                                f"need weights and integer ids [{hidden.shape[0]}, K]")
    t, h = hidden.shape
    e, two_i, _ = w_gate_up.shape
    i, k = two_i // 2, ids.shape[1]
    out = hidden.new_empty((t, h))
    if t == 0:
        return out
    a = align(ids, num_experts=e, block_m=config.block_m)
    rows = a.sorted_ids.numel()
    act = hidden.new_empty((rows, i))                                         # [P, I]
    y = torch.empty((t * k, h), dtype=torch.float32, device=hidden.device)    # [T*K, H]
    flat_w = weights.reshape(-1).float()                                      # [T*K]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    tiles = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                 GROUP_M=config.group_m, PRECISION=precision,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    blocks_m = rows // config.block_m
    blocks_n = triton.cdiv(i, config.block_n)
    kernels.gate_up_kernel[(blocks_m * blocks_n,)](
        hidden, w_gate_up, act, a.sorted_ids, a.block_expert, a.num_padded, blocks_m,
        blocks_n, t * k, i, h, hidden.stride(0), hidden.stride(1), *w_gate_up.stride(),
        *act.stride(), TOP_K=k, **tiles)
    blocks_n = triton.cdiv(h, config.block_n)
    kernels.down_kernel[(blocks_m * blocks_n,)](
        act, w_down, y, flat_w, a.sorted_ids, a.block_expert, a.num_padded, blocks_m,
        blocks_n, t * k, h, i, *act.stride(), *w_down.stride(), *y.stride(), **tiles)
    block_h = min(1024, triton.next_power_of_2(h))
    kernels.sum_topk_kernel[(t, triton.cdiv(h, block_h))](
        y, out, h, y.stride(0), out.stride(0), TOP_K=k, BLOCK_H=block_h)
    return out


class TritonMoe:
    """The MoE function of the torch backend's model, on Triton kernels.

    Called like :func:`backends.torch.moe.moe_forward`. ``config_folders`` are searched for
    launch tables before the packaged ones; ``config`` forces one config for every call.
    Calls of more than ``chunk_tokens`` tokens run in chunks of that many, which bounds the
    float32 intermediate ``[T*K, H]`` (vLLM chunks likewise).
    """

    def __init__(self, config_folders: Sequence[Path] = (),
                 config: LaunchConfig | None = None, chunk_tokens: int = 8192) -> None:
        if chunk_tokens < 1:
            raise InvalidValueError("chunk_tokens", chunk_tokens, "must be >= 1")
        self.tables = ConfigTables(config_folders)
        self.config = config
        self.chunk_tokens = chunk_tokens
        self._devices: dict[torch.device, str] = {}

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                 routing: RoutingSpec) -> torch.Tensor:
        """The routed-experts output ``[T, H]``; see :func:`backends.torch.moe.moe_forward`."""
        check_operands(hidden, w_gate_up, w_down)
        if router_logits.shape != (hidden.shape[0], w_gate_up.shape[0]):
            raise InvalidValueError("router_logits", tuple(router_logits.shape),
                                    f"need [{hidden.shape[0]}, {w_gate_up.shape[0]}]")
        weights, ids = route(router_logits, SoftmaxTopK(top_k, routing.renormalize))
        t, step = hidden.shape[0], self.chunk_tokens
        if t <= step:
            return fused_experts(hidden, weights, ids, w_gate_up, w_down,
                                 self.pick(hidden, w_gate_up, top_k))
        config = self.pick(hidden[:step], w_gate_up, top_k)
        return torch.cat([fused_experts(hidden[a:a + step], weights[a:a + step],
                                        ids[a:a + step], w_gate_up, w_down, config)
                          for a in range(0, t, step)])

    def pick(self, hidden: torch.Tensor, w_gate_up: torch.Tensor, top_k: int) -> LaunchConfig:
        """The launch config for this call's shapes, dtype and device."""
        if self.config is not None:
            return self.config
        e, two_i, _ = w_gate_up.shape
        if hidden.device not in self._devices:
            self._devices[hidden.device] = device_name(hidden.device)
        key = ConfigKey(e, two_i // 2, self._devices[hidden.device], DTYPES[hidden.dtype])
        return self.tables.pick(key, hidden.shape[0], top_k)


if TYPE_CHECKING:
    def _satisfies_moe_function(moe: TritonMoe) -> MoeFunction:
        """mypy proves that TritonMoe stands in for moe_forward in the torch model."""
        return moe
