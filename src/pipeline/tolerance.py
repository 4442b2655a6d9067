"""What rounding explains: the tolerance ``pipeline compare`` and ``pipeline trace diff``
hold a difference in logits or hidden states against (docs/tracing.md).

Owns :data:`UNIT_ROUNDOFF` (each dtype's unit roundoff ``u``), :func:`pair_unit` (the coarser
of two sides'), :func:`explained` and :func:`depth_of` (a layer tap's depth from its name).

A tensor stored in a dtype of unit roundoff ``u`` carries a rounding of about ``u`` times
its magnitude per operation, plus the float32 sums inside its products, whose order two
kernels choose differently (about ``u32`` · sqrt(width) of the magnitude, width the hidden
size); both accumulate through the layers. The tolerance is :data:`TOLERANCE` · (``u`` +
``u32`` · sqrt(width)) · max|x| · sqrt(depth), depth counting the layers up to the tensor (the
logits count them all).

Example::

    explained(pair_unit("float32", "bfloat16"), magnitude=2.8, depth=1, width=576)  # 0.18
"""

from __future__ import annotations

import math

UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                 "float64": 2.0 ** -53}
"""Each compute dtype's unit roundoff ``u``."""

TOLERANCE = 16.0
"""The multiple of a tensor's rounding that the dtypes explain (calibrated in
docs/tracing.md: float32 and bfloat16 differences between implementations, thread counts
and batches stay below a quarter of it; planted differences exceed it by orders of
magnitude)."""

FLOAT32_UNIT = 2.0 ** -24
"""The unit roundoff of the float32 sums inside every product, whatever the stored dtype."""


def pair_unit(a: str, b: str) -> float:
    """The coarser unit roundoff of two dtypes' names (``"bfloat16"``, ``"torch.float32"``);
    an unknown name counts as bfloat16's."""
    return max(UNIT_ROUNDOFF.get(name.removeprefix("torch."), UNIT_ROUNDOFF["bfloat16"])
               for name in (a, b))


def explained(unit: float, magnitude: float, depth: int, width: int) -> float:
    """The largest difference rounding explains in a tensor of ``magnitude`` (max |x|) after
    ``depth`` layers whose products sum over ``width`` terms, computed at unit roundoff
    ``unit``."""
    per_op = unit + FLOAT32_UNIT * math.sqrt(max(width, 1))
    return TOLERANCE * per_op * max(magnitude, 1e-30) * math.sqrt(max(depth, 1))


def depth_of(name: str) -> int:
    """Layers up to and including a tap: ``embed`` 1, ``layers.i...`` i + 1."""
    parts = name.split(".")
    return int(parts[1]) + 1 if parts[0] == "layers" and len(parts) > 1 else 1
