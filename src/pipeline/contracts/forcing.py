"""Forced tokens: the one mechanism behind a required prefix and the reasoning budget.

Owns :class:`Forcing`, a request's forced-token source (docs/design.md §6: "a forced-token
source the strategy consults"). A strategy asks it, for every token it is about to commit, whether
that token is forced; it answers from two rules, in order:

1. ``prefix``: the first ``len(prefix)`` tokens of the output are the config's
   ``forced_prefix`` (a required tool call's opening, say), whatever the selector chose;
2. ``reasoning_budget``: once a think block (opened by the prompt's generation prefix or by
   the model) holds ``budget`` tokens, the next token is the end-of-thinking marker.

A forced token is a point mass, so its logprob is 0. The source is a small mutable record
(ints and tuples only), so a request's decode state stays serializable.

:meth:`Forcing.take` is the one place a strategy commits a token: it asks, applies and
accounts in one call, and returns the :class:`~pipeline.contracts.strategy.Taken` the engine commits;
every strategy that honours forcing commits through it.

Example::

    forcing = Forcing(prefix=(7, 8), budget=None, markers=None)
    forcing.take(step=1, selected=3)         # Taken(7, forced=("token.forced", {...}))
    forcing.take(step=2, selected=8)         # Taken(8): forced, but what was selected
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from pipeline.contracts.strategy import Taken
from pipeline.contracts.output import TokenLogprob


@attrs.frozen
class Forced:
    """The token to take instead, and the trace event that says why (None: record nothing,
    the forced token is what was selected)."""

    token_id: int
    event: tuple[str, dict[str, Any]] | None


@attrs.define
class Forcing:
    """A request's forced-token source. ``markers`` are the template's begin- and
    end-of-thinking ids (needed only with a ``budget``); ``thinking`` counts the tokens of the
    open think block (None when none is open)."""

    prefix: tuple[int, ...] = ()
    budget: int | None = None
    markers: tuple[int, int] | None = None
    thinking: int | None = None

    @classmethod
    def none(cls) -> Forcing:
        """A source that never forces anything."""
        return cls()

    @classmethod
    def for_request(cls, prefix: Sequence[int], budget: int | None,
                    markers: tuple[int, int] | None, prompt_ids: Sequence[int]) -> Forcing:
        """The source for a request; a think block is open from the start when the prompt's
        generation prefix opened one (e.g. ``<think>\\n`` among its last tokens)."""
        thinking = None
        if markers is not None:
            begin, end = markers
            for token in reversed(prompt_ids[-8:]):
                if token == end:
                    break
                if token == begin:
                    thinking = 0
                    break
        return cls(tuple(prefix), budget if markers is not None else None, markers, thinking)

    def force(self, step: int, selected: int) -> Forced | None:
        """Whether output token ``step`` (1-based) is forced, given the ``selected`` one."""
        if step <= len(self.prefix):
            forced = self.prefix[step - 1]
            event = None if forced == selected else ("token.forced", {
                "step": step, "selected": selected, "forced": forced, "why": "prefix"})
            return Forced(forced, event)
        if self.budget is None or self.thinking is None or self.thinking < self.budget:
            return None
        assert self.markers is not None  # a budget is kept only with markers
        end = self.markers[1]
        return Forced(end, ("reasoning.budget_reached", {
            "step": step, "thinking_tokens": self.thinking, "budget": self.budget,
            "selected": selected, "forced": end}))

    def take(self, step: int, selected: int, logprob: TokenLogprob | None = None,
             draw: float | None = None) -> Taken:
        """Commit output token ``step`` (1-based): ``selected``, with its ``logprob`` and
        ``draw``, unless it is forced; a forced token's logprob is 0 (reported only where
        ``logprob`` was) and its event says why. The token is then accounted for."""
        forced = self.force(step, selected)
        if forced is None:
            self.observe(selected)
            return Taken(selected, logprob, draw)
        self.observe(forced.token_id)
        point = None if logprob is None else TokenLogprob(forced.token_id, 0.0)
        return Taken(forced.token_id, point, draw, forced.event)

    def observe(self, token: int) -> None:
        """Account for a committed token (opens, counts and closes think blocks)."""
        if self.markers is None:
            return
        begin, end = self.markers
        if token == begin:
            self.thinking = 0
        elif token == end:
            self.thinking = None
        elif self.thinking is not None:
            self.thinking += 1
