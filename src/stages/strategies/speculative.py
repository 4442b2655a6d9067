"""``speculative``: draft k tokens, verify them in one forward, commit the accepted ones.

Owns :class:`SpeculativeStrategy` and its per-request loop state :class:`SpecState`. Each
step a sequence plans ``(y_t, d_1..d_k)`` with logits wanted at every position
(``outputs = range(k + 1)``); the model's rows are z_{t+1} .. z_{t+k+1}, position j
conditioned on the committed tokens and the drafts before it. The update rule, over every
position of every sequence of the batch at once:

1. the processor chain runs on each position with that position's own :class:`Row`
   (committed tokens + the drafts before it, ``step`` advanced), so penalties and
   ``min_tokens`` see the history they would see in plain decoding;
2. the selector picks at every position; :func:`~stages.strategies.verify.verify` accepts a
   draft where the selector's pick equals it (greedy rows) or by the rejection rule
   (sampled rows), and puts a corrected token at the first rejected position; the last
   position, past every draft, takes the selector's pick (the bonus token);
3. walking the positions in order, the request's forced-token source may override each
   token (a forced token that differs from the draft ends the block); the committed tokens
   are the accepted drafts plus one, and ``rollback`` drops the rejected drafts' positions.

The engine commits the tokens one by one through the text stages, so a stop (EOS, a stop
string, ``max_tokens``) inside a block ends the request there and nothing after it is
emitted. Drafts come from a :class:`~stages.strategies.proposers.Proposer` (n-gram lookup or a
draft model), or from the forced prefix while one remains. The trace gets ``spec.drafted``
(``step`` of the first draft, ``proposed``, the draft ``ids``) before the verifying forward's
``decode.completed``, and ``spec.verified`` (``accepted``, ``rejected``) before the block's
first ``token.selected``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from pipeline.errors import InvalidValueError
from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Batch, LogitProcessor, Row, Scores, Selector, with_tokens
from pipeline.contracts.strategy import Honours, Plan, StrategyEvent, Taken, Update
from pipeline.contracts.output import TokenLogprob
from pipeline.room import room
from stages.process.chain import ProcessorChain
from stages.select.logprobs import selection_logprobs
from stages.strategies.proposers import Proposal, Proposer
from stages.strategies.verify import Block, Position, verify

MAX_DRAFT_TOKENS = 64
"""The most drafts one step may verify."""
DEFAULT_DRAFT_TOKENS = 8
"""k, the most drafts one step verifies, when nothing says otherwise (the one default of
``num_draft_tokens``, which :class:`~stages.strategies.spec_options.SpecOptions` uses too)."""


@attrs.define
class SpecState:
    """One sequence's loop state: the committed token the cache does not hold yet (None
    before the first update), the drafts to feed after it, the forced-token source, the
    proposer's own state, and what the trace says about the drafts."""

    pending: int | None
    forcing: Forcing
    proposer: Any
    block: Block = attrs.field(factory=lambda: Block(()))
    drafted: dict[str, Any] | None = None
    processors: dict[str, Any] = attrs.field(factory=dict)
    """The request's processor states (they cover its committed tokens; a verified
    position's row adds its drafts)."""


class SpeculativeStrategy:
    """Speculative decoding with a :class:`Proposer`, at most ``num_draft_tokens`` per step.

    ``chain`` is a :class:`ProcessorChain` or the processors to build one from (in order).
    ``max_context`` (the target backend's window) keeps a block inside the cache. A sampling
    selector must draw from the softmax of the processed scores (as ``sample`` does): the
    rejection rule needs that distribution.

    Example::

        spec = SpeculativeStrategy(chain, SamplingSelector(), NgramProposer(), 4)
        state = spec.start(row, Forcing.none())
        update = spec.update([state], [row], [z1])[0]      # y_1, then drafts are proposed
        spec.plan(update.state)                            # Plan((y_1, d_1..d_k), range(k+1))
    """

    name: str = "speculative"
    honours: Honours = Honours.ALL

    def __init__(self, chain: ProcessorChain | Sequence[LogitProcessor], selector: Selector,
                 proposer: Proposer, num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
                 max_context: int | None = None) -> None:
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidValueError("num_draft_tokens", num_draft_tokens,
                                    f"must be in 1..{MAX_DRAFT_TOKENS}")
        self.chain = chain if isinstance(chain, ProcessorChain) else ProcessorChain(chain)
        self.selector = selector
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        self.max_context = max_context

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        return self.chain.order_for(row)

    def start(self, row: Row, forcing: Forcing) -> SpecState:
        """Nothing pending yet: the first update takes the prompt's last logits."""
        return SpecState(None, forcing, self.proposer.start(row),
                         processors=self.chain.start(row))

    def plan(self, state: SpecState) -> Plan:
        """Feed the pending token and the drafts; logits at every one of them."""
        if state.pending is None:
            raise ValueError("nothing to feed: the sequence has no committed token yet")
        ids = (state.pending, *state.block.drafts)
        events: tuple[StrategyEvent, ...] = ()
        if state.drafted is not None:
            events = (("spec.drafted", state.drafted),)
        return Plan(ids, tuple(range(len(ids))), events=events)

    def finish(self, state: SpecState) -> None:
        """Release what the proposer holds for the sequence (a draft model's slot) and the
        processors' states."""
        self.proposer.finish(state.proposer)
        self.chain.finish(state.processors)

    def update(self, states: Sequence[SpecState], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> list[Update[SpecState]]:
        """Verify each sequence's drafts (``[k + 1, V]`` logits each), commit the accepted
        ones plus one token, and propose the next drafts."""
        blocks = [s.block for s in states]
        for block, z in zip(blocks, logits):
            if z.shape[0] != len(block.drafts) + 1:
                raise ValueError(f"{z.shape[0]} logits rows for a block of "
                                 f"{len(block.drafts)} drafts")
        rows = [row.with_states(s.processors) if s.processors else row
                for s, row in zip(states, rows)]
        positions = [_position(row, block, j) for row, block in zip(rows, blocks)
                     for j in range(len(block.drafts) + 1)]
        z = torch.cat(list(logits)).float()                                   # [N, V]
        batch = Batch(tuple(positions), z.shape[1])
        processed = self.chain(Scores(z), batch)
        choice = self.selector(processed, batch)
        dense = (choice.scores or processed).to_dense(z.shape[1])             # [N, V]
        verdicts = verify(dense, choice, positions, blocks)
        committed, at = [], 0
        for state, row, block, verdict in zip(states, rows, blocks, verdicts):
            committed.append((at, self._commit(state, row, block, verdict)))
            at += len(block.drafts) + 1
        logprobs = self._logprobs(dense, positions, committed)
        return self._next(states, rows, committed, logprobs, dense)

    def _commit(self, state: SpecState, row: Row, block: Block, verdict: list[Position]
                ) -> list[Taken]:
        """Walk the block's positions: each token as the rule put it, unless forced; stop
        after the first one that is not the draft (or after the bonus position)."""
        taken = []
        for j, position in enumerate(verdict):
            taken.append(state.forcing.take(row.step + j, position.token, None, position.draw))
            self.chain.advance(state.processors, taken[-1].token_id)
            if j == len(block.drafts) or taken[-1].token_id != block.drafts[j]:
                break
        return taken

    def _logprobs(self, dense: torch.Tensor, positions: Sequence[Row],
                  committed: list[tuple[int, list[Taken]]]) -> dict[int, TokenLogprob]:
        """Log-probabilities under the processed distributions of the committed tokens, for
        rows that ask (a forced token is a point mass: 0)."""
        wanted = [(at + j, taken.token_id) for at, block in committed
                  for j, taken in enumerate(block)
                  if positions[at + j].config.logprobs and taken.forced is None]
        if not wanted:
            return {}
        index = torch.tensor([n for n, _ in wanted], device=dense.device)
        rows = tuple(positions[n] for n, _ in wanted)
        columns = torch.tensor([t for _, t in wanted], device=dense.device)
        found = selection_logprobs(Scores(dense.index_select(0, index)),
                                   Batch(rows, dense.shape[1]), columns)
        return {n: lp for (n, _), lp in zip(wanted, found) if lp is not None}

    def _next(self, states: Sequence[SpecState], rows: Sequence[Row],
              committed: list[tuple[int, list[Taken]]], logprobs: dict[int, TokenLogprob],
              dense: torch.Tensor) -> list[Update[SpecState]]:
        """Build the updates and propose every sequence's next drafts (one batched call)."""
        after = [advanced(row, [t.token_id for t in taken]) for row, (_, taken) in
                 zip(rows, committed)]
        limits = [self._limit(row) for row in after]
        forced = [_forced_drafts(state.forcing, row, limit)
                  for state, row, limit in zip(states, after, limits)]
        asked = [i for i, f in enumerate(forced) if f is None]
        proposals: dict[int, Proposal] = dict(zip(asked, self.proposer.propose(
            [states[i].proposer for i in asked], [after[i] for i in asked],
            [limits[i] for i in asked]))) if asked else {}
        out = []
        for i, (state, (at, taken)) in enumerate(zip(states, committed)):
            k = len(state.block.drafts)
            events: tuple[StrategyEvent, ...] = ()
            if k:
                events = (("spec.verified", {"step": rows[i].step, "proposed": k,
                                             "accepted": len(taken) - 1,
                                             "rejected": k - len(taken) + 1}),)
            if rows[i].config.logprobs:
                taken = [attrs.evolve(t, logprob=_logprob(t, logprobs.get(at + j)))
                         for j, t in enumerate(taken)]
            proposal = forced[i] or proposals[i]
            self._stage(state, taken[-1].token_id, proposal, after[i].step,
                        "forced" if forced[i] is not None else self.proposer.name)
            out.append(Update(state, tuple(taken), k - (len(taken) - 1),
                              dense[at:at + len(taken)], events))
        return out

    def _limit(self, row: Row) -> int:
        """Drafts the next block may hold: it commits at most ``k + 1`` tokens, within
        ``max_tokens``, and feeds ``k + 1`` positions, within the window (the cache holds the
        prompt and the outputs but the pending one)."""
        generated = len(row.output_ids)
        return max(room(row.config.max_tokens, generated, window=self.max_context,
                        held=len(row.prompt_ids) + generated - 1,
                        block=self.num_draft_tokens + 1) - 1, 0)

    @staticmethod
    def _stage(state: SpecState, pending: int, proposal: Proposal, step: int,
               source: str) -> None:
        """Keep the next block and what the trace will say about it."""
        state.pending = pending
        state.block = Block(proposal.ids, proposal.q)
        state.drafted = None
        if proposal.ids or "error" in proposal.note:
            state.drafted = {"step": step, "proposed": len(proposal.ids), "proposer": source,
                             "ids": list(proposal.ids), **proposal.note}


def _position(row: Row, block: Block, j: int) -> Row:
    """The row of block position j: the committed tokens and the first j drafts."""
    return row if j == 0 else advanced(row, block.drafts[:j])


def advanced(row: Row, tokens: Sequence[int]) -> Row:
    """``row`` after ``tokens`` more outputs (``step`` moved on by as many). Built directly:
    ``attrs.evolve`` costs several times more, and this runs per verified position."""
    return Row(row.request_id, row.config, row.prompt_ids, with_tokens(row.output_ids, tokens),
               row.step + len(tokens), row.seed, row.eos_token_ids, row.stream, row.states)


def _forced_drafts(forcing: Forcing, row: Row, limit: int) -> Proposal | None:
    """While a forced prefix remains, its next tokens are the drafts (point masses)."""
    ahead = forcing.prefix[row.step - 1:row.step - 1 + limit] if limit > 0 else ()
    return Proposal(tuple(ahead)) if ahead else None


def _logprob(taken: Taken, found: TokenLogprob | None) -> TokenLogprob:
    if taken.forced is not None or found is None:
        return TokenLogprob(taken.token_id, 0.0)
    return found
