"""Stoppers: decide when a request ends and hold back text that may belong to a stop string.

- ``eos`` (:class:`EosStopper`), ``max_tokens`` (:class:`MaxTokensStopper`), ``deadline``
  (:class:`DeadlineStopper`) judge the selected token;
- ``stop_strings`` (:class:`StopStringStopper`) matches ``config.stop`` on text across token
  boundaries;
- :class:`StopperChain` runs several as one; :func:`make_stopper` builds one by name.

All satisfy :class:`pipeline.contracts.text.Stopper`.
"""

from stages.stop.chain import DEFAULT_STOPPERS, STOPPERS, StopperChain, make_stopper
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
