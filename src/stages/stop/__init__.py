"""Stoppers: decide when a request ends and hold back text that may belong to a stop string.

- ``eos`` (:class:`EosStopper`), ``max_tokens`` (:class:`MaxTokensStopper`), ``deadline``
  (:class:`DeadlineStopper`) judge the selected token;
- ``stop_strings`` (:class:`StopStringStopper`) matches ``config.stop`` on text across token
  boundaries;
- :class:`StopperChain` runs several as one; :func:`make_stopper` builds one by name;
  ``DEFAULT_STOPPERS`` (from :mod:`pipeline.registry`) names the default chain.

All satisfy :class:`pipeline.contracts.text.Stopper`.
"""

from pipeline.registry import DEFAULT_STOPPERS
from stages.stop.chain import STOPPERS, StopperChain, make_stopper
from stages.stop.strings import StopStringState, StopStringStopper, StopTable
from stages.stop.tokens import (
    DeadlineState, DeadlineStopper, EosState, EosStopper, MaxTokensStopper,
)

__all__ = [
    "DEFAULT_STOPPERS",
    "STOPPERS",
    "DeadlineState",
    "DeadlineStopper",
    "EosState",
    "EosStopper",
    "MaxTokensStopper",
    "StopStringState",
    "StopStringStopper",
    "StopTable",
    "StopperChain",
    "make_stopper",
]
