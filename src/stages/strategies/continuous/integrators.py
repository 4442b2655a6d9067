"""How a block's state moves after each model call: diffusion samplers and flow solvers.

Owns :class:`BlockState` (one block's trajectory: the current point ``x``, what the next call
feeds, the latest x0 estimate) and the two :class:`Integrator` kinds a continuous strategy
drives, one model call at a time:

- :class:`DiffusionIntegrator`: ``steps`` timesteps of a :class:`NoiseSchedule`; after the
  call at t the DDPM or DDIM rule (:mod:`.updates`) moves x_t to x_prev with the model's x0
  estimate; the call's time value is t / T. The last step (ᾱ_prev = 1) lands on x0.
- :class:`FlowIntegrator`: rectified flow from noise (t = 0) to data (t = 1) on a uniform grid
  of ``steps`` intervals, velocity v = (x̂1 - x_t) / (1 - t) from the model's estimate.
  Euler makes one call per interval; Heun two (predict, then correct at the interval's end),
  except the last interval, whose end t = 1 has no velocity (the estimate is the
  destination): there it takes the Euler step, as Karras et al.'s Heun sampler does at
  σ = 0. Either way the last step lands on the estimate.

Example::

    rule = FlowIntegrator(uniform_grid(8), "heun")
    for call in range(rule.calls):
        x0_hat = model(block.probe, rule.time(call))
        rule.after_call(block, call, x0_hat, None)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from pipeline.errors import InvalidValueError
from stages.strategies.continuous.schedules import NoiseSchedule
from stages.strategies.continuous.updates import (
    SOLVERS, ddim_step, ddpm_step, euler_step, heun_step,
)

SAMPLERS = ("ddpm", "ddim")


@attrs.define
class BlockState:
    """One block's trajectory. ``step`` is the index of the block's first token, ``index``
    the block's number, ``length`` its positions; ``x [L, d]`` is the current point,
    ``probe`` what the next call feeds (``x`` but for Heun's corrector), ``x0`` the latest
    estimate (self-conditioning; None before the first call), ``velocity`` Heun's first
    stage, ``call`` the model calls done, ``tokens`` the rounded block once final."""

    step: int
    index: int
    length: int
    x: torch.Tensor
    probe: torch.Tensor
    x0: torch.Tensor | None = None
    velocity: torch.Tensor | None = None
    call: int = 0
    tokens: tuple[int, ...] | None = None


class Integrator(Protocol):
    """Moves a :class:`BlockState` after each of ``calls`` model calls per block.

    ``time(call)`` is the time value call number ``call`` (0-based) is made at;
    ``needs_noise(call)`` whether its update adds Gaussian noise (the caller draws it);
    ``after_call`` updates ``block.x``/``probe``/``velocity`` from the call's x0 estimate
    ``[L, d]``. Pure given its inputs; one integrator serves every request."""

    name: str
    calls: int

    def time(self, call: int) -> float:
        """The time value of call ``call``."""
        ...

    def needs_noise(self, call: int) -> bool:
        """Whether the update after call ``call`` draws noise."""
        ...

    def after_call(self, block: BlockState, call: int, x0: torch.Tensor,
                   noise: torch.Tensor | None) -> None:
        """Move the block after call ``call`` returned the estimate ``x0``."""
        ...


class DiffusionIntegrator:
    """DDPM (ancestral) or DDIM (``eta``) over ``steps`` timesteps of ``schedule``."""

    def __init__(self, schedule: NoiseSchedule, steps: int, sampler: str = "ddim",
                 spacing: str = "trailing", eta: float = 0.0) -> None:
        if sampler not in SAMPLERS:
            raise InvalidValueError("sampler", sampler, f"must be one of {', '.join(SAMPLERS)}")
        if not isinstance(eta, (int, float)) or isinstance(eta, bool) or not 0 <= eta <= 1:
            raise InvalidValueError("ddim.eta", eta, "must be a number in [0, 1]")
        self.name = sampler
        self.schedule = schedule
        self.timesteps = schedule.timesteps(steps, spacing)
        self.eta = float(eta)
        self.calls = len(self.timesteps)

    def _prev(self, call: int) -> int:
        return self.timesteps[call + 1] if call + 1 < self.calls else -1

    def time(self, call: int) -> float:
        """t / T of the call's timestep."""
        return self.timesteps[call] / self.schedule.num_train_timesteps

    def needs_noise(self, call: int) -> bool:
        """DDPM before its last step; DDIM only with eta > 0 (and not at the last step)."""
        last = self._prev(call) < 0
        return not last and (self.name == "ddpm" or self.eta > 0)

    def after_call(self, block: BlockState, call: int, x0: torch.Tensor,
                   noise: torch.Tensor | None) -> None:
        """x_t → x_prev by the sampler's rule."""
        a_t = self.schedule.alpha_bar(self.timesteps[call])
        a_prev = self.schedule.alpha_bar(self._prev(call))
        if self.name == "ddpm":
            block.x = ddpm_step(block.x, x0, a_t, a_prev, noise)
        else:
            block.x = ddim_step(block.x, x0, a_t, a_prev, self.eta, noise)
        block.probe = block.x


class FlowIntegrator:
    """Euler or Heun over the time ``grid`` (ascending, from 0 to 1)."""

    def __init__(self, grid: Sequence[float], solver: str = "euler") -> None:
        if solver not in SOLVERS:
            raise InvalidValueError("flow.solver", solver, f"must be one of {', '.join(SOLVERS)}")
        self.name = solver
        self.grid = tuple(grid)
        intervals = len(self.grid) - 1
        self.calls = intervals if solver == "euler" else 2 * intervals - 1

    def _where(self, call: int) -> tuple[int, int]:
        """(interval, stage) of a call: stage 1 is Heun's corrector evaluation."""
        return (call, 0) if self.name == "euler" else divmod(call, 2)

    def time(self, call: int) -> float:
        """The grid time the call evaluates the velocity at."""
        interval, stage = self._where(call)
        return self.grid[interval + stage]

    def needs_noise(self, call: int) -> bool:
        """Never: the ODE is deterministic given its starting noise."""
        return False

    def after_call(self, block: BlockState, call: int, x0: torch.Tensor,
                   noise: torch.Tensor | None) -> None:
        """Euler; or Heun's predictor (stage 0) and corrector (stage 1)."""
        interval, stage = self._where(call)
        t, t_next = self.grid[interval], self.grid[interval + 1]
        h = t_next - t
        v = (x0 - block.probe) / (1.0 - self.time(call))
        last = interval == len(self.grid) - 2
        if stage == 0 and (self.name == "euler" or last):
            block.x = euler_step(block.x, v, h)
            block.probe = block.x
        elif stage == 0:
            block.velocity = v
            block.probe = euler_step(block.x, v, h)
        else:
            assert block.velocity is not None
            block.x = heun_step(block.x, block.velocity, v, h)
            block.probe, block.velocity = block.x, None
