"""Counter-based randomness: the uniform draw of a row is a pure function of three integers.

Owns :func:`uniform` and :func:`row_uniforms`. There is no generator object and no global RNG:
the draw for (``seed``, ``stream``, ``step``) hashes the three integers with the SplitMix64
finalizer, chained like a sponge, and keeps the top 53 bits. The "RNG cursor" of a request is
therefore just its step (docs/design.md §6), and a request's draws cannot depend on which other
requests share its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.contracts.decode import Row

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's increment
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_TO_UNIT = 2.0 ** -53


def mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers with full avalanche."""
    z = ((z ^ (z >> 30)) * _MUL1) & MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & MASK64
    return z ^ (z >> 31)


def uniform(seed: int, stream: int, step: int) -> float:
    """A uniform number in ``[0, 1)`` (53 random bits) determined by the three integers.

    Example::

        u = uniform(seed=1234, stream=0, step=7)     # same value on every call and machine
    """
    h = mix64((seed + GOLDEN) & MASK64)
    h = mix64(((h ^ (stream & MASK64)) + GOLDEN) & MASK64)
    h = mix64(((h ^ (step & MASK64)) + GOLDEN) & MASK64)
    return (h >> 11) * _TO_UNIT


BELOW_ONE = 1.0 - 2.0 ** -52
"""``row_uniforms`` scales by this so ``u * total`` rounds strictly below ``total`` (total >= 1)."""


def row_uniforms(rows: Sequence[Row], device: torch.device) -> torch.Tensor:
    """``[B]`` float64: each row's draw at its (``seed``, ``stream``, ``step``), times
    :data:`BELOW_ONE` (a change of at most 2**-52 that keeps inverse-CDF products in range)."""
    return torch.tensor([uniform(r.seed, r.stream, r.step) * BELOW_ONE for r in rows],
                        dtype=torch.float64, device=device)
