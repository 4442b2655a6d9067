"""Counter-based uniform tensors for the iterative strategies (docs/design.md §6), and whose
seed they use.

Owns :func:`uniforms`: ``n`` uniform numbers in ``(0, 1)`` that are a pure function of
(``seed``, ``stream``, ``step``, element index), like :func:`stages.select.rng.uniform` but for
a whole ``[L, V]`` Gumbel draw at once. The three integers are folded into a 128-bit key with
the same SplitMix64 chain as ``uniform``; each element's index is then hashed with that key by
two rounds of MurmurHash3's 32-bit finalizer per half (53 random bits per number). Everything is
int64 tensor arithmetic that never overflows (32-bit products are split into 16-bit halves), so
the numbers are the same on every device and in every batch: a sequence's draws cannot depend
on which other sequences share its step.

Also owns the seed rule every iterative strategy (masked and continuous) draws with,
:func:`noise_seed`, and the reproducibility it declares in the trace, :func:`noise_kind`:
temperature 0 means deterministic, so a greedy request without a seed draws from
:data:`FIXED_SEED` rather than from a seed derived from its request id.
"""

from __future__ import annotations

import torch

from pipeline.contracts.decode import Row
from stages.select.rng import GOLDEN, MASK64, mix64

_M32 = 0xFFFFFFFF
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_WEYL32 = 0x9E3779B9
_TO_UNIT = 2.0 ** -53

FIXED_SEED = 0
"""The seed of a greedy (temperature 0) request that gave none: its draws (random remasking,
``dfm``'s jumps, a continuous strategy's noise) are the same on every run."""
NOISE_KINDS = ("none", "seeded", "fixed", "request")
"""What a run's randomness is, as ``step.configured`` declares it: ``none`` (no draws: the
output is a function of the model's logits), ``seeded`` (drawn from the request's seed),
``fixed`` (temperature 0 without a seed: drawn from :data:`FIXED_SEED`, the same for every
request), ``request`` (sampling without a seed: drawn from a seed derived from the request id,
recorded in ``selection.configured``, so a rerun with that seed replays it)."""


def noise_seed(row: Row) -> int:
    """The seed ``row``'s draws come from: :data:`FIXED_SEED` at temperature 0 without a
    seed, else the request's (given, or derived from its id)."""
    return FIXED_SEED if row.config.seed is None and row.config.greedy else row.seed


def noise_kind(row: Row, draws: bool) -> str:
    """One of :data:`NOISE_KINDS`: ``row``'s reproducibility when its strategy ``draws``
    random numbers (or not)."""
    if not draws:
        return "none"
    if row.config.seed is not None:
        return "seeded"
    return "fixed" if row.config.greedy else "request"


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """``a * c mod 2**32`` for int64 ``a`` in ``[0, 2**32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (a * lo + (((a * hi) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with full avalanche)."""
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX2)
    return h ^ (h >> 16)


def stream_key(seed: int, stream: int, step: int) -> tuple[int, int, int, int]:
    """Four 32-bit words of the key for (``seed``, ``stream``, ``step``)."""
    h1 = mix64((seed + GOLDEN) & MASK64)
    h1 = mix64(((h1 ^ (stream & MASK64)) + GOLDEN) & MASK64)
    h1 = mix64(((h1 ^ (step & MASK64)) + GOLDEN) & MASK64)
    h2 = mix64((h1 + GOLDEN) & MASK64)
    return h1 & _M32, h1 >> 32, h2 & _M32, h2 >> 32


def uniforms(seed: int, stream: int, step: int, shape: tuple[int, ...],
             device: torch.device | str = "cpu") -> torch.Tensor:
    """float64 uniforms in ``(0, 1)`` of ``shape``, element i a pure function of the three
    integers and i (row-major index).

    Example::

        u = uniforms(1234, 0, 7, (16, 6145))      # the same numbers on every call and device
    """
    k0, k1, k2, k3 = stream_key(seed, stream, step)
    n = 1
    for size in shape:
        n *= size
    index = torch.arange(n, dtype=torch.int64, device=device)
    x = (_mul32(index & _M32, _WEYL32) + k0) & _M32
    high = _fmix32(_fmix32(x) ^ k1)                                  # 32 bits
    low = _fmix32(_fmix32(x ^ k2) ^ k3) >> 11                        # 21 bits
    bits = (high << 21) | low                                        # [n], 53 bits
    return ((bits.to(torch.float64) + 0.5) * _TO_UNIT).view(shape)
