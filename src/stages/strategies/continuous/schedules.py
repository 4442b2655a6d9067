"""Noise schedules and timestep spacings of Gaussian diffusion (diffusers' formulas).

Owns :class:`NoiseSchedule`: the ``betas`` of ``num_train_timesteps`` training steps, their
``alphas_cumprod`` (ᾱ_t = Π_{s<=t} (1 - β_s)), and :meth:`NoiseSchedule.timesteps`, the
inference timesteps for a chosen number of steps. The beta kinds and spacings are those of
diffusers' ``DDPMScheduler`` / ``DDIMScheduler``:

- ``linear``: β linear from ``beta_start`` to ``beta_end``;
- ``scaled_linear``: √β linear (Stable Diffusion's);
- ``squaredcos_cap_v2``: the cosine schedule, ᾱ(t) = cos²((t + 0.008)/1.008 · π/2), each β
  capped at 0.999.

Spacings (``timestep_spacing``): ``linspace`` rounds ``linspace(0, T-1, n)``; ``leading``
takes multiples of ``T // n`` (diffusers' DDIM default, whose first step is not pure noise);
``trailing`` rounds ``arange(T, 0, -T/n) - 1`` and starts at t = T - 1. Everything is
float64 (diffusers computes in float32); a schedule is a value and holds no cursor, so one
schedule serves every request.

Example::

    s = NoiseSchedule.make("squaredcos_cap_v2", 1000)
    ts = s.timesteps(20, "trailing")        # (999, 949, ..., 49)
    a = s.alpha_bar(ts[0])                  # ᾱ at the first step (close to 0: pure noise)
"""

from __future__ import annotations

import math

import attrs
import torch

from pipeline.errors import InvalidValueError

BETA_KINDS = ("linear", "scaled_linear", "squaredcos_cap_v2")
SPACINGS = ("trailing", "leading", "linspace")


def _cosine_betas(steps: int, max_beta: float = 0.999) -> torch.Tensor:
    """diffusers' ``betas_for_alpha_bar`` with the cosine ᾱ (Nichol & Dhariwal)."""
    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return torch.tensor([min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), max_beta)
                         for i in range(steps)], dtype=torch.float64)


@attrs.frozen
class NoiseSchedule:
    """β_t and ᾱ_t of ``num_train_timesteps`` steps (``betas``/``alphas_cumprod`` ``[T]``)."""

    kind: str
    betas: torch.Tensor = attrs.field(eq=False, repr=False)
    alphas_cumprod: torch.Tensor = attrs.field(eq=False, repr=False)

    @classmethod
    def make(cls, kind: str = "squaredcos_cap_v2", num_train_timesteps: int = 1000,
             beta_start: float = 1e-4, beta_end: float = 0.02) -> NoiseSchedule:
        """The schedule of ``kind`` (one of :data:`BETA_KINDS`) over that many steps."""
        if kind not in BETA_KINDS:
            raise InvalidValueError("beta_schedule", kind,
                                    f"must be one of {', '.join(BETA_KINDS)}")
        if not isinstance(num_train_timesteps, int) or num_train_timesteps < 2:
            raise InvalidValueError("num_train_timesteps", num_train_timesteps,
                                    "must be an integer >= 2")
        if not 0 < beta_start < beta_end < 1:
            raise InvalidValueError("beta_end", beta_end,
                                    f"need 0 < beta_start ({beta_start}) < beta_end < 1")
        n = num_train_timesteps
        if kind == "linear":
            betas = torch.linspace(beta_start, beta_end, n, dtype=torch.float64)
        elif kind == "scaled_linear":
            betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, n, dtype=torch.float64) ** 2
        else:
            betas = _cosine_betas(n)
        return cls(kind, betas, torch.cumprod(1.0 - betas, 0))

    @property
    def num_train_timesteps(self) -> int:
        """T, the number of training timesteps."""
        return int(self.betas.shape[0])

    def alpha_bar(self, t: int) -> float:
        """ᾱ_t; 1.0 for t < 0 (the clean data, diffusers' ``set_alpha_to_one``)."""
        return 1.0 if t < 0 else float(self.alphas_cumprod[t])

    def timesteps(self, steps: int, spacing: str = "trailing") -> tuple[int, ...]:
        """``steps`` inference timesteps, descending, by ``spacing`` (:data:`SPACINGS`)."""
        t_max = self.num_train_timesteps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= t_max:
            raise InvalidValueError("steps", steps, f"must be an integer in 1..{t_max}")
        if spacing == "linspace":
            found = torch.linspace(0, t_max - 1, steps, dtype=torch.float64).round().flip(0)
        elif spacing == "leading":
            found = (torch.arange(steps, dtype=torch.float64) * (t_max // steps)).flip(0)
        elif spacing == "trailing":
            found = torch.arange(t_max, 0, -t_max / steps, dtype=torch.float64).round() - 1
        else:
            raise InvalidValueError("spacing", spacing, f"must be one of {', '.join(SPACINGS)}")
        return tuple(int(t) for t in found)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """x_t = √ᾱ_t x0 + √(1-ᾱ_t) ε (diffusers' ``add_noise``); ``t`` broadcasts over the
        leading dims of ``x0 [..., d]`` (e.g. ``t [B, 1]`` for ``x0 [B, L, d]``)."""
        a = self.alphas_cumprod.to(x0.device)[t].to(x0.dtype)[..., None]
        return a.sqrt() * x0 + (1 - a).sqrt() * noise
