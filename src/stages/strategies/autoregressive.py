"""``autoregressive``: the one-token-per-step strategy (docs/design.md §6, §10).

Owns :class:`AutoregressiveStrategy` and its per-request loop state :class:`ARState`. Its
plan is "the pending token, logits at its position"; its update rule is
``selector(chain(logits))`` over the whole batch's ``[B, V]`` logits at once, then the
request's forced-token source (:class:`~pipeline.contracts.forcing.Forcing`) may override the
choice; it commits one token per sequence per step. The request's processor states (the penalties'
counts) ride in its loop state and advance with each committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Batch, LogitProcessor, Row, Scores, Selector
from pipeline.contracts.strategy import Honours, Plan, Update
from stages.process.chain import ProcessorChain


@attrs.define
class ARState:
    """One sequence's autoregressive loop state: the committed token the cache does not
    hold yet (None before the first update), the forced-token source, and the request's
    processor states (:meth:`ProcessorChain.start`)."""

    pending: int | None
    forcing: Forcing
    processors: dict[str, Any] = attrs.field(factory=dict)


class AutoregressiveStrategy:
    """Autoregressive decoding: process the logits, select one token per row.

    ``chain`` is a :class:`ProcessorChain` or the processors to build one from (in order).

    Example::

        ar = AutoregressiveStrategy(ProcessorChain(procs), SamplingSelector())
        state = ar.start(row, Forcing.none())
        update = ar.update([state], [row], [z1])[0]      # one committed token
        ar.plan(update.state)                            # Plan((y_1,), (0,))
    """

    name: str = "autoregressive"
    honours: Honours = Honours.ALL

    def __init__(self, chain: ProcessorChain | Sequence[LogitProcessor],
                 selector: Selector) -> None:
        self.chain = chain if isinstance(chain, ProcessorChain) else ProcessorChain(chain)
        self.selector = selector

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        return self.chain.order_for(row)

    def start(self, row: Row, forcing: Forcing) -> ARState:
        """Nothing pending yet: the first update takes the prompt's last logits."""
        return ARState(None, forcing, self.chain.start(row))

    def plan(self, state: ARState) -> Plan:
        """Feed the pending token; logits at its position."""
        if state.pending is None:
            raise ValueError("nothing to feed: the sequence has no committed token yet")
        return Plan((state.pending,), (0,))

    def update(self, states: Sequence[ARState], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> list[Update[ARState]]:
        """Select one token per sequence from its one logits row (``[1, V]`` each)."""
        z = torch.cat(list(logits)).float()                                   # [B, V]
        batch = Batch(tuple(row.with_states(s.processors) if s.processors else row
                            for s, row in zip(states, rows)), z.shape[1])
        choice = self.selector(self.chain(Scores(z), batch), batch)
        processed = None if choice.scores is None else choice.scores.to_dense(z.shape[1])
        out = []
        for i, (state, row) in enumerate(zip(states, rows)):
            draw = choice.draws[i] if choice.draws else None
            taken = state.forcing.take(row.step, choice.token_ids[i], choice.logprobs[i], draw)
            state.pending = taken.token_id
            self.chain.advance(state.processors, taken.token_id)
            out.append(Update(state, (taken,), 0,
                              None if processed is None else processed[i:i + 1]))
        return out

    def finish(self, state: ARState) -> None:
        """Let the processors' states go."""
        self.chain.finish(state.processors)
