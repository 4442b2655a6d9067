"""The strategy side of the contracts (docs/design.md §6, §10): how a decoding strategy
plans a step's model calls (:class:`Plan`), takes their logits (:class:`Update`,
:class:`Taken`) and states what it honours (:class:`Honours`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import attrs
import torch

from pipeline.contracts.decode import Row
from pipeline.contracts.model import Attention
from pipeline.contracts.output import TokenLogprob
from pipeline.contracts.request import GenerationConfig
from pipeline.errors import InvalidValueError

if TYPE_CHECKING:
    from pipeline.contracts.forcing import Forcing

S = TypeVar('S')


# --- strategies (docs/design.md §6 second edition, §10) -----------------------------------


StrategyEvent = tuple[str, dict[str, Any]]
"""``(event_type, payload)`` of a trace event a strategy asks the engine to record (component
``strategy``), e.g. ``("spec.drafted", {"step": 5, "proposed": 4, "ids": [...]})``. A payload's
``ids`` list is content: it is recorded as is at ``Recording.FULL`` and as its digest
(``ids_digest``) otherwise."""


@attrs.frozen
class Plan:
    """What a strategy asks of the model for one sequence this step.

    ``token_ids`` are fed after the sequence's cache (at positions ``cache_len ..``);
    ``outputs`` are the offsets into them whose logits the strategy wants back; see
    :class:`ModelCall` for ``attention`` and ``write``. Autoregressive decoding plans
    ``Plan((y_t,), (0,))``; verifying k drafts plans ``Plan((y_t, d_1..d_k), range(k + 1))``.
    ``events`` are the strategy's own trace events about this plan (:data:`StrategyEvent`),
    recorded when its call has run, before ``decode.completed``. ``embeddings``, ``time`` and
    ``self_condition`` go to the call as they are (see :class:`ModelCall`): a continuous
    strategy's denoising pass.
    """

    token_ids: tuple[int, ...]
    outputs: tuple[int, ...]
    attention: Attention = Attention.CAUSAL
    write: bool = True
    events: tuple[StrategyEvent, ...] = attrs.field(default=(), eq=False)
    embeddings: torch.Tensor | None = attrs.field(default=None, eq=False)
    time: float | None = None
    self_condition: torch.Tensor | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Taken:
    """One committed token, with what the trace records about how it was chosen.

    ``draw`` is the uniform number the selector consumed (None for argmax); ``forced`` is the
    event a forced-token source recorded when it overrode the selection
    (``(event_type, payload)``, see :class:`pipeline.contracts.forcing.Forcing`).
    """

    token_id: int
    logprob: TokenLogprob | None = None
    draw: float | None = None
    forced: tuple[str, dict[str, Any]] | None = None


@attrs.frozen
class Update(Generic[S]):
    """A strategy's verdict for one sequence after a model call.

    ``taken`` are the tokens committed this step, in order (possibly none: a denoising
    step that commits nothing yet); ``rollback`` is how many of the positions the plan fed
    the cache must drop again (rejected drafts); ``processed`` holds, per taken token, the
    dense processed logits it was chosen from (``[len(taken), V]``, for the trace; None if
    the strategy does not report them); ``events`` are the strategy's own trace events about
    this step (:data:`StrategyEvent`), recorded before the first taken token.
    """

    state: S
    taken: tuple[Taken, ...]
    rollback: int = 0
    processed: torch.Tensor | None = attrs.field(default=None, eq=False)
    events: tuple[StrategyEvent, ...] = attrs.field(default=(), eq=False)


@attrs.frozen
class Honours:
    """What a strategy can honour of a request's controls (its capability model).

    Four controls act on how tokens are committed, and only some strategies can keep them:
    ``grammar`` (every committed token allowed by the request's grammar: a strategy that
    commits a block it predicted at once cannot), ``forced_prefix`` and
    ``reasoning_budget`` (a forced-token source overrides committed tokens,
    :class:`~pipeline.contracts.forcing.Forcing`), and ``logprobs`` (each committed token's
    log-probability). The pipeline checks a request against its strategy's ``honours`` once,
    when it is submitted, and refuses what the strategy would not keep with an
    :class:`~pipeline.errors.InvalidValueError` naming the field; nothing is dropped silently.

    Example::

        Honours.ALL.refusal(config, "autoregressive")                 # None: all kept
        Honours(logprobs=True).refusal(GenerationConfig(forced_prefix=(5,)), "continuous")
        # InvalidValueError: forced_prefix ... the 'continuous' strategy cannot ...
    """

    grammar: bool = False
    forced_prefix: bool = False
    reasoning_budget: bool = False
    logprobs: bool = False

    ALL: ClassVar[Honours]

    def refusal(self, config: GenerationConfig, strategy: str) -> InvalidValueError | None:
        """The error for the first control ``config`` asks for that this strategy cannot keep
        (None when it keeps them all)."""
        grammar = config.grammar
        asked: tuple[tuple[bool, bool, str, Any, str], ...] = (
            (self.grammar, grammar is not None, grammar.field if grammar else "grammar",
             "(grammar)", "commits positions of a block it predicts at once, so a grammar "
             "cannot constrain it; use an autoregressive model and strategy for structured "
             "output"),
            (self.forced_prefix, bool(config.forced_prefix), "forced_prefix",
             list(config.forced_prefix), "cannot force output tokens"),
            (self.reasoning_budget, config.reasoning_budget_tokens is not None,
             "reasoning_budget_tokens", config.reasoning_budget_tokens,
             "cannot force output tokens (a spent reasoning budget forces the end of thinking)"),
            (self.logprobs, config.logprobs, "logprobs", True,
             "does not report log-probabilities"),
        )
        for kept, wanted, field, value, why in asked:
            if wanted and not kept:
                return InvalidValueError(field, value, f"the {strategy!r} strategy {why}")
        return None


Honours.ALL = Honours(grammar=True, forced_prefix=True, reasoning_budget=True, logprobs=True)


@runtime_checkable
class Strategy(Protocol):
    """A generation strategy: it owns each request's loop state (docs/design.md §6, §10).

    Every strategy runs as ``start`` (after the prompt is in the cache) -> repeatedly
    ``plan`` a model call -> the engine batches every sequence's call into one
    :meth:`Backend.forward` -> ``update`` with the logits it asked for -> commit tokens,
    until a stopper ends the request. The engine owns scheduling, KV memory and the trace;
    the text stages (detokenizer, stoppers, transport) see only the tokens a strategy
    commits. The first ``update`` receives the prompt's last logits z_1 (no plan).

    ``update`` is batched: it gets the states, the :class:`Row` of each sequence (its
    committed tokens; ``step`` is the index of the next token) and each sequence's logits
    ``[len(plan.outputs), V]``, and returns one :class:`Update` per sequence. States are
    owned by the strategy; the engine stores them and hands them back. ``order`` names the
    processors a row's logits go through, for the trace. ``finish`` is called once per
    started sequence when its request ends (finished, cancelled or failed), so a strategy can
    free what its state holds (a draft model's cache slot); it must not raise. ``honours`` says which of
    a request's controls the strategy keeps (:class:`Honours`); the pipeline refuses the
    others when the request is submitted.

    Example::

        ar = AutoregressiveStrategy(chain, selector)
        state = ar.start(row, Forcing.none())
        update = ar.update([state], [row], [z1])[0]     # update.taken[0].token_id == y_1
        ar.plan(update.state)                           # Plan((y_1,), (0,))
    """

    name: str
    honours: Honours

    def order(self, row: Row) -> tuple[str, ...]:
        """Names of the processors applied to ``row``, in application order."""
        ...

    def start(self, row: Row, forcing: Forcing) -> Any:
        """The loop state of a sequence whose prompt is in the cache."""
        ...

    def plan(self, state: Any) -> Plan:
        """The model call this sequence needs next."""
        ...

    def update(self, states: Sequence[Any], rows: Sequence[Row],
               logits: Sequence[torch.Tensor]) -> Sequence[Update[Any]]:
        """Commit tokens for each sequence from the logits its plan asked for."""
        ...

    def finish(self, state: Any) -> None:
        """The sequence's request ended: release what ``state`` holds."""
        ...


