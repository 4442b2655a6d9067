"""Counter-based Gaussian noise: a draw is a pure function of (seed, stream, step, iteration).

Owns :func:`gaussian`. Like :func:`stages.select.rng.uniform`, there is no generator that
advances: the standard-normal tensor for a key is made by a ``torch.Generator`` seeded with a
hash of the key's integers (SplitMix64 through :func:`~stages.select.rng.uniform`), on the
CPU, then moved to the caller's device. So a request's noise does not depend on which other
requests share its batch, on the device, or on how many draws came before.

Example::

    z = gaussian(seed=7, stream=0, step=17, iteration=3, shape=(16, 192))
"""

from __future__ import annotations

import torch

from stages.select.rng import uniform

_BITS = 2 ** 53


def key_seed(seed: int, stream: int, step: int, iteration: int) -> int:
    """A 53-bit generator seed that is a pure function of the four integers."""
    first = int(uniform(seed, stream, step) * _BITS)
    return int(uniform(first, iteration, 0x6A55) * _BITS)


def gaussian(seed: int, stream: int, step: int, iteration: int, shape: tuple[int, ...],
             device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
             ) -> torch.Tensor:
    """Standard-normal noise of ``shape`` for the key (seed, stream, step, iteration)."""
    gen = torch.Generator().manual_seed(key_seed(seed, stream, step, iteration))
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
