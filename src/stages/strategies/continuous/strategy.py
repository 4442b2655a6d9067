"""``ddpm``, ``ddim`` and ``flow``: semi-autoregressive generation over token embeddings.

Owns :class:`ContinuousStrategy` and its per-request loop state :class:`ContState`. The
output is made block by block (docs/design.md §10; BD3-LM's semi-autoregressive layout over the
causal prefix in the KV cache):

1. the first ``update`` takes the prompt's last logits and commits nothing: it opens block 1
   at Gaussian noise x ``[L, d]`` (L = ``block_length``, fewer near ``max_tokens`` or the
   context's end);
2. each denoising step plans one call of the block's L positions with ``embeddings`` (the
   point the integrator asks for), its ``time`` and, with ``self_condition``, the previous
   x0 estimate: attention bidirectional within the block over the cached prefix, nothing
   written (``write=False``); the logits come back as the model's x0 distribution per
   position, x̂0 = softmax(logits) @ E (E: the backend's embedding space), which the
   integrator (DDPM, DDIM, Euler or Heun; :mod:`.integrators`) uses to move x;
3. after the last step the block is rounded to tokens, by the last call's logits
   (``rounding="logits"``, argmax) or by the embedding nearest the final x
   (``"nearest"``), and its first token is committed;
4. the next call writes the rounded block into the cache (causal, ``write=True``: block-wise
   KV reuse, exact because the model was trained block-causally) and the block's other
   tokens are committed; the next block opens. The engine passes committed tokens through
   the stoppers one by one, so EOS, stop strings and ``max_tokens`` end the text where they
   fall, and a request can be cancelled between any two steps.

Randomness is counter-based: the block's starting noise and every DDPM (or DDIM with eta >
0) noise draw are :func:`~.noise.gaussian` of (seed, stream, the block's first token
index, the call number), so seeded runs are identical alone and batched. Sampling
parameters of a request (temperature, top-k/p, penalties) do not shape anything: the
randomness is the noise; but temperature 0 without a seed means deterministic, as for every
strategy: the noise is then drawn from the fixed seed
(:func:`~stages.strategies.diffusion.noise.noise_seed`). ``logprobs`` are those of the
committed tokens under the last call's x0 distribution. The trace gets a
``step.configured`` event at the first update (the strategy's settings and its ``noise``,
the run's reproducibility: ``seeded``, ``fixed`` or ``request``), one ``step.iteration``
event per denoising call (``step``: the
block's first token index, ``block``, ``iteration`` of ``iterations``, ``time``, the digest
of the state fed, ``state_digest``, and ``x0_digest`` of the estimate it conditions on), and a
``step.rounded`` event with the block's ``ids`` when it is final.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from pipeline.errors import InvalidValueError
from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Row
from pipeline.contracts.model import Attention, EmbeddingInputs
from pipeline.contracts.strategy import Honours, Plan, StrategyEvent, Taken, Update
from pipeline.recording import row_digests
from pipeline.room import room
from pipeline.contracts.output import TokenLogprob
from stages.strategies.continuous.integrators import BlockState, Integrator
from stages.strategies.continuous.noise import gaussian
from stages.strategies.diffusion.noise import noise_kind, noise_seed

ROUNDINGS = ("logits", "nearest")
PLACEHOLDER = 0
"""The token id a denoising call feeds at every position (its embeddings replace it)."""


@attrs.define
class ContState:
    """One sequence's loop state: its RNG key, its room (``max_tokens``, the window) and
    the block in progress (None before the first update). ``writing`` is true while the
    final block waits to be written to the cache."""

    seed: int
    stream: int
    prompt_len: int
    block: BlockState | None = None
    writing: bool = False
    full: bool = False
    """No room for another block: the tokens committed last end the request."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """Of the final block's tokens under the last call's distribution, when asked for."""


def _logprobs(z: torch.Tensor, tokens: Sequence[int], row: Row) -> tuple[TokenLogprob, ...]:
    """Each token's log-probability under its position's x0 distribution (the last call's
    logits), with the ``top_logprobs`` most likely alternatives."""
    logp = torch.log_softmax(z, dim=-1)                                     # [L, V]
    k = row.config.top_logprobs
    top = logp.topk(k, dim=-1) if k else None
    out = []
    for j, token in enumerate(tokens):
        alternatives = () if top is None else tuple(
            TokenLogprob(int(i), float(v)) for v, i in zip(top.values[j].tolist(),
                                                           top.indices[j].tolist()))
        out.append(TokenLogprob(token, float(logp[j, token]), alternatives))
    return tuple(out)


def digest(x: torch.Tensor) -> str:
    """The digest of a state tensor's float32 bits (sha256 on the CPU, a device
    fingerprint elsewhere: :func:`pipeline.recording.row_digests`)."""
    return row_digests(x.detach().float().reshape(1, -1).contiguous())[0]


class ContinuousStrategy:
    """Continuous diffusion or flow over ``backend``'s embeddings with ``integrator``.

    ``block_length`` positions per block; ``self_condition`` feeds each call the previous
    x0 estimate; ``rounding`` is one of :data:`ROUNDINGS`; ``max_context`` keeps blocks
    inside the window; ``settings`` are the options it was built with, declared in the
    trace's ``step.configured`` (with the integrator's rule and calls per block). It honours
    logprobs only: forced tokens cannot steer a block being denoised, nor a grammar.

    Example::

        strategy = ContinuousStrategy("ddim", backend, DiffusionIntegrator(s, 20), 16)
        state = strategy.start(row, Forcing.none())
        strategy.update([state], [row], [z1])      # opens block 1, commits nothing
        strategy.plan(state)                       # the first denoising call
    """

    honours: Honours = Honours(logprobs=True)

    def __init__(self, name: str, backend: EmbeddingInputs, integrator: Integrator,
                 block_length: int, *, self_condition: bool = True, rounding: str = "logits",
                 max_context: int | None = None,
                 settings: Mapping[str, Any] | None = None) -> None:
        if not isinstance(block_length, int) or isinstance(block_length, bool) \
                or not 1 <= block_length <= 1024:
            raise InvalidValueError(f"{name}.block_length", block_length,
                                    "must be an integer in 1..1024")
        if rounding not in ROUNDINGS:
            raise InvalidValueError(f"{name}.rounding", rounding,
                                    f"must be one of {', '.join(ROUNDINGS)}")
        self.name = name
        self.backend = backend
        self.integrator = integrator
        self.block_length = block_length
        self.self_condition = self_condition
        self.rounding = rounding
        self.max_context = max_context
        self.settings = dict(settings or {})

    def order(self, row: Row) -> tuple[str, ...]:
        """No processor runs: the randomness is the Gaussian noise, rounding is argmax."""
        return ()

    def start(self, row: Row, forcing: Forcing) -> ContState:
        """Nothing until the prompt's logits arrive (``forcing`` is empty: the pipeline refuses
        forced tokens for this strategy, see :attr:`honours`)."""
        return ContState(noise_seed(row), row.stream, len(row.prompt_ids))

    def plan(self, state: ContState) -> Plan:
        """The next denoising call of the block, or the write of the final block."""
        block = state.block
        if block is None or state.full:
            raise ValueError("nothing to feed: no block is open")
        if state.writing:
            assert block.tokens is not None
            return Plan(block.tokens, (0,))
        call = block.call
        time = self.integrator.time(call)
        event: StrategyEvent = ("step.iteration", {
            "step": block.step, "block": block.index, "iteration": call + 1,
            "iterations": self.integrator.calls, "rule": self.integrator.name,
            "time": time, "length": block.length, "state_digest": digest(block.probe),
            "x0_digest": None if block.x0 is None else digest(block.x0)})
        sc = block.x0 if self.self_condition and block.x0 is not None else None
        return Plan((PLACEHOLDER,) * block.length, tuple(range(block.length)), Attention.BLOCK,
                    write=False, events=(event,), embeddings=block.probe, time=time,
                    self_condition=sc)

    def update(self, states: Sequence[ContState], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> list[Update[ContState]]:
        """Open, move, round or finish each sequence's block (see the module docstring)."""
        return [self._one(state, row, z) for state, row, z in zip(states, rows, logits)]

    def finish(self, state: ContState) -> None:
        """Nothing to release: the state holds small tensors only."""

    def describe(self, row: Row) -> dict[str, Any]:
        """The ``step.configured`` payload: the strategy, its settings, the integrator's
        ``rule`` and model ``calls`` per block, and the run's ``noise`` (every run draws its
        starting noise: ``seeded``, ``fixed`` at temperature 0 without a seed, with its
        ``noise_seed``, else ``request``)."""
        payload = {"step": row.step, "sampler": self.name, "rule": self.integrator.name,
                   "calls": self.integrator.calls, "block_length": self.block_length,
                   "self_condition": self.self_condition, "rounding": self.rounding,
                   **self.settings, "noise": noise_kind(row, True)}
        if noise_seed(row) != row.seed:
            payload["noise_seed"] = noise_seed(row)
        return payload

    # --- one sequence ----------------------------------------------------------------------

    def _one(self, state: ContState, row: Row, z: torch.Tensor) -> Update[ContState]:
        block = state.block
        if block is None:                                    # z_1: open the first block
            state.block = self._open(state, row, row.step, 0, z.device)
            if state.block is None:
                raise ValueError("no room for a first block")
            return Update(state, (), events=(("step.configured", self.describe(row)),))
        if state.writing:                                    # the block is in the cache now
            assert block.tokens is not None
            rest = tuple(self._taken(state, block, j) for j in range(1, block.length))
            state.writing = False
            following = self._open(state, row, block.step + block.length, block.index + 1,
                                   z.device)
            state.block = following or block
            state.full = following is None
            return Update(state, rest)
        if z.shape[0] != block.length:
            raise ValueError(f"{z.shape[0]} logits rows for a block of {block.length}")
        return self._denoised(state, row, block, z.float())

    def _denoised(self, state: ContState, row: Row, block: BlockState, z: torch.Tensor
                  ) -> Update[ContState]:
        """Move the block by one call's logits ``[L, V]``; round it after the last call."""
        space = self.backend.embedding_space()                              # [V, d]
        x0 = torch.softmax(z, dim=-1) @ space                               # [L, d]
        call = block.call
        noise = None
        if self.integrator.needs_noise(call):
            noise = gaussian(state.seed, state.stream, block.step, call + 1,
                             tuple(block.x.shape), block.x.device)
        self.integrator.after_call(block, call, x0, noise)
        block.x0, block.call = x0, call + 1
        if block.call < self.integrator.calls:
            return Update(state, ())
        block.tokens = self._round(block.x, z, space)
        state.writing = True
        state.logprobs = _logprobs(z, block.tokens, row) if row.config.logprobs else ()
        event: StrategyEvent = ("step.rounded", {
            "step": block.step, "block": block.index, "rounding": self.rounding,
            "state_digest": digest(block.x), "ids": list(block.tokens)})
        return Update(state, (self._taken(state, block, 0),), events=(event,))

    @staticmethod
    def _taken(state: ContState, block: BlockState, j: int) -> Taken:
        assert block.tokens is not None
        return Taken(block.tokens[j], state.logprobs[j] if state.logprobs else None)

    def _round(self, x: torch.Tensor, z: torch.Tensor, space: torch.Tensor
               ) -> tuple[int, ...]:
        """Tokens of the final block: argmax of the logits, or the nearest embedding (all
        rows of the space have one norm, so the nearest is the largest dot product);
        ids whose logits are -inf (beyond the tokenizer) are never chosen."""
        if self.rounding == "logits":
            return tuple(int(t) for t in z.argmax(-1).tolist())
        scores = x @ space.T                                                # [L, V]
        scores = scores.masked_fill(~torch.isfinite(z), float("-inf"))
        return tuple(int(t) for t in scores.argmax(-1).tolist())

    def _open(self, state: ContState, row: Row, step: int, index: int,
              device: torch.device) -> BlockState | None:
        """A block of noise at the token index ``step`` (its first); None when
        ``max_tokens`` or the window leaves no room (the request is ending)."""
        generated = step - 1
        length = room(row.config.max_tokens, generated, window=self.max_context,
                      held=state.prompt_len + generated, block=self.block_length)
        if length < 1:
            return None
        x = gaussian(state.seed, state.stream, step, 0, (length, self.backend.embedding_dim),
                     device)
        return BlockState(step, index, length, x, x)

