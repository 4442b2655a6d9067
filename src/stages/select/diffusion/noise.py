"""Counter-based uniform tensors for the iterative strategies (DESIGN §6).

Owns :func:`uniforms`: ``n`` uniform numbers in ``(0, 1)`` that are a pure function of
(``seed``, ``stream``, ``step``, element index), like :func:`stages.select.rng.uniform` but for
a whole ``[L, V]`` Gumbel draw at once. The three integers are folded into a 128-bit key with
the same SplitMix64 chain as ``uniform``; each element's index is then hashed with that key by
two rounds of MurmurHash3's 32-bit finalizer per half (53 random bits per number). Everything is
int64 tensor arithmetic that never overflows (32-bit products are split into 16-bit halves), so
the numbers are the same on every device and in every batch: a sequence's draws cannot depend
on which other sequences share its step.
"""

from __future__ import annotations

import torch

from stages.select.rng import _GOLDEN, _MASK64, _mix64

_M32 = 0xFFFFFFFF
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_WEYL32 = 0x9E3779B9
_TO_UNIT = 2.0 ** -53


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
    h1 = _mix64((seed + _GOLDEN) & _MASK64)
    h1 = _mix64(((h1 ^ (stream & _MASK64)) + _GOLDEN) & _MASK64)
    h1 = _mix64(((h1 ^ (step & _MASK64)) + _GOLDEN) & _MASK64)
    h2 = _mix64((h1 + _GOLDEN) & _MASK64)
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
