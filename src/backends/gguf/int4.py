"""GGUF 4-bit matrices multiplied in their quantized form, on torch's int4 weight-packed kernel.

Owns :class:`Int4Weight` (a Q4_0 or Q4_1 matrix repacked once for
``torch.ops.aten._weight_int4pack_mm_for_cpu``), :func:`int4_available` and
:func:`int4_linear`. A decode step of a small model reads every weight once per token, so
reading 4.5–5 bits a weight instead of 32 is most of the speed a CPU has to give; torch's
kernel unpacks the nibbles in registers and never makes a dense copy.

Exactness. Both formats store blocks of 32 weights along a row (the input dimension) with
4-bit codes q in 0..15: Q4_0 means ``d * (q - 8)``, Q4_1 ``d * q + m``, which is
``d * (q - 8) + (m + 8 d)``. torch's format computes ``(q - 8) * scale + zero`` per group of
32 along the input dimension, so both map onto it with ``scale = d`` and ``zero = 0`` or
``m + 8 d``. The codes are kept exactly; ``scale`` and ``zero`` are held in bfloat16, the
dtype of the fast kernel's activations (the file stores ``d`` and ``m`` as float16, so their
lowest three mantissa bits round), and activations go in as bfloat16: results agree with the
dequantized float32 product to about bfloat16's precision (``tests/test_gguf_int4.py``
measures it), not bit for bit.

Example::

    w = Int4Weight.from_quantized(quantized_weight)      # a QuantizedWeight of Q4_0 or Q4_1
    y = int4_linear(x, w)                                # x [T, in] float32 -> [T, out] float32
"""

from __future__ import annotations

import attrs
import torch
from gguf import GGMLQuantizationType as QT

from backends.gguf.quants import QuantizedWeight
from pipeline.errors import ArtifactError, InvalidValueError

GROUP = 32
"""Weights per block along a row, in both Q4 formats and in torch's groups."""
COMPUTE = torch.bfloat16
"""The activations' and scales' dtype in the kernel."""
INT4_TYPES = (QT.Q4_0, QT.Q4_1)
ROW_MULTIPLE = 16
"""The kernel's layout packs output rows 16 at a time."""


def int4_fits(w: QuantizedWeight) -> bool:
    """Whether ``w`` can be repacked: Q4_0 or Q4_1, output rows a multiple of 16."""
    return w.qtype in INT4_TYPES and w.shape[0] % ROW_MULTIPLE == 0 and w.shape[1] % GROUP == 0


def int4_available(device: torch.device | str = "cpu") -> bool:
    """Whether this torch has the CPU int4 kernel and ``device`` is a CPU."""
    return (torch.device(device).type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"))


@attrs.frozen(eq=False)
class Int4Weight:
    """A Q4_0/Q4_1 matrix ``(out, in)`` in torch's int4 CPU layout: ``packed`` (the codes, two
    a byte) and ``scales`` ``[in/32, out, 2]`` bfloat16 (scale, zero) per group."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_quantized(cls, w: QuantizedWeight) -> Int4Weight:
        """Repack ``w``; ArtifactError unless :func:`int4_fits` (another type, output rows
        not a multiple of 16)."""
        if w.qtype not in INT4_TYPES:
            raise ArtifactError(f"the int4 kernel takes Q4_0 and Q4_1 matrices, not {w.qtype.name}")
        rows, cols = w.shape
        if not int4_fits(w):
            raise ArtifactError(f"the int4 kernel packs output rows {ROW_MULTIPLE} at a time; a "
                                f"{w.qtype.name} matrix of shape {w.shape} does not fit")
        head = 2 if w.qtype == QT.Q4_0 else 4
        blocks = w.data.reshape(rows, cols // GROUP, head + GROUP // 2)   # [out, in/32, bytes]
        qs = blocks[..., head:]                                          # [out, in/32, 16]
        codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)                  # [out, in/32, 32]
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()    # [out, in/32, 1]
        if w.qtype == QT.Q4_0:
            zero = torch.zeros_like(d)
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            zero = m + 8 * d
        scales = torch.cat((d, zero), dim=-1).transpose(0, 1).contiguous().to(COMPUTE)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.reshape(rows, cols).to(torch.int32), 2)
        return cls(packed, scales, (rows, cols))

    @property
    def nbytes(self) -> int:
        """Memory the codes and scales take."""
        return (self.packed.numel() * self.packed.element_size()
                + self.scales.numel() * self.scales.element_size())


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``x [*, in] @ W.T (+ bias)``: ``[*, out]`` in ``x``'s dtype (computed with bfloat16
    activations); InvalidValueError if ``x``'s last dimension is not ``in``."""
    rows, cols = w.shape
    if x.dim() == 0 or x.shape[-1] != cols:
        raise InvalidValueError("x", tuple(x.shape), f"last dimension must be {cols}")
    flat = x.reshape(-1, cols).to(COMPUTE)
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        flat, w.packed, GROUP, w.scales).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], rows)
