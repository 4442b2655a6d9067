"""Selectors: from processed scores to one token per row.

Owns the ``greedy`` and ``sample`` selectors (both satisfy
:class:`pipeline.contracts.decode.Selector`), their log-probabilities (``logprobs.py``) and the
counter-based :func:`uniform` draw (``rng.py``). :data:`SELECTORS` maps names to classes. The
strategies that call a selector live in :mod:`stages.strategies`.
"""

from collections.abc import Mapping
from types import MappingProxyType

from pipeline.contracts.decode import Selector
from stages.select.greedy import GreedySelector, argmax_columns
from stages.select.rng import uniform
from stages.select.sample import SamplingSelector, inverse_cdf

SELECTORS: Mapping[str, type[Selector]] = MappingProxyType({
    GreedySelector.name: GreedySelector, SamplingSelector.name: SamplingSelector})
"""Built-in selector classes by name (read-only); each is built with no arguments."""

__all__ = ["SELECTORS", "GreedySelector", "SamplingSelector", "argmax_columns", "inverse_cdf",
           "uniform"]
