"""Allowed-token bitmasks applied to logits.

Owns :func:`apply_bitmask`: the grammar engines write one bit per token id, 32 to an int32
word (bit ``i % 32`` of word ``i // 32``, least significant first), and the processor turns
the zero bits into ``-inf`` logits. The engines fill CPU memory; on the CPU the bits are
unpacked by NumPy, and for logits on an accelerator the packed words (32 times smaller than
the mask) are copied there and unpacked by torch on the device.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """Int32 words that hold one bit per id of a ``vocab_size`` vocabulary."""
    return (vocab_size + 31) // 32


def allowed_mask(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """The bool ``[B, vocab]`` mask of ``bitmask`` ``[B, W]`` (int32, CPU), on ``device``."""
    if device.type == "cpu":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1,
                             bitorder="little")[:, :vocab]                     # [B, V] 0/1
        return torch.from_numpy(bits).view(torch.bool)
    return unpack_bits(bitmask.to(device, non_blocking=True), vocab)


def unpack_bits(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool ``[B, vocab]`` mask of int32 ``words`` ``[B, W]``, by torch on their device."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1                                 # [B, W, 32]
    return bits.flatten(1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits`` ``[B, V]`` to ``-inf`` where ``bitmask`` ``[B, ceil(V / 32)]`` (int32, on
    the CPU) has a zero bit, in place. Raises ``ValueError`` on mismatched shapes."""
    rows, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.shape != (rows, bitmask_words(vocab)):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} does not fit "
                         f"logits {tuple(logits.shape)}: want int32 [{rows}, "
                         f"{bitmask_words(vocab)}]")
    logits.masked_fill_(~allowed_mask(bitmask, vocab, logits.device), float("-inf"))
