"""``autoregressive``: the one-token-per-step strategy (DESIGN §10).

Owns :class:`AutoregressiveStrategy`: the update rule ``selector(chain(logits))`` that turns
one model call's ``[B, V]`` logits into one committed token per row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.protocols import Batch, LogitProcessor, Row, Scores, Selection, Selector
from stages.process.chain import ProcessorChain


class AutoregressiveStrategy:
    """Autoregressive decoding: process the logits, select one token per row.

    ``chain`` is a :class:`ProcessorChain` or the processors to build one from (in order).

    Example::

        ar = AutoregressiveStrategy(ProcessorChain(procs), SamplingSelector())
        step = ar.update(logits, batch)          # logits [B, V]
        step.token_ids                           # one per row
    """

    name: str = "autoregressive"
    block_size: int = 1

    def __init__(self, chain: ProcessorChain | Sequence[LogitProcessor],
                 selector: Selector) -> None:
        self.chain = chain if isinstance(chain, ProcessorChain) else ProcessorChain(chain)
        self.selector = selector

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        return self.chain.order_for(row)

    def update(self, logits: torch.Tensor, batch: Batch) -> Selection:
        """Select from ``logits [B, V]`` (float32; processors may modify it in place)."""
        return self.selector(self.chain(Scores(logits), batch), batch)
