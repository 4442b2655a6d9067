"""Selectors and the autoregressive strategy: from processed scores to committed tokens.

Owns the ``greedy`` and ``sample`` selectors (both satisfy
:class:`pipeline.protocols.Selector`), the counter-based :func:`uniform` draw, and
:class:`AutoregressiveStrategy` (a :class:`pipeline.protocols.Strategy`). :data:`SELECTORS`
maps names to classes.
"""

from collections.abc import Mapping
from types import MappingProxyType

from pipeline.protocols import Selector
from stages.select.greedy import GreedySelector, argmax_columns
from stages.select.rng import uniform
from stages.select.sample import SamplingSelector, inverse_cdf
from stages.select.strategy import AutoregressiveStrategy

SELECTORS: Mapping[str, type[Selector]] = MappingProxyType({
    GreedySelector.name: GreedySelector, SamplingSelector.name: SamplingSelector})
"""Built-in selector classes by name (read-only); each is built with no arguments."""

__all__ = [
    "SELECTORS", "AutoregressiveStrategy", "GreedySelector", "SamplingSelector",
    "argmax_columns", "inverse_cdf", "uniform",
]
