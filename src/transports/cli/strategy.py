"""The strategy flags of ``pipeline run``, ``pipeline chat`` and ``pipeline serve``
(docs/design.md §10, §14).

Owns ``--strategy NAME``, ``--steps N``, ``--block-length N`` and the repeatable
``--strategy-option KEY=VALUE`` (VALUE is read as JSON when it parses as JSON, else taken as
a string: ``threshold=0.9`` is a number, ``solver=heun`` a string, ``self_condition=false`` a
boolean), their reading into a :class:`~pipeline.strategy_choice.StrategyChoice`, and the
wording of what is wrong with them: a bad value is one line naming the flag; an unknown
strategy lists the known ones and an unknown option says "did you mean". A strategy name is
checked against the registered strategies before any model loads; whether the strategy suits
the model and takes the options is ``build()``'s to say (:func:`build_with` rewords its
errors to name the flag).

``pipeline serve`` serves several models, so each flag takes an optional ``NAME:`` prefix:
without one a setting applies to every served model; with one (``--steps masked:4``,
``--strategy-option masked:threshold=0.9``) only to the model served as NAME, over the
settings without a prefix.

Example::

    pipeline run --model tiny-masked --strategy fast_dllm --steps 4 --block-length 8 \\
        --strategy-option threshold=0.8 "What is a list?"
    pipeline serve --model masked=tiny-masked --model flow=tiny-flow \\
        --strategy masked:fast_dllm --steps flow:8 --strategy-option flow:solver=heun
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import (
    InvalidValueError, PipelineError, UnknownFieldError, UnknownNameError, closest,
)
from pipeline.strategy_choice import RESERVED_OPTIONS, StrategyChoice

if TYPE_CHECKING:  # importing it imports torch: the command line loads that only when used
    from pipeline.pipe import Pipeline

_FLAGS = {"strategy": "--strategy", "steps": "--steps", "block_length": "--block-length"}
"""The flag of each ``build()`` argument that has one of its own."""
_OPTION = "--strategy-option"


def add_strategy(parser: Any, *, per_model: bool = False) -> None:
    """The four strategy flags; ``per_model`` (``pipeline serve``) allows a ``NAME:`` prefix."""
    group = parser.add_argument_group(
        "generation strategy (default: the model's own)",
        "autoregressive for an autoregressive model; an iterative model (masked diffusion, "
        "continuous diffusion, flow) names its default in its config.json"
        + ("; NAME:VALUE applies a setting to the model served as NAME only, over the "
           "settings given without a name" if per_model else ""))
    prefix = "[NAME:]" if per_model else ""
    group.add_argument("--strategy", action="append", default=None, metavar=f"{prefix}STRATEGY",
                       help="how tokens are generated: autoregressive, speculative, llada, "
                            "fast_dllm, dfm, ddpm, ddim, flow (pipeline plugins lists all)")
    group.add_argument("--steps", action="append", default=None, metavar=f"{prefix}N",
                       help="model calls per block of an iterative strategy")
    group.add_argument("--block-length", dest="block_length", action="append", default=None,
                       metavar=f"{prefix}N",
                       help="positions generated together per block of an iterative strategy")
    group.add_argument(_OPTION, dest="strategy_option", action="append", default=None,
                       metavar=f"{prefix}KEY=VALUE",
                       help="another setting of the strategy (repeatable; VALUE is JSON when "
                            "it parses, else a string), e.g. threshold=0.9, solver=heun")


def strategy_choice(args: argparse.Namespace) -> StrategyChoice:
    """The choice the flags of ``pipeline run`` or ``pipeline chat`` make."""
    return _choice([(_FLAGS[f], v) for f in _FLAGS for v in getattr(args, f) or ()]
                   + [(_OPTION, v) for v in args.strategy_option or ()])


def served_choices(args: argparse.Namespace, served: Iterable[str]
                   ) -> dict[str, StrategyChoice]:
    """Each served model's choice (``pipeline serve``): the settings given without a name,
    under those given for it; models with nothing chosen are left out."""
    names = list(served)
    scoped: dict[str | None, list[tuple[str, str]]] = {}
    for field, flag in _FLAGS.items():
        for value in getattr(args, field) or ():
            name, rest = _scope(flag, value, value, names)
            scoped.setdefault(name, []).append((flag, rest))
    for value in args.strategy_option or ():
        head, eq, tail = value.partition("=")
        name, key = _scope(_OPTION, value, head, names)
        scoped.setdefault(name, []).append((_OPTION, key + eq + tail))
    common = _choice(scoped.get(None, []))
    choices = {n: _choice(scoped.get(n, [])).over(common) for n in names}
    return {n: c for n, c in choices.items() if not c.empty}


def build_with(model: str | Path | None, choice: StrategyChoice, **kwargs: Any) -> Pipeline:
    """``build(model, **kwargs)`` with ``choice``'s strategy; an error about the strategy's
    settings names the flag that set them."""
    from pipeline.builder import build

    check_strategies([choice], registered_strategies())
    try:
        return build(model, **choice.build_args(), **kwargs)
    except PipelineError as exc:
        flagged = flag_error(exc, choice, choice.strategy or _model_strategy(model))
        if flagged is exc:
            raise
        raise flagged from exc


def flag_error(exc: PipelineError, choice: StrategyChoice,
               strategy: str | None = None) -> PipelineError:
    """``exc`` reworded to name the flag whose value it is about (``exc`` itself when it is
    about none of them); ``strategy`` is the one that ran (None: not known)."""
    if isinstance(exc, UnknownNameError) and exc.kind == "strategy":
        return _unknown_strategy(exc.name, exc.available)
    if isinstance(exc, UnknownFieldError) and exc.field in choice.options:
        hint = f" (did you mean {exc.suggestion!r}?)" if exc.suggestion else ""
        takes = [o for o in exc.allowed if o not in RESERVED_OPTIONS]
        which = repr(strategy) if strategy else "the strategy"
        return InvalidValueError(_OPTION, exc.field, f"{which} has no option {exc.field!r}"
                                 f"{hint}; its options: {', '.join(takes) or '(none)'}")
    if not isinstance(exc, InvalidValueError):
        return exc
    if exc.field == "strategy_options" and choice.options:
        return InvalidValueError(_OPTION, exc.value, _flag_words(exc.reason))
    keys = [part.strip().rpartition(".")[2] for part in exc.field.split(",")]
    given = choice.build_args()
    flags = [_FLAGS[k] if k in _FLAGS and given[k] is not None
             else f"{_OPTION} {k}" if k in choice.options else None for k in keys]
    if any(f is None for f in flags):
        return exc
    return InvalidValueError(", ".join(str(f) for f in flags), exc.value,
                             _flag_words(exc.reason))


def _flag_words(reason: str) -> str:
    """``build()``'s advice in the command line's words: ``strategy='llada'`` is
    ``--strategy llada``."""
    return re.sub(r"\bstrategy='([^']*)'", r"--strategy \1", reason)


def _model_strategy(model: str | Path | None) -> str | None:
    """The strategy ``build(model)`` picks without one (its marker's, else autoregressive);
    None when the model cannot be read (its own error says why)."""
    from pipeline.model_paths import generation_marker, resolve_model

    if model is None:
        return "autoregressive"
    try:
        marker = generation_marker(resolve_model(model).directory)
    except PipelineError:
        return None
    return str(marker.get("strategy")) if marker is not None else "autoregressive"


def check_strategies(choices: Iterable[StrategyChoice], known: Sequence[str]) -> None:
    """Every named strategy is registered (``known``), before any model loads."""
    for choice in choices:
        if choice.strategy is not None and choice.strategy not in known:
            raise _unknown_strategy(choice.strategy, known)


def registered_strategies() -> list[str]:
    """The names of the strategies the registry (built-ins and plugins) knows."""
    from pipeline.registry import Registry

    return Registry().names("strategy")


def _unknown_strategy(name: str, known: Iterable[str]) -> InvalidValueError:
    known = sorted(known)
    near = closest(name, known)
    hint = f" (did you mean {near!r}?)" if near else ""
    return InvalidValueError("--strategy", name, f"no such strategy{hint}; the known ones: "
                             f"{', '.join(known)}")


def _scope(flag: str, value: str, head: str, names: Sequence[str]) -> tuple[str | None, str]:
    """``NAME:REST`` → (NAME, REST) for a served NAME; no prefix → (None, head)."""
    name, colon, rest = head.rpartition(":")
    if not colon:
        return None, head
    if name not in names:
        raise InvalidValueError(flag, value, f"no served model is named {name!r} (served: "
                                f"{', '.join(names)}); write NAME:VALUE with a served name, "
                                "or the value alone for every model")
    return name, rest


def _choice(settings: Sequence[tuple[str, str]]) -> StrategyChoice:
    """A choice from (flag, text) pairs; a flag given twice (an option key twice) is refused."""
    fields: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for flag, text in settings:
        if flag == _OPTION:
            key, value = _option(text)
            if key in options:
                raise InvalidValueError(_OPTION, text, f"{key} is given twice")
            options[key] = value
            continue
        field = next(f for f, name in _FLAGS.items() if name == flag)
        value = text if field == "strategy" else _count(flag, text)
        if field in fields:
            raise InvalidValueError(flag, value, f"given twice (first {fields[field]})")
        fields[field] = value
    try:
        return StrategyChoice(**fields, options=options)
    except InvalidValueError as exc:  # the value checks its fields; say which flag it was
        raise InvalidValueError(_FLAGS[exc.field], exc.value, exc.reason) from None


def _count(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InvalidValueError(flag, text, "must be an integer >= 1") from None
    if value < 1:
        raise InvalidValueError(flag, value, "must be an integer >= 1")
    return value


def _option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` → (key, VALUE read as JSON, else the string)."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise InvalidValueError(_OPTION, text, "write KEY=VALUE, e.g. threshold=0.9")
    if key in RESERVED_OPTIONS:
        raise InvalidValueError(_OPTION, text, f"use {_FLAGS[key]} for {key}")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw
