"""How ``build()`` makes a masked-diffusion strategy: options, model marker, checks.

Owns :func:`diffusion_maker` (the registered factories of ``llada``, ``fast_dllm`` and
``dfm``) and :data:`OPTIONS`. A strategy's settings come, each key from the first that has
it, from ``build(strategy_options=...)`` (where ``build``'s ``steps`` and ``block_length``
land too), then the model's ``pipeline_generation`` marker in ``config.json``, then
:class:`~stages.strategies.diffusion.strategy.DiffusionSettings`' defaults. A model that is not
a masked-diffusion model is refused, as is an option the sampler does not take (with the
closest known name). A backend given as an instance has no marker: ``mask_token_id`` must
then be among the options. Options of LLaDA's ``generate`` that are not implemented here
(:data:`NOT_IMPLEMENTED`: ``cfg_scale``, ``confidence_eos_eot_inf``) are refused by name,
saying why. The marker itself (its ``attention`` among them) is checked by
:func:`pipeline.model_paths.generation_marker`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.model_paths import GENERATION_KEY, generation_marker
from pipeline.contracts.decode import LogitProcessor, Selector
from pipeline.registry import BuildContext
from stages.strategies.diffusion.strategy import (
    DiffusionSettings, DiscreteFlowStrategy, FastDllmStrategy, LladaStrategy,
    MaskedDiffusionStrategy,
)

FAMILY = "masked_diffusion"
"""The ``pipeline_generation.family`` these samplers run."""
COMMON = ("steps", "block_length", "mask_token_id")
OPTIONS: Mapping[str, tuple[type[MaskedDiffusionStrategy], tuple[str, ...]]] = {
    "llada": (LladaStrategy, (*COMMON, "remasking", "logits_eos_inf")),
    "fast_dllm": (FastDllmStrategy, (*COMMON, "threshold")),
    "dfm": (DiscreteFlowStrategy, (*COMMON, "kappa_power")),
}
"""Each sampler's class and the options it takes."""
NOT_IMPLEMENTED: Mapping[str, str] = {
    "cfg_scale": "LLaDA's classifier-free guidance is not implemented here: it needs a "
                 "second, un-prompted forward of every pass (the canvas with the prompt "
                 "masked, so a second cache of its own), which the block loop does not run",
    "confidence_eos_eot_inf": "LLaDA's option is not implemented here: its published code "
                              "only lowers the end-of-turn token's confidence (a chained "
                              "assignment), not what its name says; to keep end of sequence "
                              "out of a block use logits_eos_inf, or ban the ids "
                              "(banned_token_ids)",
}
"""Options of the reference samplers that are refused by name, with the reason."""
_MARKER_KEYS = ("steps", "block_length", "mask_token_id")
_TYPES: Mapping[str, tuple[type, ...]] = {
    "steps": (int,), "block_length": (int,), "mask_token_id": (int,), "remasking": (str,),
    "threshold": (int, float), "kappa_power": (int, float), "logits_eos_inf": (bool,)}

Maker = Callable[[Sequence[LogitProcessor], Selector], MaskedDiffusionStrategy]


def diffusion_maker(name: str) -> Callable[[BuildContext], Maker]:
    """The registry factory of sampler ``name`` (one of :data:`OPTIONS`)."""
    cls, allowed = OPTIONS[name]

    def factory(ctx: BuildContext) -> Maker:
        settings = diffusion_settings(name, allowed, ctx)

        def make(processors: Sequence[LogitProcessor], selector: Selector
                 ) -> MaskedDiffusionStrategy:
            return cls(processors, settings)

        return make

    return factory


def diffusion_settings(name: str, allowed: Sequence[str], ctx: BuildContext
                       ) -> DiffusionSettings:
    """The sampler's settings from the options, the model's marker and the defaults."""
    options = dict(ctx.strategy_options)
    for key in options:
        if key in NOT_IMPLEMENTED:
            raise InvalidValueError(f"strategy_options.{key}", options[key],
                                    NOT_IMPLEMENTED[key])
        if key not in allowed:
            raise UnknownFieldError(f"strategy_options of {name!r}", key, allowed)
    for key, value in options.items():
        if value is None:
            continue
        if (type(value) is bool) != (_TYPES[key] == (bool,)) or \
                not isinstance(value, _TYPES[key]):
            raise InvalidValueError(key, value, f"must be {_TYPES[key][0].__name__}")
    marker = generation_marker(ctx.model_dir)
    if marker is not None and marker.get("family") != FAMILY:
        raise InvalidValueError("strategy", name, f"is a masked-diffusion sampler; this model "
                                f"is a {marker.get('family')!r} model ({GENERATION_KEY} in "
                                "its config.json)")
    if ctx.model_file is not None:
        raise InvalidValueError("strategy", name, "is a masked-diffusion sampler; a GGUF file "
                                "holds an autoregressive model (use strategy='autoregressive')")
    if marker is None and ctx.model_dir is not None:
        raise InvalidValueError("strategy", name, "is a masked-diffusion sampler; this model "
                                f"has no {GENERATION_KEY} marker in its config.json, so it is "
                                "autoregressive (use strategy='autoregressive')")
    merged: dict[str, Any] = {k: marker[k] for k in _MARKER_KEYS
                              if marker is not None and k in marker}
    merged.update({k: v for k, v in options.items() if v is not None})
    if "mask_token_id" not in merged:
        raise InvalidValueError("strategy_options", dict(options), f"{name!r} needs "
                                "mask_token_id (a model folder's marker supplies it)")
    mask = merged["mask_token_id"]  # a token of the backend's vocabulary
    vocab = ctx.backend.vocab_size if ctx.backend is not None else None
    if mask < 0 or (vocab is not None and mask >= vocab):
        raise InvalidValueError("mask_token_id", mask, f"must be a token id below the "
                                f"model's vocabulary of {vocab}")
    given = {k for k, v in options.items() if v is not None}
    if "block_length" in given and "steps" not in given:  # the marker's steps, if they fit
        merged["steps"] = min(merged.get("steps", merged["block_length"]),
                              merged["block_length"])
    if "steps" in merged and "block_length" not in merged:
        merged["block_length"] = max(merged["steps"], DiffusionSettings.block_length)
    if "block_length" in merged and "steps" not in merged:
        merged["steps"] = merged["block_length"]  # one token per pass
    max_context = ctx.backend.max_context if ctx.backend is not None else None
    return DiffusionSettings(max_context=max_context, **merged)
