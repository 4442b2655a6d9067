"""The continuous strategies' math against closed-form oracles (issue 14).

DDIM and DDPM with the exact denoiser of Gaussian data (the closed-form posterior mean
E[x0 | x_t]) must carry N(0, I) to the known target N(mu, s^2); Euler and Heun on a linear
vector field must converge to exp(lambda) at orders 1 and 2 (error ratios ~2 and ~4 when the
steps double); rectified flow with the exact velocity of Gaussian data must reach the target
too, also when driven call by call through the strategies' integrators (Heun's two calls per
interval, Euler at the last); the counter-based noise is a pure function of its key.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from pipeline.errors import InvalidValueError
from stages.strategies.continuous.integrators import (
    BlockState, DiffusionIntegrator, FlowIntegrator, Integrator,
)
from stages.strategies.continuous.noise import gaussian
from stages.strategies.continuous.schedules import NoiseSchedule
from stages.strategies.continuous.updates import (
    ddim_step, ddpm_step, integrate, uniform_grid,
)

MU, S = 1.5, 0.5
N = 40_000


def posterior_mean(x_t: torch.Tensor, alpha_bar: float) -> torch.Tensor:
    """E[x0 | x_t] for x0 ~ N(MU, S^2), x_t = a x0 + b eps (a = sqrt(alpha_bar))."""
    a, b2 = math.sqrt(alpha_bar), 1 - alpha_bar
    return MU + a * S ** 2 / (alpha_bar * S ** 2 + b2) * (x_t - a * MU)


def sample(rule: str, steps: int, spacing: str = "trailing", eta: float = 0.0) -> torch.Tensor:
    schedule = NoiseSchedule.make("squaredcos_cap_v2", 1000)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, generator=gen, dtype=torch.float64)
    ts = schedule.timesteps(steps, spacing)
    for t, prev in zip(ts, (*ts[1:], -1)):
        a_t, a_prev = schedule.alpha_bar(t), schedule.alpha_bar(prev)
        x0 = posterior_mean(x, a_t)
        noise = torch.randn(N, generator=gen, dtype=torch.float64)
        if rule == "ddim":
            x = ddim_step(x, x0, a_t, a_prev, eta, noise)
        else:
            x = ddpm_step(x, x0, a_t, a_prev, noise)
    return x


@pytest.mark.parametrize("rule,eta", [("ddim", 0.0), ("ddim", 1.0), ("ddpm", 0.0)])
def test_samplers_recover_the_gaussian_target(rule: str, eta: float) -> None:
    x = sample(rule, 100, eta=eta)
    assert abs(float(x.mean()) - MU) < 0.02
    assert abs(float(x.std()) - S) < 0.02


def test_ddim_is_deterministic_at_eta_zero_and_converges_with_steps() -> None:
    a, b = sample("ddim", 10), sample("ddim", 10)
    assert torch.equal(a, b)
    assert abs(float(a.mean()) - MU) < 0.03       # the mean is exact at any step count
    gaps = [abs(float(sample("ddim", n).std()) - S) for n in (5, 10, 20, 40)]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < gaps[0] / 4


def test_last_step_returns_the_prediction() -> None:
    """At the last step (prev = -1, alpha_bar 1) both rules land on x0 itself."""
    x_t, x0 = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.allclose(ddim_step(x_t, x0, 0.3, 1.0), x0)
    assert torch.allclose(ddpm_step(x_t, x0, 0.3, 1.0), x0)


def test_timestep_spacings_follow_diffusers() -> None:
    s = NoiseSchedule.make("linear", 1000)
    assert s.timesteps(10, "trailing") == tuple(range(999, 0, -100))
    assert s.timesteps(10, "leading") == tuple(range(900, -1, -100))
    assert s.timesteps(4, "linspace") == (999, 666, 333, 0)
    assert s.alpha_bar(-1) == 1.0
    assert float(s.alphas_cumprod[0]) == pytest.approx(1 - 1e-4)
    with pytest.raises(InvalidValueError, match="steps"):
        s.timesteps(0)
    with pytest.raises(InvalidValueError, match="spacing"):
        s.timesteps(10, "middle")
    with pytest.raises(InvalidValueError, match="beta_schedule"):
        NoiseSchedule.make("sigmoid")


def test_cosine_schedule_matches_its_closed_form() -> None:
    s = NoiseSchedule.make("squaredcos_cap_v2", 1000)
    f = [math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2 for t in (0.0, 0.5)]
    assert s.alpha_bar(499) == pytest.approx(f[1] / f[0], rel=1e-9)


def ode_error(solver: str, steps: int, lam: float = -1.3) -> float:
    x = integrate(lambda x, t: lam * x, torch.ones(1, dtype=torch.float64),
                  uniform_grid(steps), solver)
    return abs(float(x[0]) - math.exp(lam))


@pytest.mark.parametrize("solver,order", [("euler", 1), ("heun", 2)])
def test_solvers_converge_at_their_order(solver: str, order: int) -> None:
    errors = [ode_error(solver, n) for n in (16, 32, 64, 128)]
    ratios = [a / b for a, b in zip(errors, errors[1:])]
    for r in ratios:
        assert r == pytest.approx(2 ** order, rel=0.08)


def test_time_dependent_field_keeps_heun_second_order() -> None:
    """dx/dt = t x: x(1) = exp(1/2); Heun must use the field at the interval's end."""
    def err(n: int) -> float:
        x = integrate(lambda x, t: t * x, torch.ones(1, dtype=torch.float64), uniform_grid(n),
                      "heun")
        return abs(float(x[0]) - math.exp(0.5))
    assert err(32) / err(64) == pytest.approx(4, rel=0.1)


def test_rectified_flow_with_exact_velocity_reaches_the_target() -> None:
    """x_t = (1-t) eps + t x1, x1 ~ N(MU, S^2): E[x1 | x_t] in closed form gives the exact
    marginal velocity; integrating it from noise must give N(MU, S^2)."""
    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        var = (1 - t) ** 2 + t ** 2 * S ** 2
        x1 = MU + t * S ** 2 / var * (x - t * MU)
        return (x1 - x) / (1 - t)

    x = torch.randn(N, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = integrate(velocity, x, uniform_grid(64, 0.0, 0.999), "heun")
    assert abs(float(out.mean()) - MU) < 0.02 and abs(float(out.std()) - S) < 0.02


def test_counter_noise_is_a_pure_function_of_its_key() -> None:
    a = gaussian(7, 0, 17, 3, (4, 5))
    assert torch.equal(a, gaussian(7, 0, 17, 3, (4, 5)))
    for other in ((8, 0, 17, 3), (7, 1, 17, 3), (7, 0, 18, 3), (7, 0, 17, 4)):
        assert not torch.equal(a, gaussian(*other, (4, 5)))
    big = gaussian(1, 0, 1, 0, (200_000,))
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1) < 0.01


def test_bad_arguments_are_named() -> None:
    x = torch.zeros(2)
    with pytest.raises(InvalidValueError, match="eta"):
        ddim_step(x, x, 0.5, 0.9, eta=-1)
    with pytest.raises(InvalidValueError, match="noise"):
        ddim_step(x, x, 0.5, 0.9, eta=0.5)
    with pytest.raises(InvalidValueError, match="noise"):
        ddpm_step(x, x, 0.5, 0.9)
    with pytest.raises(InvalidValueError, match="solver"):
        integrate(lambda x, t: x, x, uniform_grid(2), "rk4")


def drive(rule: Integrator, x: torch.Tensor, x0_of: Callable[[torch.Tensor, float], torch.Tensor],
          noise_seed: int = 0) -> torch.Tensor:
    """Run a block through ``rule`` with an analytic estimator in place of the model."""
    block = BlockState(1, 0, x.shape[0], x, x)
    gen = torch.Generator().manual_seed(noise_seed)
    for call in range(rule.calls):
        x0 = x0_of(block.probe, rule.time(call))
        noise = (torch.randn(x.shape, generator=gen, dtype=x.dtype)
                 if rule.needs_noise(call) else None)
        rule.after_call(block, call, x0, noise)
    return block.x


def flow_posterior(x: torch.Tensor, t: float) -> torch.Tensor:
    """E[x1 | x_t] on the path x_t = (1-t) eps + t x1, x1 ~ N(MU, S^2)."""
    var = (1 - t) ** 2 + t ** 2 * S ** 2
    return MU + t * S ** 2 / var * (x - t * MU)


@pytest.mark.parametrize("solver", ["euler", "heun"])
def test_flow_integrator_with_the_exact_estimate_reaches_the_target(solver: str) -> None:
    x = torch.randn(N, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = drive(FlowIntegrator(uniform_grid(32), solver), x, flow_posterior)
    tol = 0.03 if solver == "euler" else 0.02
    assert abs(float(out.mean()) - MU) < tol and abs(float(out.std()) - S) < tol


def test_flow_heun_is_more_accurate_than_euler_per_step() -> None:
    """Against a fine Heun integration of the same exact field, from the same noise."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reference = drive(FlowIntegrator(uniform_grid(512), "heun"), x, flow_posterior)
    euler = drive(FlowIntegrator(uniform_grid(8), "euler"), x, flow_posterior)
    heun = drive(FlowIntegrator(uniform_grid(8), "heun"), x, flow_posterior)
    assert float((heun - reference).abs().max()) < float((euler - reference).abs().max()) / 3


@pytest.mark.parametrize("sampler,eta", [("ddim", 0.0), ("ddim", 1.0), ("ddpm", 0.0)])
def test_diffusion_integrator_with_the_exact_estimate_reaches_the_target(sampler: str,
                                                                        eta: float) -> None:
    schedule = NoiseSchedule.make("squaredcos_cap_v2", 1000)
    rule = DiffusionIntegrator(schedule, 100, sampler, "trailing", eta)
    x = torch.randn(N, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = drive(rule, x, lambda x, time: posterior_mean(x, schedule.alpha_bar(round(time * 1000))))
    assert abs(float(out.mean()) - MU) < 0.02 and abs(float(out.std()) - S) < 0.02
