"""Which generation strategy a model is built with, and its settings, as one value.

Owns :class:`StrategyChoice`: what ``build()`` takes as ``strategy=``, ``steps=``,
``block_length=`` and ``strategy_options=`` (docs/design.md §10), for the callers that carry that
choice around before building: ``pipeline run``, ``pipeline chat`` and ``pipeline serve``
(whose :class:`~transports.http.server.config.ServerConfig` holds one per served model). The value
checks only what it can know alone (counts are integers >= 1, option names are strings);
whether the strategy exists and takes those options is ``build()``'s to say.

Example::

    choice = StrategyChoice("fast_dllm", steps=4, block_length=8, options={"threshold": 0.9})
    build("tiny-masked", **choice.build_args())
    StrategyChoice(steps=2).over(choice)    # fast_dllm, 2 steps, block_length 8, threshold
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs

from pipeline.errors import InvalidValueError

RESERVED_OPTIONS = ("steps", "block_length")
"""Settings with fields of their own: never among :attr:`StrategyChoice.options`."""


def _count(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidValueError(attribute.name, value, "must be an integer >= 1")


def _name(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidValueError(attribute.name, value, "must be a strategy's name")


def _options(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidValueError("options", value, "must be a mapping of option names to values")
    for key in value:
        if not isinstance(key, str) or not key:
            raise InvalidValueError("options", key, "option names are non-empty strings")
        if key in RESERVED_OPTIONS:
            raise InvalidValueError("options", key, f"{key} is a field of its own, not an "
                                    "option")
    return MappingProxyType(dict(value))


@attrs.frozen
class StrategyChoice:
    """A strategy's name (``None``: the model's own, from its ``pipeline_generation``
    marker, else ``autoregressive``), its ``steps`` and ``block_length`` (``None``: the
    strategy's or the model's defaults) and its other ``options`` (e.g. ``threshold``)."""

    strategy: str | None = attrs.field(default=None, validator=_name)
    steps: int | None = attrs.field(default=None, validator=_count)
    block_length: int | None = attrs.field(default=None, validator=_count)
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options)

    @property
    def empty(self) -> bool:
        """True when nothing is chosen: ``build()`` decides everything."""
        return self.strategy is None and self.settings() == "" and not self.options

    def build_args(self) -> dict[str, Any]:
        """The keyword arguments of ``build()`` this choice sets."""
        return {"strategy": self.strategy, "steps": self.steps,
                "block_length": self.block_length,
                "strategy_options": dict(self.options) or None}

    def over(self, base: StrategyChoice) -> StrategyChoice:
        """This choice where it says something, else ``base``'s; options merge key by key
        (this choice's value wins)."""
        return StrategyChoice(
            self.strategy if self.strategy is not None else base.strategy,
            self.steps if self.steps is not None else base.steps,
            self.block_length if self.block_length is not None else base.block_length,
            {**base.options, **self.options})

    def settings(self) -> str:
        """What was set besides the name, for a log line: ``steps=4 block_length=8
        threshold=0.9`` (empty when nothing was)."""
        pairs = [("steps", self.steps), ("block_length", self.block_length),
                 *sorted(self.options.items())]
        return " ".join(f"{k}={_show(v)}" for k, v in pairs if v is not None)


def _show(value: Any) -> str:
    """A setting as it was written on a command line (JSON for anything but a string)."""
    return value if isinstance(value, str) else json.dumps(value)
