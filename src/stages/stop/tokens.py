"""Stoppers that decide on the selected token alone: ``eos``, ``max_tokens``, ``deadline``.

Each is stateless (its per-request state is a small frozen value built by ``start``) and lets
text pass through ``check_text`` untouched (:class:`TokenStopper`, their base). ``generated``
is always the 1-based number of the output token being checked: the token would become output
number ``generated``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

import attrs

from pipeline.contracts.text import StopContext, StopVerdict
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import Request
from pipeline.room import room

S = TypeVar("S")


class TokenStopper(Generic[S]):
    """A stopper that decides on the token alone: its text passes through."""

    def check_text(self, state: S, text: str, final: bool) -> tuple[S, str, StopVerdict | None]:
        """Text passes through."""
        return state, text, None


@attrs.frozen
class EosState:
    """The ids that end a request, and how many outputs must exist before they may."""

    eos_ids: frozenset[int]
    stop_ids: frozenset[int]
    min_tokens: int


class EosStopper(TokenStopper[EosState]):
    """Ends at an EOS token (``FinishReason.EOS``) or a ``stop_token_ids`` token
    (``FinishReason.STOP_TOKEN``); the token's text is not part of the output.

    ``detail`` is the token id. EOS is ignored with ``config.ignore_eos``; a token that is both
    EOS and a stop token reports EOS. With ``min_tokens = n`` neither may end the run until
    ``n`` outputs exist before it, i.e. both are ignored while ``generated <= n`` (the
    ``min_tokens`` processor also masks them in that range, so this only matters when it is
    left out of the chain).

    Example::

        st = EosStopper().start(request, StopContext(frozenset({2}), time.monotonic_ns()))
        assert EosStopper().check_token(st, 2, generated=1).reason is FinishReason.EOS
    """

    name = "eos"

    def start(self, request: Request, context: StopContext) -> EosState:
        """The request's EOS ids (none with ``ignore_eos``), stop ids and ``min_tokens``."""
        config = request.generation_config
        eos = frozenset() if config.ignore_eos else frozenset(context.eos_token_ids)
        return EosState(eos, frozenset(config.stop_token_ids), config.min_tokens)

    def check_token(self, state: EosState, token_id: int, generated: int) -> StopVerdict | None:
        """EOS or STOP_TOKEN once more than ``min_tokens`` outputs would exist."""
        if generated <= state.min_tokens:
            return None
        if token_id in state.eos_ids:
            return StopVerdict(FinishReason.EOS, token_id, keep_token_text=False)
        if token_id in state.stop_ids:
            return StopVerdict(FinishReason.STOP_TOKEN, token_id, keep_token_text=False)
        return None


class MaxTokensStopper(TokenStopper[int]):
    """Ends with ``FinishReason.LENGTH`` at output number ``config.max_tokens``, keeping that
    token's text; ``detail`` is the limit.

    Example::

        st = MaxTokensStopper().start(Request(prompt="x", generation_config={"max_tokens": 2}), ctx)
        assert MaxTokensStopper().check_token(st, 7, generated=2).reason is FinishReason.LENGTH
    """

    name = "max_tokens"

    def start(self, request: Request, context: StopContext) -> int:
        """The state is the limit itself."""
        return request.generation_config.max_tokens

    def check_token(self, state: int, token_id: int, generated: int) -> StopVerdict | None:
        """LENGTH once ``generated >= max_tokens``."""
        if room(state, generated) <= 0:
            return StopVerdict(FinishReason.LENGTH, state, keep_token_text=True)
        return None


@attrs.frozen
class DeadlineState:
    """The deadline in ``time.monotonic_ns`` units (None: no deadline) and the verdict's
    detail (``"deadline_s=<seconds>"``)."""

    deadline_ns: int | None
    detail: str | None


class DeadlineStopper(TokenStopper[DeadlineState]):
    """Ends with ``FinishReason.DEADLINE`` once ``runtime_limits.deadline_s`` has passed since
    ``context.accepted_ns``, keeping the token's text; ``detail`` is ``"deadline_s=<limit>"``.

    ``clock`` returns monotonic nanoseconds (default :func:`time.monotonic_ns`, the clock
    ``accepted_ns`` is read from); tests pass a fake one.

    Example::

        stopper = DeadlineStopper(clock=lambda: now_ns)
        st = stopper.start(Request(prompt="x", runtime_limits={"deadline_s": 1.0}), ctx)
        verdict = stopper.check_token(st, 7, generated=1)
    """

    name = "deadline"

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.clock = clock

    def start(self, request: Request, context: StopContext) -> DeadlineState:
        """The absolute deadline, or none when the request has no ``deadline_s``."""
        limit = request.runtime_limits.deadline_s
        if limit is None:
            return DeadlineState(None, None)
        return DeadlineState(context.accepted_ns + round(limit * 1e9), f"deadline_s={limit}")

    def check_token(self, state: DeadlineState, token_id: int,
                    generated: int) -> StopVerdict | None:
        """DEADLINE when the clock has reached the deadline."""
        if state.deadline_ns is not None and self.clock() >= state.deadline_ns:
            return StopVerdict(FinishReason.DEADLINE, state.detail, keep_token_text=True)
        return None
