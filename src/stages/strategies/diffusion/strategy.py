"""Masked-diffusion strategies: semi-autoregressive blocks refined over several model calls
(docs/design.md §6 second edition, §10).

Owns :class:`MaskedDiffusionStrategy` (the block loop every masked sampler shares), its three
samplers :class:`LladaStrategy`, :class:`FastDllmStrategy` and :class:`DiscreteFlowStrategy`,
their settings :class:`DiffusionSettings`, and the per-request loop state
:class:`BlockState`.

The loop, per request (the engine has prefilled the prompt; the cache holds m positions):

1. the first ``update`` gets the prompt's last logits and commits nothing: it opens a block of
   ``block_length`` ``<|mask|>`` positions (shorter when ``max_tokens`` or the context window
   leaves less room; positions under a forced prefix start as the forced tokens);
2. each *denoising pass* plans the block with ``Attention.BLOCK`` and ``write=False``: every
   position sees the cached prefix and the whole block, and the cache stays as it was. The
   sampler's rule commits some masked positions (``rules.py``) and the trace gets a
   ``step.denoised`` event (iteration, block, positions committed, digests of the state).
   A pass that commits nothing leaves the block as it was fed, so the model's logits for the
   next pass are the ones just computed: that pass runs at once on them, without a model
   call (``"reused": true``; MDLM's and BD3-LM's samplers cache them the same way), and the
   output is the one a fresh forward would give;
3. when no mask is left the block is *final*: its tokens are committed in order (the text
   stages see them now: EOS, stop strings and ``max_tokens`` act on them), then one
   ``write=True`` call with causal attention puts them in the cache, exactly as a prompt
   prefill would (the model is trained block-causally, so the cached keys and values of a
   finished block are the ones it was trained to read: the cache is exact, never recomputed);
4. the update after that write opens the next block.

Randomness is counter-based: iteration k of a request draws from
:func:`~stages.strategies.diffusion.noise.uniforms` at (seed, stream, 4k + purpose), so a run is
the same alone and in any batch; at temperature 0 without a seed the seed is
:data:`~stages.strategies.diffusion.noise.FIXED_SEED`, so a greedy run is deterministic even
where the sampler draws (random remasking, ``dfm``). The request's processors (temperature,
top-k, penalties, ...) shape each position's distribution, from which the prediction is
drawn (argmax at temperature 0); the confidence that decides which positions a pass commits
is the model's own probability of that prediction (the raw logits, as LLaDA's and
Fast-dLLM's ``low_confidence`` computes it), not the processed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from pipeline.errors import InvalidValueError
from pipeline.events import digest_ids
from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Batch, LogitProcessor, Row, Scores
from pipeline.contracts.model import Attention
from pipeline.contracts.strategy import Honours, Plan, StrategyEvent, Update
from pipeline.contracts.output import TokenLogprob
from pipeline.room import room
from stages.process.chain import ProcessorChain
from stages.strategies.diffusion import rules
from stages.strategies.diffusion.noise import noise_kind, noise_seed, uniforms
from stages.select.logprobs import selection_logprobs

REMASKING = ("low_confidence", "random")
_GUMBEL, _REMASK, _JUMP = 0, 1, 2  # the purposes of an iteration's draws


@attrs.frozen
class DiffusionSettings:
    """What every masked sampler is built with.

    ``mask_token_id`` is the model's ``<|mask|>``; ``block_length`` positions per block;
    ``steps`` denoising passes per block (at most ``block_length``; the threshold sampler takes
    as many as it needs, at most one per masked position); ``remasking`` is LLaDA's rule;
    ``threshold`` Fast-dLLM's confidence bar; ``kappa_power`` the exponent n of discrete flow
    matching's scheduler ``κ(t) = t**n``; ``logits_eos_inf`` LLaDA's option of that name (the
    request's end-of-sequence ids get logit -inf before the prediction and the confidence);
    ``max_context`` the backend's window.
    """

    mask_token_id: int
    block_length: int = 8
    steps: int = 8
    remasking: str = "low_confidence"
    threshold: float = 0.9
    kappa_power: float = 1.0
    logits_eos_inf: bool = False
    max_context: int | None = None

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.block_length <= 1024:
            raise InvalidValueError("block_length", self.block_length, "must be in 1..1024")
        if not 1 <= self.steps <= self.block_length:
            raise InvalidValueError("steps", self.steps, f"must be in 1..block_length "
                                    f"({self.block_length}): each step commits a token at least")
        if self.remasking not in REMASKING:
            raise InvalidValueError("remasking", self.remasking, f"must be one of {REMASKING}")
        if not 0.0 <= self.threshold < 1.0:
            raise InvalidValueError("threshold", self.threshold, "must be in [0, 1)")
        if not 1.0 <= self.kappa_power <= 16.0:
            raise InvalidValueError("kappa_power", self.kappa_power, "must be in [1, 16]")
        if not isinstance(self.logits_eos_inf, bool):
            raise InvalidValueError("logits_eos_inf", self.logits_eos_inf,
                                    "must be true or false")


@attrs.define
class BlockState:
    """One sequence's loop state.

    ``block`` is the current block (``mask_token_id`` where still masked; None before the
    first update); ``start`` the number of tokens committed before it; ``schedule`` the LLaDA
    counts still to run; ``passes`` the denoising passes run on it and ``forwards`` the model
    calls among them (the others reused the previous call's logits); ``final`` the committed
    block awaiting its cache write; ``blocks`` the blocks finished; ``iteration`` the
    denoising passes so far (the RNG's counter); ``logprobs`` per position, once committed
    (under the processed distribution of the pass that committed it, when the request asks).
    """

    forcing: Forcing
    block: list[int] | None = None
    start: int = 0
    schedule: list[int] = attrs.field(factory=list)
    passes: int = 0
    final: tuple[int, ...] | None = None
    blocks: int = 0
    iteration: int = 0
    logprobs: list[TokenLogprob | None] = attrs.field(factory=list)
    forwards: int = 0


class MaskedDiffusionStrategy:
    """The block loop of masked diffusion; subclasses supply :meth:`choose`, the rule that
    picks which masked positions a pass commits.

    ``chain`` is a :class:`ProcessorChain` or the processors to build one from (in order).
    It honours a forced prefix and a reasoning budget (a block's positions are committed in
    order through the forced-token source) and logprobs, not a grammar (a block's positions
    are predicted at once).
    """

    name: str = "masked_diffusion"
    honours: Honours = Honours(forced_prefix=True, reasoning_budget=True, logprobs=True)

    def __init__(self, chain: ProcessorChain | Sequence[LogitProcessor],
                 settings: DiffusionSettings) -> None:
        self.chain = chain if isinstance(chain, ProcessorChain) else ProcessorChain(chain)
        self.settings = settings

    # --- the Strategy protocol -------------------------------------------------------------

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        return self.chain.order_for(row)

    def start(self, row: Row, forcing: Forcing) -> BlockState:
        """Nothing yet: the first update (the prompt's last logits) opens the first block."""
        return BlockState(forcing)

    def plan(self, state: BlockState) -> Plan:
        """A finished block is written (causal, ``write=True``); otherwise the block is
        denoised (block attention over the cache, ``write=False``), logits everywhere."""
        if state.final is not None:
            return Plan(state.final, (len(state.final) - 1,))
        if state.block is None:
            raise ValueError("nothing to denoise: the sequence has no block yet")
        return Plan(tuple(state.block), tuple(range(len(state.block))), Attention.BLOCK,
                    write=False)

    def update(self, states: Sequence[BlockState], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> list[Update[BlockState]]:
        """Open a block (after the prompt or a block's write), or run the denoising passes
        one model call serves (one, and more while a pass commits nothing)."""
        out: list[Update[BlockState] | None] = [None] * len(states)
        passes = []
        for i, (state, row) in enumerate(zip(states, rows)):
            if state.block is None or state.final is not None:
                out[i] = self._open(state, row)
            else:
                passes.append(i)
        if passes:
            done = self._denoise([states[i] for i in passes], [rows[i] for i in passes],
                                 [logits[i] for i in passes])
            for i, update in zip(passes, done):
                out[i] = update
        return [u for u in out if u is not None]

    def finish(self, state: BlockState) -> None:
        """Nothing to release: the state is a few small lists."""

    # --- what subclasses define ------------------------------------------------------------

    def steps_for(self, masked: int) -> list[int]:
        """The commit schedule of a new block with ``masked`` masked positions (LLaDA's
        ``get_num_transfer_tokens``); samplers that do not follow one ignore it."""
        return rules.num_transfer_tokens(masked, min(self.settings.steps, max(masked, 1)))

    def choose(self, state: BlockState, row: Row, logits: torch.Tensor,
               predicted: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """``[L]`` bool: the masked positions this pass commits (to ``predicted``);
        ``logits [L, V]`` are the model's own, before any processor (what confidence is
        computed from)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The sampler's settings, for the trace's ``step.configured`` event."""
        s = self.settings
        return {"sampler": self.name, "block_length": s.block_length, "steps": s.steps,
                "mask_token_id": s.mask_token_id}

    def draws_noise(self, row: Row) -> bool:
        """Whether ``row``'s run draws random numbers: when it samples (temperature > 0);
        samplers with random rules of their own say so too."""
        return not row.config.greedy

    # --- the loop --------------------------------------------------------------------------

    def _open(self, state: BlockState, row: Row) -> Update[BlockState]:
        """Start the next block (the previous one, if any, is in the cache now)."""
        events: list[StrategyEvent] = []
        if state.block is None:
            events.append(("step.configured", self._configured(row)))
        else:
            state.start += len(state.final or ())
            state.blocks += 1
        state.final = None
        start = state.start  # the next block's room: block_length, max_tokens, the window
        length = max(room(row.config.max_tokens, start, window=self.settings.max_context,
                          held=len(row.prompt_ids) + start, block=self.settings.block_length), 1)
        mask = self.settings.mask_token_id
        prefix = state.forcing.prefix
        state.block = [prefix[state.start + j] if state.start + j < len(prefix) else mask
                       for j in range(length)]
        state.logprobs = [None] * length
        masked = sum(1 for b in state.block if b == mask)
        state.schedule, state.passes, state.forwards = self.steps_for(masked), 0, 0
        if masked == 0:  # wholly forced: final at once
            return self._finalize(state, row, events)
        return Update(state, (), events=tuple(events))

    def _configured(self, row: Row) -> dict[str, Any]:
        """The ``step.configured`` payload: the settings and, when the run draws random
        numbers, where they come from (``noise``: ``seeded``, ``fixed`` or ``request``; with
        ``noise_seed`` when it is not the request's)."""
        payload: dict[str, Any] = {"step": row.step, **self.describe()}
        if self.draws_noise(row):
            payload["noise"] = noise_kind(row, True)
            if noise_seed(row) != row.seed:
                payload["noise_seed"] = noise_seed(row)
        return payload

    def _denoise(self, states: Sequence[BlockState], rows: Sequence[Row],
                 logits: Sequence[torch.Tensor]) -> list[Update[BlockState]]:
        """Each sequence's passes on this call's logits: processors over every position of
        every block at once (on a copy: the rules' confidence reads the model's own logits),
        then each sequence's rule."""
        sizes = [len(s.block or ()) for s in states]
        for z, n in zip(logits, sizes):
            if z.shape[0] != n:
                raise ValueError(f"{z.shape[0]} logits rows for a block of {n} positions")
        raw = torch.cat(list(logits)).float()                                 # [N, V]
        if self.settings.logits_eos_inf:  # LLaDA's option: before prediction and confidence
            at = 0
            for row, n in zip(rows, sizes):
                raw[at:at + n, sorted(row.eos_token_ids)] = float("-inf")
                at += n
        z = raw.clone()  # the processors edit in place; confidence reads the model's logits
        z[:, self.settings.mask_token_id] = float("-inf")  # the mask is never a prediction
        positions = [_at(row, j) for row, n in zip(rows, sizes) for j in range(n)]
        batch = Batch(tuple(positions), z.shape[1])
        processed = self.chain(Scores(z), batch).to_dense(z.shape[1])         # [N, V]
        out, at = [], 0
        for state, row, n in zip(states, rows, sizes):
            out.append(self._passes(state, row, raw[at:at + n], processed[at:at + n]))
            at += n
        return out

    def _passes(self, state: BlockState, row: Row, raw: torch.Tensor,
                processed: torch.Tensor) -> Update[BlockState]:
        """One pass on the call's logits, and more on the same logits while a pass commits
        nothing: the block is then what the call was fed, so a new forward would return the
        same logits (and the processors, which see the same committed tokens, the same
        scores); only the pass's draws are new. Ends when a pass commits or the block is
        final."""
        assert state.block is not None
        state.forwards += 1
        events: list[StrategyEvent] = []
        while True:
            committed = self._pass(state, row, raw, processed, events)
            if self.settings.mask_token_id not in state.block:
                return self._finalize(state, row, events)
            if committed:
                return Update(state, (), events=tuple(events))

    def _pass(self, state: BlockState, row: Row, raw: torch.Tensor, processed: torch.Tensor,
              events: list[StrategyEvent]) -> int:
        """Predict every position from the ``processed [L, V]`` scores, commit what the rule
        picks (its confidence from the model's ``raw [L, V]`` logits), record the pass in
        ``events``; the number of positions committed."""
        assert state.block is not None
        mask = self.settings.mask_token_id
        block = torch.tensor(state.block, device=raw.device)
        masked = block == mask                                                # [L]
        noise = None
        if not row.config.greedy:
            noise = self.draws(state, row, _GUMBEL, tuple(processed.shape), raw.device)
        predicted = rules.gumbel_argmax(processed, noise)                     # [L]
        chosen = self.choose(state, row, raw, predicted, masked) & masked
        fed = list(state.block)
        where = [int(j) for j in chosen.nonzero().flatten()]
        for j in where:
            state.block[j] = int(predicted[j])
        if row.config.logprobs and where:
            index = torch.tensor(where, device=processed.device)
            found = selection_logprobs(Scores(processed.index_select(0, index)),
                                       Batch(tuple(_at(row, j) for j in where),
                                             processed.shape[1]),
                                       predicted.index_select(0, index))
            for j, logprob in zip(where, found):
                state.logprobs[j] = logprob
        state.passes += 1
        state.iteration += 1
        events.append(("step.denoised", {
            "step": row.step, "iteration": state.iteration, "block": state.blocks,
            "block_step": state.passes, "masked": int(masked.sum()), "committed": len(where),
            "positions": where, "ids": [state.block[j] for j in where],
            "input_digest": digest_ids(fed), "state_digest": digest_ids(state.block),
            "reused": bool(events)}))
        return len(where)

    def _finalize(self, state: BlockState, row: Row, events: list[StrategyEvent]
                  ) -> Update[BlockState]:
        """The block is final: commit its tokens in order (a forced-token source may
        override them) and plan its cache write."""
        assert state.block is not None
        taken = []
        for j, token in enumerate(state.block):
            logprob = None
            if row.config.logprobs:  # a position a forced prefix filled has none: 0
                logprob = state.logprobs[j] or TokenLogprob(token, 0.0)
            taken.append(state.forcing.take(row.step + j, token, logprob))
        state.final = tuple(t.token_id for t in taken)
        events.append(("step.block_final", {
            "step": row.step, "block": state.blocks, "tokens": len(taken),
            "passes": state.passes, "forwards": state.forwards, "ids": list(state.final)}))
        return Update(state, tuple(taken), events=tuple(events))

    def draws(self, state: BlockState, row: Row, purpose: int, shape: tuple[int, ...],
              device: torch.device) -> torch.Tensor:
        """This iteration's uniforms for ``purpose`` (a pure function of seed, stream,
        iteration and purpose)."""
        return uniforms(noise_seed(row), row.stream, 4 * state.iteration + purpose, shape,
                        device)


class LladaStrategy(MaskedDiffusionStrategy):
    """LLaDA's sampler: each pass commits the schedule's count of masked positions, the most
    confident ones (``low_confidence``: the model's probability of its prediction) or
    random ones (``random``).

    Example::

        llada = LladaStrategy(chain, DiffusionSettings(mask_token_id=6144, block_length=8))
        state = llada.start(row, Forcing.none())
        llada.update([state], [row], [z1])     # opens a block of 8 masks
        llada.plan(state)                      # Plan(8 masks, range(8), BLOCK, write=False)
    """

    name = "llada"

    def choose(self, state: BlockState, row: Row, logits: torch.Tensor,
               predicted: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """The schedule's count for this pass, by confidence or at random."""
        k = state.schedule[state.passes] if state.passes < len(state.schedule) else 1
        if self.settings.remasking == "random":
            scores = self.draws(state, row, _REMASK, tuple(masked.shape), logits.device)
        else:
            scores = rules.confidence(logits, predicted)
        return rules.top_confidence(scores, masked, k)

    def describe(self) -> dict[str, Any]:
        """Settings, with the remasking rule (and ``logits_eos_inf`` when set)."""
        out = {**super().describe(), "remasking": self.settings.remasking}
        if self.settings.logits_eos_inf:
            out["logits_eos_inf"] = True
        return out

    def draws_noise(self, row: Row) -> bool:
        """Random remasking draws even at temperature 0."""
        return super().draws_noise(row) or self.settings.remasking == "random"


class FastDllmStrategy(MaskedDiffusionStrategy):
    """Fast-dLLM's confidence-aware parallel decoding: each pass commits every masked
    position whose confidence exceeds ``threshold``, and at least the most confident one;
    a block takes as many passes as that needs (``steps`` is not used)."""

    name = "fast_dllm"

    def choose(self, state: BlockState, row: Row, logits: torch.Tensor,
               predicted: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Every masked position above the threshold (one at least)."""
        return rules.above_threshold(rules.confidence(logits, predicted), masked,
                                     self.settings.threshold)

    def describe(self) -> dict[str, Any]:
        """Settings, with the threshold."""
        return {**super().describe(), "threshold": self.settings.threshold}


class DiscreteFlowStrategy(MaskedDiffusionStrategy):
    """Discrete flow matching on a block (mixture path from the mask source, κ(t) = t**n):
    ``steps`` discrete Euler steps over t in [0, 1) with h = 1/steps; at step i (t = i*h)
    each masked position jumps to its sampled token with probability
    ``1 - exp(-h * dκ/(1-κ))``; the last step sets every remaining position to its sample
    (the solver's ``x_t = x_1``; unmasked positions keep their token, which is what the
    mask-source posterior says of them)."""

    name = "dfm"

    def steps_for(self, masked: int) -> list[int]:
        """No count schedule: the jump probabilities are the schedule."""
        return []

    def choose(self, state: BlockState, row: Row, logits: torch.Tensor,
               predicted: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Jumps by the Euler step's probability; everything on the last step."""
        steps = self.settings.steps
        if state.passes >= steps - 1:
            return masked.clone()
        h = 1.0 / steps
        p = rules.jump_probability(state.passes * h, h, self.settings.kappa_power)
        u = self.draws(state, row, _JUMP, tuple(masked.shape), logits.device)
        return rules.dfm_jumps(masked, u, p)

    def describe(self) -> dict[str, Any]:
        """Settings, with the scheduler's exponent."""
        return {**super().describe(), "kappa_power": self.settings.kappa_power}

    def draws_noise(self, row: Row) -> bool:
        """The jumps are random even at temperature 0."""
        return True


def _at(row: Row, j: int) -> Row:
    """The row of block position j: the committed tokens, ``step`` moved on by j (so
    step-dependent processors such as ``min_tokens`` see the position's index)."""
    if j == 0:
        return row
    return Row(row.request_id, row.config, row.prompt_ids, row.output_ids, row.step + j,
               row.seed, row.eos_token_ids, row.stream)
