"""The update rules of the masked-diffusion samplers, as small pure functions over one block.

Owns the pieces each sampler's step is made of, each following its paper's reference code
(LLaDA's ``generate()``, Fast-dLLM's, the ``flow_matching`` library's; docs/design.md §10 and
docs/diffusion.md, "The samplers"):

- :func:`num_transfer_tokens` — LLaDA's ``get_num_transfer_tokens``: how many masked positions
  each of ``steps`` steps commits (an even split, the remainder on the first steps);
- :func:`gumbel_argmax` — LLaDA's ``add_gumbel_noise`` then argmax, in float64: the predicted
  token of every position (plain argmax at temperature 0);
- :func:`top_confidence` — commit the ``k`` masked positions of highest confidence (LLaDA's
  ``low_confidence`` remasking with the model's probability of the prediction, ``random``
  remasking with uniform scores);
- :func:`above_threshold` — Fast-dLLM's parallel rule: every masked position whose confidence
  exceeds the threshold, and at least the most confident one;
- :func:`dfm_jumps` — the discrete Euler step of discrete flow matching with a mask source
  (Gat et al. 2024; ``flow_matching``'s ``MixtureDiscreteEulerSolver``): a masked position
  jumps to its sampled token with probability ``1 - exp(-h * dκ/(1-κ))``.

Shapes: L positions of the block, V vocabulary. Ties break toward the lower position.
"""

from __future__ import annotations

import math

import torch


def num_transfer_tokens(masked: int, steps: int) -> list[int]:
    """Tokens to commit at each of ``steps`` steps so that ``masked`` are committed in all.

    Example::

        num_transfer_tokens(10, 4)      # [3, 3, 2, 2]
    """
    if masked < 0 or steps < 1:
        raise ValueError(f"need masked >= 0 and steps >= 1, got {masked} and {steps}")
    base, remainder = divmod(masked, steps)
    return [base + (1 if i < remainder else 0) for i in range(steps)]


def gumbel_argmax(scores: torch.Tensor, uniform: torch.Tensor | None) -> torch.Tensor:
    """``[L]`` predicted tokens: ``argmax(exp(scores) / (-log u))`` in float64 (LLaDA's
    ``add_gumbel_noise`` with the temperature already applied to ``scores``), i.e. a draw from
    ``softmax(scores)``; plain ``argmax(scores)`` when ``uniform`` is None (greedy).
    ``scores [L, V]``, ``uniform [L, V]`` in (0, 1)."""
    if uniform is None:
        return scores.argmax(-1)
    z = scores.double()
    gumbel = -torch.log(-torch.log(uniform))                                  # [L, V]
    return (z + gumbel).argmax(-1)


def confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[L]`` float64: the model's probability of each predicted token (softmax of the raw
    logits, as LLaDA's ``low_confidence`` remasking computes it)."""
    p = torch.softmax(logits.double(), -1)                                    # [L, V]
    return p.gather(-1, tokens[:, None])[:, 0]


def top_confidence(scores: torch.Tensor, masked: torch.Tensor, k: int) -> torch.Tensor:
    """``[L]`` bool: the ``k`` masked positions of highest ``scores`` (fewer if fewer are
    masked); unmasked positions are never chosen."""
    ranked = torch.where(masked, scores.double(), float("-inf"))
    k = min(k, int(masked.sum()))
    chosen = torch.zeros_like(masked)
    if k > 0:
        # A stable sort keeps the lower position first among equal confidences.
        order = torch.sort(ranked, descending=True, stable=True).indices[:k]
        chosen[order] = True
    return chosen


def above_threshold(scores: torch.Tensor, masked: torch.Tensor, threshold: float
                    ) -> torch.Tensor:
    """``[L]`` bool: masked positions with ``scores > threshold``, plus the most confident
    masked position when none is (Fast-dLLM: at least one token per step)."""
    chosen = masked & (scores.double() > threshold)
    if masked.any() and not chosen.any():
        chosen = top_confidence(scores, masked, 1)
    return chosen


def kappa(t: float, power: float) -> tuple[float, float]:
    """``(κ(t), dκ/dt)`` of the polynomial convex scheduler ``κ(t) = t**power``."""
    return t ** power, power * t ** (power - 1) if t > 0 or power >= 1 else math.inf


def jump_probability(t: float, h: float, power: float) -> float:
    """The discrete Euler step's probability that a masked position unmasks between ``t`` and
    ``t + h``: ``1 - exp(-h * dκ/(1-κ))`` (the rate ``λ`` of the mixture path with a mask
    source, ``div_free = 0``)."""
    k, dk = kappa(t, power)
    if k >= 1.0:
        return 1.0
    return 1.0 - math.exp(-h * dk / (1.0 - k))


def dfm_jumps(masked: torch.Tensor, uniform: torch.Tensor, probability: float) -> torch.Tensor:
    """``[L]`` bool: masked positions whose draw ``uniform [L]`` falls below the jump
    ``probability`` (they take their sampled token)."""
    return masked & (uniform < probability)
