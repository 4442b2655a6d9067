"""The update rules of Gaussian diffusion and of flow ODEs, as pure functions over tensors.

Owns the x0-parameterised DDPM ancestral step and DDIM step (diffusers' ``DDPMScheduler`` /
``DDIMScheduler`` ``step`` with ``prediction_type="sample"``, no clipping), and the Euler and
Heun steps of an ODE ``dx/dt = v(x, t)`` (diffusers' flow-match Euler and Heun schedulers,
``torchdiffeq``'s fixed-grid ``euler`` and ``heun``). No function draws randomness: a step
that needs noise takes it as an argument, so the caller decides where it comes from (the
strategies draw it counter-based, :mod:`.noise`). :func:`integrate` runs a whole ODE over a
time grid with these steps, for tests and for callers that own the vector field.

With x0 predicted, ε is implied: ε̂ = (x_t - √ᾱ_t x̂0) / √(1 - ᾱ_t).

- DDIM (Song et al., eq. 12): x_prev = √ᾱ_prev x̂0 + √(1 - ᾱ_prev - σ²) ε̂ + σ z, with
  σ = η √((1 - ᾱ_prev)/(1 - ᾱ_t) · (1 - ᾱ_t/ᾱ_prev)); η = 0 is deterministic.
- DDPM (Ho et al., eq. 7): the posterior mean c0 x̂0 + ct x_t with c0 = √ᾱ_prev β'_t/(1-ᾱ_t),
  ct = √α'_t (1 - ᾱ_prev)/(1 - ᾱ_t), α'_t = ᾱ_t/ᾱ_prev, β'_t = 1 - α'_t, plus √(β̃_t) z with
  the "fixed_small" variance β̃_t = (1 - ᾱ_prev)/(1 - ᾱ_t) β'_t, except at the last step.

Example::

    x = ddim_step(x, x0_hat, schedule.alpha_bar(t), schedule.alpha_bar(prev), eta=0.0)
    x = euler_step(x, v, h=0.05)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from pipeline.errors import InvalidValueError

SOLVERS = ("euler", "heun")

VectorField = Callable[[torch.Tensor, float], torch.Tensor]
"""``v(x, t)``: the velocity of an ODE at state ``x`` and time ``t``."""


def implied_noise(x_t: torch.Tensor, x0: torch.Tensor, alpha_bar_t: float) -> torch.Tensor:
    """ε̂ = (x_t - √ᾱ_t x0) / √(1 - ᾱ_t), the noise an x0 prediction implies."""
    return (x_t - math.sqrt(alpha_bar_t) * x0) / math.sqrt(1.0 - alpha_bar_t)


def ddim_step(x_t: torch.Tensor, x0: torch.Tensor, alpha_bar_t: float, alpha_bar_prev: float,
              eta: float = 0.0, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One DDIM step from ᾱ_t to ᾱ_prev (1.0 at the end) with predicted ``x0``.

    ``noise`` (standard normal, the shape of ``x_t``) is required when ``eta > 0``."""
    if eta < 0:
        raise InvalidValueError("eta", eta, "must be >= 0")
    eps = implied_noise(x_t, x0, alpha_bar_t)
    variance = (1 - alpha_bar_prev) / (1 - alpha_bar_t) * (1 - alpha_bar_t / alpha_bar_prev)
    std = eta * math.sqrt(max(variance, 0.0))
    direction = math.sqrt(max(1 - alpha_bar_prev - std ** 2, 0.0)) * eps
    x_prev = math.sqrt(alpha_bar_prev) * x0 + direction
    if std > 0:
        if noise is None:
            raise InvalidValueError("noise", None, "DDIM with eta > 0 needs noise")
        x_prev = x_prev + std * noise
    return x_prev


def ddpm_step(x_t: torch.Tensor, x0: torch.Tensor, alpha_bar_t: float, alpha_bar_prev: float,
              noise: torch.Tensor | None = None) -> torch.Tensor:
    """One ancestral DDPM step from ᾱ_t to ᾱ_prev with predicted ``x0``: the posterior mean,
    plus ``noise`` scaled by the fixed-small standard deviation unless this is the last
    step (ᾱ_prev = 1), where the variance is zero."""
    beta_prod_t, beta_prod_prev = 1 - alpha_bar_t, 1 - alpha_bar_prev
    current_alpha = alpha_bar_t / alpha_bar_prev
    current_beta = 1 - current_alpha
    c0 = math.sqrt(alpha_bar_prev) * current_beta / beta_prod_t
    ct = math.sqrt(current_alpha) * beta_prod_prev / beta_prod_t
    mean = c0 * x0 + ct * x_t
    if alpha_bar_prev >= 1.0:
        return mean
    if noise is None:
        raise InvalidValueError("noise", None, "a DDPM step before the last needs noise")
    variance = max(beta_prod_prev / beta_prod_t * current_beta, 1e-20)
    return mean + math.sqrt(variance) * noise


def euler_step(x: torch.Tensor, v: torch.Tensor, h: float) -> torch.Tensor:
    """x + h v: one explicit Euler step (first order)."""
    return x + h * v


def heun_step(x: torch.Tensor, v: torch.Tensor, v_predicted: torch.Tensor, h: float
              ) -> torch.Tensor:
    """x + h (v + v_predicted) / 2: Heun's corrector (second order), where ``v`` is the
    velocity at (x, t) and ``v_predicted`` at (x + h v, t + h), the Euler prediction."""
    return x + 0.5 * h * (v + v_predicted)


def uniform_grid(steps: int, start: float = 0.0, end: float = 1.0) -> tuple[float, ...]:
    """``steps + 1`` evenly spaced times from ``start`` to ``end`` inclusive."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise InvalidValueError("steps", steps, "must be an integer >= 1")
    return tuple(start + (end - start) * i / steps for i in range(steps + 1))


def integrate(field: VectorField, x: torch.Tensor, grid: Sequence[float],
              solver: str = "euler") -> torch.Tensor:
    """Integrate ``dx/dt = field(x, t)`` over ``grid`` with ``solver`` (:data:`SOLVERS`).

    Euler makes one evaluation per interval, Heun two (predict at the interval's end, then
    correct)."""
    if solver not in SOLVERS:
        raise InvalidValueError("solver", solver, f"must be one of {', '.join(SOLVERS)}")
    for t, t_next in zip(grid[:-1], grid[1:]):
        h = t_next - t
        v = field(x, t)
        if solver == "euler":
            x = euler_step(x, v, h)
        else:
            x = heun_step(x, v, field(euler_step(x, v, h), t_next), h)
    return x
