"""Decoding strategies (:class:`pipeline.protocols.Strategy`): the update rule between calls.

Owns :class:`AutoregressiveStrategy` (``autoregressive.py``) and :class:`SpeculativeStrategy`
(``speculative.py``; its rejection rule in ``verify.py``, its proposers in ``proposers.py`` and
``draft.py``, its options in ``spec_options.py``); the masked-diffusion strategies ``llada``,
``fast_dllm`` and ``dfm`` live in :mod:`stages.strategies.diffusion`, the continuous strategies
``ddpm``, ``ddim`` and ``flow`` in :mod:`stages.strategies.continuous`. The selectors they call
live in :mod:`stages.select`.
"""

from stages.strategies.autoregressive import AutoregressiveStrategy
from stages.strategies.speculative import SpeculativeStrategy

__all__ = ["AutoregressiveStrategy", "SpeculativeStrategy"]
