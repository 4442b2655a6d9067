"""Selectors and strategies: from processed scores to committed tokens.

Owns the ``greedy`` and ``sample`` selectors (both satisfy
:class:`pipeline.contracts.decode.Selector`), the counter-based :func:`uniform` draw, and the
strategies (:class:`pipeline.contracts.strategy.Strategy`): :class:`AutoregressiveStrategy` and
:class:`SpeculativeStrategy` (its rejection rule in ``verify.py``, its proposers in
``proposers.py`` and ``draft.py``, its options in ``spec_options.py``); the masked-diffusion
strategies ``llada``, ``fast_dllm`` and ``dfm`` live in :mod:`stages.select.diffusion`, the
continuous strategies ``ddpm``, ``ddim`` and ``flow`` in :mod:`stages.select.continuous`.
:data:`SELECTORS` maps names to classes.
"""

from collections.abc import Mapping
from types import MappingProxyType

from pipeline.contracts.decode import Selector
from stages.select.greedy import GreedySelector, argmax_columns
from stages.select.rng import uniform
from stages.select.sample import SamplingSelector, inverse_cdf
from stages.select.speculative import SpeculativeStrategy
from stages.select.strategy import AutoregressiveStrategy

SELECTORS: Mapping[str, type[Selector]] = MappingProxyType({
    GreedySelector.name: GreedySelector, SamplingSelector.name: SamplingSelector})
"""Built-in selector classes by name (read-only); each is built with no arguments."""

__all__ = [
    "SELECTORS", "AutoregressiveStrategy", "GreedySelector", "SamplingSelector",
    "SpeculativeStrategy",
    "argmax_columns", "inverse_cdf", "uniform",
]
