"""GGUF matrices multiplied in their quantized form, on torch's int4 weight-packed kernel.

Owns :class:`Int4Weight` (a Q4_0, Q4_1, Q4_K, Q5_K or Q8_0 matrix repacked once for
``torch.ops.aten._weight_int4pack_mm_for_cpu``), :func:`int4_available`, :func:`int4_fits`
and :func:`int4_linear`. A decode step of a small model reads every weight once per token, so
reading 4.5-10 bits a weight instead of 32 is most of the speed a CPU has to give; torch's
kernel unpacks the nibbles in registers and never makes a dense copy: no product here ever
dequantizes a whole matrix.

Exactness. torch's format computes ``(c - 8) * scale + zero`` for 4-bit codes ``c`` in 0..15,
one ``scale`` and ``zero`` per group of 32 along the input dimension. Every type here stores
groups of 32 with one affine map each, so its integer codes map onto one or two such *planes*
exactly (``s``: the group's step, ``o``: its offset; ``lo = q & 15``, ``hi = q >> 4``)::

    type   stored value          plane 1: code, scale, zero     plane 2: code, scale, zero
    Q4_0   d (q - 8)             q,  d,  0
    Q4_1   d q + m               q,  d,  m + 8 d
    Q4_K   s q - o  (q 0..15)    q,  s,  8 s - o
    Q5_K   s q - o  (q 0..31)    lo, s,  8 s - o               hi + 8, 16 s, 0
    Q8_0   d q      (q -128..127) lo, d, 8 d                    hi + 8, 16 d, 0

(Q4_K/Q5_K: ``s = d * sc`` and ``o = dmin * mn`` per 32-element sub-block.) A two-plane
matrix is packed with its planes side by side along the input dimension, ``[out, 2 * in]``,
and multiplied by the input repeated twice: one kernel call, the planes summed in the
kernel's float32 accumulator. The codes are kept exactly; ``scale`` and ``zero`` are held in
bfloat16, the dtype of the fast kernel's activations (the file stores ``d``, ``dmin`` and
``m`` as float16, so their lowest three mantissa bits round), and activations go in as
bfloat16: results agree with the dequantized float32 product to about bfloat16's precision
(``tests/test_gguf_int4.py`` measures it), not bit for bit.

Q6_K does not map: its 16-element sub-blocks each have their own scale, and the kernel's
smallest group is 32. :mod:`backends.gguf.load` keeps Q6_K matrices in bfloat16 instead.

Example::

    w = Int4Weight.from_quantized(quantized_weight)      # a QuantizedWeight of a type above
    y = int4_linear(x, w)                                # x [T, in] float32 -> [T, out] float32
"""

from __future__ import annotations

import attrs
import torch
from gguf import GGMLQuantizationType as QT

from backends.gguf.quants import QK_K, QuantizedWeight, k_scales
from pipeline.errors import ArtifactError, InvalidValueError

GROUP = 32
"""Weights per group along a row: every type's blocks or sub-blocks, and torch's groups."""
COMPUTE = torch.bfloat16
"""The activations' and scales' dtype in the kernel."""
PLANES: dict[QT, int] = {QT.Q4_0: 1, QT.Q4_1: 1, QT.Q4_K: 1, QT.Q5_K: 2, QT.Q8_0: 2}
"""The types that map onto the kernel, and the 4-bit planes each takes."""
ROW_MULTIPLE = 16
"""The kernel's layout packs output rows 16 at a time."""

Plane = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""One plane: codes uint8 ``[out, in]`` in 0..15, and float32 ``scale`` and ``zero``
``[out, in / 32]``."""


def int4_fits(w: QuantizedWeight) -> bool:
    """Whether ``w`` can be repacked: a type of :data:`PLANES`, output rows a multiple of 16."""
    return w.qtype in PLANES and w.shape[0] % ROW_MULTIPLE == 0 and w.shape[1] % GROUP == 0


def int4_available(device: torch.device | str = "cpu") -> bool:
    """Whether this torch has the CPU int4 kernel and ``device`` is a CPU."""
    return (torch.device(device).type == "cpu"
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"))


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block ``[..., bytes]``, as float32 ``[..., 1]``."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2n]``: the low nibbles, then the high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _planes(w: QuantizedWeight) -> list[Plane]:
    """``w``'s codes and group maps, one entry per plane (the table in the module's doc)."""
    rows, cols = w.shape
    if w.qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0):
        head = {QT.Q4_0: 2, QT.Q4_1: 4, QT.Q8_0: 2}[w.qtype]
        blocks = w.data.reshape(rows, cols // GROUP, -1)                 # [out, in/32, bytes]
        d = _f16(blocks, 0)[..., 0]                                      # [out, in/32]
        if w.qtype == QT.Q8_0:
            q = blocks[..., head:].contiguous().view(torch.int8)         # [out, in/32, 32]
            lo, hi = (q & 0x0F).to(torch.uint8), ((q >> 4) + 8).to(torch.uint8)
            return [(lo.reshape(rows, cols), d, 8 * d),
                    (hi.reshape(rows, cols), 16 * d, torch.zeros_like(d))]
        codes = _nibbles(blocks[..., head:]).reshape(rows, cols)
        zero = (torch.zeros_like(d) if w.qtype == QT.Q4_0
                else _f16(blocks, 2)[..., 0] + 8 * d)
        return [(codes, d, zero)]
    # Q4_K / Q5_K: super-blocks of 256, eight sub-blocks of 32 with a 6-bit scale and min
    blocks = w.data.reshape(-1, w.data.shape[1] // (cols // QK_K))       # [N, bytes]
    sc, mn = k_scales(blocks[:, 4:16])                                   # [N, 8]
    step = (_f16(blocks, 0) * sc).reshape(rows, cols // GROUP)           # [out, in/32]
    offset = (_f16(blocks, 2) * mn).reshape(rows, cols // GROUP)
    quads = 48 if w.qtype == QT.Q5_K else 16                             # where the nibbles start
    low = _nibbles(blocks[:, quads:].reshape(-1, 4, 32)).reshape(rows, cols)
    first = (low, step, 8 * step - offset)
    if w.qtype == QT.Q4_K:
        return [first]
    qh = blocks[:, 16:48].unsqueeze(1)                                   # [N, 1, 32]
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    high = ((qh >> shifts) & 1) + 8                                      # [N, 8, 32]
    return [first, (high.reshape(rows, cols), 16 * step, torch.zeros_like(step))]


@attrs.frozen(eq=False)
class Int4Weight:
    """A matrix ``(out, in)`` in torch's int4 CPU layout: ``packed`` (the codes of every
    plane, two a byte, planes side by side along the input) and ``scales``
    ``[planes * in / 32, out, 2]`` bfloat16 (scale, zero) per group; ``planes`` 1 or 2."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    planes: int = 1

    @classmethod
    def from_quantized(cls, w: QuantizedWeight) -> Int4Weight:
        """Repack ``w``; ArtifactError unless :func:`int4_fits` (another type, output rows
        not a multiple of 16)."""
        if w.qtype not in PLANES:
            raise ArtifactError(f"the int4 kernel takes {', '.join(t.name for t in PLANES)} "
                                f"matrices, not {w.qtype.name}")
        if not int4_fits(w):
            raise ArtifactError(f"the int4 kernel packs output rows {ROW_MULTIPLE} at a time; a "
                                f"{w.qtype.name} matrix of shape {w.shape} does not fit")
        planes = _planes(w)
        codes = torch.cat([c for c, _, _ in planes], dim=1)              # [out, P*in]
        scales = torch.cat([torch.stack((s, z), dim=-1) for _, s, z in planes], dim=1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        return cls(packed, scales.transpose(0, 1).contiguous().to(COMPUTE), w.shape,
                   len(planes))

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
    if w.planes > 1:
        flat = flat.repeat(1, w.planes)                                  # [T, P*in]
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
        flat, w.packed, GROUP, w.scales).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], rows)
