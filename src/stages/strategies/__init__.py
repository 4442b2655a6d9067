"""Decoding strategies (:class:`pipeline.contracts.strategy.Strategy`): the rule between calls.

Owns :class:`AutoregressiveStrategy` and :class:`SpeculativeStrategy` (its rejection rule in
``verify.py``, its proposers in ``proposers.py`` and ``draft.py``, its options in
``spec_options.py``); the masked-diffusion strategies live in :mod:`.diffusion`, the
continuous ones in :mod:`.continuous`, the selectors they call in :mod:`stages.select`.
"""

from stages.strategies.autoregressive import AutoregressiveStrategy
from stages.strategies.speculative import SpeculativeStrategy

__all__ = ["AutoregressiveStrategy", "SpeculativeStrategy"]
