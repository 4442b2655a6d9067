"""Allowed-token bitmasks applied to logits.

Owns :func:`apply_bitmask`: the grammar engines write one bit per token id, 32 to an int32
word (bit ``i % 32`` of word ``i // 32``, least significant first), and the processor turns
the zero bits into ``-inf`` logits. The bits are unpacked by NumPy on the CPU (the engines
fill CPU memory) and moved to the logits' device once per step.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """Int32 words that hold one bit per id of a ``vocab_size`` vocabulary."""
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits`` ``[B, V]`` to ``-inf`` where ``bitmask`` ``[B, ceil(V / 32)]`` (int32, on
    the CPU) has a zero bit, in place. Raises ``ValueError`` on mismatched shapes."""
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape != (rows, bitmask_words(vocab)):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not fit "
                         f"logits {tuple(logits.shape)}: want int32 [{rows}, "
                         f"{bitmask_words(vocab)}]")
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1,
                         bitorder="little")[:, :vocab]                         # [B, V] 0/1
    allowed = torch.from_numpy(bits).to(logits.device, non_blocking=True)
    logits.masked_fill_(allowed == 0, float("-inf"))
