"""Embedding inputs with time and self-conditioning, for continuous diffusion and flow models.

Owns the input side of a :class:`~pipeline.contracts.model.ModelCall` that carries ``embeddings``
(docs/design.md §6, §10): :func:`embedding_space` (the space those embeddings live in),
:func:`time_features` (the sinusoidal features of a time value) and :func:`call_inputs`,
which builds the ``[T, H]`` hidden states a forward starts from.

A call's positions start from its token ids' embeddings, or from its ``embeddings`` when it
has them (``[len(token_ids), H]``; the ids then only keep the length). A model whose
``config.json`` has ``"embedding_conditioning": {"time": true, "self_condition": true}``
carries two more weights (:class:`~backends.torch.weights.ConditioningWeights`) and adds,
to every position of a call that gives them,

- ``time_mlp(features(time))``: ``Linear(H, H) → SiLU → Linear(H, H)`` over
  :func:`time_features` (CDCD, Plaid, DiT: the denoiser is told the noise level);
- ``self_condition @ W_sc^T``: the previous iteration's x0 estimate projected (Chen et al.,
  "Analog Bits"); a call without one adds nothing (as a zero estimate would).

Continuous strategies work in :func:`embedding_space`: each token's embedding row scaled to
unit root-mean-square (CDCD's normalised embeddings), so a clean embedding and standard
Gaussian noise have the same per-coordinate scale. The training scripts use these same
functions, so training and inference agree by construction.

Example::

    space = embedding_space(weights.embed)                      # [V, H]
    h = call_inputs(weights, batch_token_embeddings, pieces)     # [T, H]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F

from backends.torch.weights import ConditioningWeights

TIME_SCALE = 1000.0
"""Time values in [0, 1] are multiplied by this before the sinusoids (as t/T · T)."""


def embedding_space(embed: torch.Tensor) -> torch.Tensor:
    """The embedding rows ``[V, H]`` scaled to unit root-mean-square (norm √H), in float32."""
    e = embed.float()
    return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-12)


def time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features ``[N, dim]`` of times ``t [N]`` in [0, 1] (cos half, sin half;
    frequencies 10000^(-i/(dim/2)), the transformer's)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                        device=t.device) / half)  # [dim/2]
    args = t.float()[:, None] * TIME_SCALE * freqs[None, :]                        # [N, dim/2]
    out = torch.cat([args.cos(), args.sin()], dim=-1)
    return F.pad(out, (0, dim - 2 * half))                                         # [N, dim]


def time_embedding(w: ConditioningWeights, t: torch.Tensor) -> torch.Tensor:
    """``time_mlp(time_features(t))`` ``[N, H]`` for times ``t [N]``."""
    assert w.time_in is not None and w.time_out is not None
    x = time_features(t, w.time_in.shape[1]).to(w.time_in.dtype)
    x = F.silu(F.linear(x, w.time_in, w.time_in_bias))
    return F.linear(x, w.time_out, w.time_out_bias)


@attrs.frozen
class Piece:
    """One call's inputs beyond its token ids: where its rows sit in the batch (``offset``,
    ``length``) and what it brings (each optional)."""

    offset: int
    length: int
    embeddings: torch.Tensor | None = attrs.field(default=None, eq=False)
    time: float | None = None
    self_condition: torch.Tensor | None = attrs.field(default=None, eq=False)


def call_inputs(cond: ConditioningWeights | None, h: torch.Tensor,
                pieces: Sequence[Piece]) -> torch.Tensor:
    """The hidden states ``[T, H]`` a forward starts from: ``h`` (the token embeddings),
    with each piece's rows replaced by its embeddings and its time and self-condition
    terms added. ``cond`` is None for a model without conditioning (then only embeddings
    may be given; the backend checks that before calling)."""
    h = h.clone()
    for p in pieces:
        rows = slice(p.offset, p.offset + p.length)
        if p.embeddings is not None:
            h[rows] = p.embeddings.to(device=h.device, dtype=h.dtype)
        if cond is not None and p.time is not None:
            t = torch.full((1,), p.time, dtype=torch.float32, device=h.device)
            h[rows] += time_embedding(cond, t).to(h.dtype)                      # [1, H]
        if cond is not None and cond.self_condition is not None \
                and p.self_condition is not None:
            sc = p.self_condition.to(device=h.device, dtype=h.dtype)            # [n, H]
            h[rows] += F.linear(sc, cond.self_condition)
    return h
