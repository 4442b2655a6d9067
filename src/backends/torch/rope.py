"""Rotary position embeddings: inverse frequencies for each :class:`RopeSpec` kind, and their use.

The formulas reproduce ``transformers.modeling_rope_utils`` (5.x) term for term, including the
float32 arithmetic, so cos/sin tables agree bit for bit: ``default`` (theta^(-2i/d)),
``linear`` (divided by ``factor``), ``llama3`` (low frequencies divided by ``factor``, a smooth
blend between ``low_freq_factor`` and ``high_freq_factor``) and ``yarn`` (a ramp between
interpolated and extrapolated frequencies, cos/sin scaled by ``attention_factor``). The
rotation is the "rotate half" layout Hugging Face checkpoints use.

Example::

    inv_freq, scale = rope_frequencies(spec.rope, spec.head_dim)   # [D/2]
    cos, sin = rope_cos_sin(inv_freq, scale, positions, torch.float32)   # [T, D] each
    q = apply_rope(q, cos, sin)                                  # q [T, heads, D]
"""

from __future__ import annotations

import math

import torch

from backends.torch.config import RopeSpec


def rope_frequencies(rope: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_factor)`` for ``rope``."""
    base = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim   # [D/2]
    inv_freq = 1.0 / (rope.theta ** base)
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, head_dim), rope.attention_factor
    return inv_freq, 1.0


def _llama3(inv_freq: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    old = rope.original_max_position
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor
                                                       - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeSpec, dim: int) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp                                  # share of the extrapolated frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, D]`` in ``dtype`` for int ``positions [T]`` (computed in float32)."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]   # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                       # [T, D]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` by the per-token ``cos``/``sin [T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)   # [T, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]
