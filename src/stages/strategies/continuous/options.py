"""The ``ddpm``, ``ddim`` and ``flow`` strategies' options and their registered factories.

Owns :class:`ContinuousOptions` and :func:`continuous_maker`. A continuous strategy needs a
model trained for it: its ``config.json`` carries ``"pipeline_generation": {"family":
"continuous_diffusion" | "flow", ...}`` with the defaults below and, for diffusion, the
``noise_schedule`` it was trained with (``beta_schedule``, ``num_train_timesteps``), and its
backend takes embedding inputs (:class:`~pipeline.contracts.model.EmbeddingInputs`). Options
(``build(model, strategy=NAME, strategy_options={...})``); unknown names and bad values are
errors that name the option:

- ``steps``: denoising steps per block (1..1000; the model's default, else 20); DDPM, DDIM and
  Euler make one model call per step, Heun two but the last;
- ``block_length``: positions per block (1..1024; the model's default, else 16);
- ``self_condition``: feed each call the previous x0 estimate (default: when the model
  was trained with it);
- ``rounding``: ``"logits"`` (argmax of the last call's logits, default) or ``"nearest"``
  (the token whose embedding is nearest the final state);
- ``spacing`` (``ddpm``, ``ddim``): ``"trailing"`` (default), ``"leading"`` or ``"linspace"``;
- ``eta`` (``ddim``): 0 (deterministic, default) .. 1 (DDPM-like noise);
- ``solver`` (``flow``): ``"euler"`` or ``"heun"`` (the model's default, else Euler).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from pipeline.errors import ArtifactError, InvalidValueError, UnknownFieldError
from pipeline.contracts.decode import LogitProcessor, Selector
from pipeline.contracts.model import EmbeddingInputs
from pipeline.model_paths import GENERATION_KEY, generation_marker
from pipeline.registry import BuildContext
from stages.strategies.continuous.integrators import DiffusionIntegrator, FlowIntegrator, Integrator
from stages.strategies.continuous.schedules import SPACINGS, NoiseSchedule
from stages.strategies.continuous.strategy import ROUNDINGS, ContinuousStrategy
from stages.strategies.continuous.updates import SOLVERS, uniform_grid

FAMILIES = {"ddpm": "continuous_diffusion", "ddim": "continuous_diffusion", "flow": "flow"}
"""The model family each strategy needs (``pipeline_generation.family``)."""
COMMON = ("steps", "block_length", "self_condition", "rounding")
KEYS = {"ddpm": (*COMMON, "spacing"), "ddim": (*COMMON, "spacing", "eta"),
        "flow": (*COMMON, "solver")}


def _int(name: str, key: str, value: Any, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise InvalidValueError(f"{name}.{key}", value, f"must be an integer in 1..{hi}")
    return value


def _choice(name: str, key: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidValueError(f"{name}.{key}", value, f"must be one of {', '.join(allowed)}")
    return str(value)


@attrs.frozen
class ContinuousOptions:
    """One continuous strategy's settled options (see the module docstring)."""

    name: str
    steps: int
    block_length: int
    self_condition: bool
    rounding: str = "logits"
    spacing: str = "trailing"
    eta: float = 0.0
    solver: str = "euler"

    @classmethod
    def settle(cls, name: str, given: Mapping[str, Any], marker: Mapping[str, Any],
               self_conditioned: bool) -> ContinuousOptions:
        """``given`` (the build's options) over ``marker`` (the model's defaults)."""
        for key in given:
            if key not in KEYS[name]:
                raise UnknownFieldError(f"{name} strategy_options", str(key), KEYS[name])
        merged = {k: marker[k] for k in KEYS[name] if k in marker}
        merged.update(given)
        sc = merged.get("self_condition", self_conditioned)
        if not isinstance(sc, bool):
            raise InvalidValueError(f"{name}.self_condition", sc, "must be true or false")
        if sc and not self_conditioned:
            raise InvalidValueError(f"{name}.self_condition", sc,
                                    "the model was not trained with self-conditioning")
        eta = merged.get("eta", 0.0)
        if not isinstance(eta, (int, float)) or isinstance(eta, bool) or not 0 <= eta <= 1:
            raise InvalidValueError(f"{name}.eta", eta, "must be a number in [0, 1]")
        return cls(name, _int(name, "steps", merged.get("steps", 20), 1000),
                   _int(name, "block_length", merged.get("block_length", 16), 1024), sc,
                   _choice(name, "rounding", merged.get("rounding", "logits"), ROUNDINGS),
                   _choice(name, "spacing", merged.get("spacing", "trailing"), SPACINGS),
                   float(eta), _choice(name, "solver", merged.get("solver", "euler"), SOLVERS))

    def described(self) -> dict[str, Any]:
        """The options this strategy takes, by name (for the trace's ``step.configured``)."""
        return {key: getattr(self, key) for key in KEYS[self.name]}

    def integrator(self, marker: Mapping[str, Any]) -> Integrator:
        """The sampler or solver these options and the model's schedule describe."""
        if self.name == "flow":
            return FlowIntegrator(uniform_grid(self.steps), self.solver)
        schedule = marker.get("noise_schedule")
        if not isinstance(schedule, Mapping):
            raise ArtifactError(f"the model's {GENERATION_KEY} has no noise_schedule: a "
                                "diffusion strategy must use the schedule the model was "
                                "trained with")
        made = NoiseSchedule.make(str(schedule.get("beta_schedule", "squaredcos_cap_v2")),
                                  int(schedule.get("num_train_timesteps", 1000)))
        if self.steps > made.num_train_timesteps:
            raise InvalidValueError(f"{self.name}.steps", self.steps,
                                    f"cannot exceed the {made.num_train_timesteps} timesteps "
                                    "the model was trained with")
        return DiffusionIntegrator(made, self.steps, self.name, self.spacing, self.eta)


def continuous_maker(name: str) -> Callable[[BuildContext], Any]:
    """The registered factory of strategy ``name`` (``ddpm``, ``ddim`` or ``flow``): checks
    the model and the options at build time; makes the strategy per processor order."""
    def factory(ctx: BuildContext) -> Callable[[Sequence[LogitProcessor], Selector],
                                               ContinuousStrategy]:
        marker = generation_marker(ctx.model_dir) or {}
        family = marker.get("family")
        backend = ctx.backend
        if backend is None:
            def refuse(processors: Sequence[LogitProcessor], selector: Selector
                       ) -> ContinuousStrategy:
                raise ArtifactError(f"the {name} strategy needs a model backend")
            return refuse
        if family != FAMILIES[name]:
            raise InvalidValueError("strategy", name, f"needs a model trained for it "
                                    f"({GENERATION_KEY}.family {FAMILIES[name]!r} in "
                                    f"config.json); this model's is {family!r}")
        if not isinstance(backend, EmbeddingInputs):
            raise InvalidValueError("strategy", name, "the backend takes no embedding inputs")
        options = ContinuousOptions.settle(name, ctx.strategy_options, marker,
                                           backend.self_conditioned)
        integrator = options.integrator(marker)

        def make(processors: Sequence[LogitProcessor], selector: Selector
                 ) -> ContinuousStrategy:
            return ContinuousStrategy(name, backend, integrator, options.block_length,
                                      self_condition=options.self_condition,
                                      rounding=options.rounding,
                                      max_context=backend.max_context,
                                      settings=options.described())

        return make

    return factory
