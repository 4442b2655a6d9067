"""The ``stop_strings`` stopper: ``config.stop`` matched on text across token boundaries.

It owns :class:`StopStringStopper`, its per-request tables :class:`StopTable` and its state
:class:`StopStringState`. Matching runs on detokenized text, never on token ids, so a stop
string split over any number of tokens (or spelled by a different tokenization) is found.
Between calls the stopper holds back the longest suffix of the text that is a prefix of some
stop string; each call scans only that held tail plus the new text.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from pipeline.protocols import StopContext, StopVerdict
from pipeline.types import FinishReason, Request


@attrs.frozen
class StopTable:
    """A request's stop strings with every proper prefix of them, built once at start."""

    stops: tuple[str, ...]
    prefixes: frozenset[str]
    longest: int

    @classmethod
    def build(cls, stops: Sequence[str]) -> StopTable:
        """Tables for ``stops`` (non-empty strings, as ``GenerationConfig`` guarantees)."""
        prefixes = frozenset(s[:k] for s in stops for k in range(1, len(s)))
        return cls(tuple(stops), prefixes, max((len(s) for s in stops), default=0))

    def first_match(self, text: str) -> tuple[int, str] | None:
        """The match in ``text`` that completes first: the smallest end, and among matches
        ending there the earliest start (the longest). ``(start, stop string)`` or None."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self.longest - 1), 0, -1):
            if text[-k:] in self.prefixes:
                return k
        return 0


@attrs.frozen
class StopStringState:
    """The request's tables, the text held back, and the verdict once a stop string matched
    (after which all further text is dropped)."""

    table: StopTable
    held: str = ""
    stopped: StopVerdict | None = None


class StopStringStopper:
    """Ends with ``FinishReason.STOP_STRING`` at the first stop string that completes.

    Released text never contains any part of a matched stop string: on a match, only the
    text before the match is released, and the stop string and everything after it are
    dropped; ``detail`` is the stop string. "First" is the match with the smallest end —
    generation halts the moment a stop string is complete — and among matches ending at the
    same place the one starting earliest (for stops ``"ab"`` and ``"b"``, text ``"xab"``
    releases ``"x"`` and reports ``"ab"``). This equals the earliest-starting match whenever
    no stop string contains another one strictly inside it. With ``final=True`` everything
    still held is released. Tokens are never checked (``check_token`` returns None).

    Example::

        stopper = StopStringStopper()
        st = stopper.start(Request(prompt="x", generation_config={"stop": ["</a>"]}), ctx)
        st, out, v = stopper.check_text(st, "hi </", final=False)   # out == "hi "
        st, out, v = stopper.check_text(st, "a> more", final=False)  # out == "", v.detail == "</a>"
    """

    name = "stop_strings"

    def start(self, request: Request, context: StopContext) -> StopStringState:
        """Tables for the request's ``generation_config.stop``."""
        return StopStringState(StopTable.build(request.generation_config.stop))

    def check_token(self, state: StopStringState, token_id: int,
                    generated: int) -> StopVerdict | None:
        """Never stops on a token."""
        return None

    def check_text(self, state: StopStringState, text: str, final: bool
                   ) -> tuple[StopStringState, str, StopVerdict | None]:
        """Scan the held tail plus ``text``; release what cannot begin a stop string."""
        if state.stopped is not None:
            return state, "", state.stopped
        if not state.table.stops:
            return state, text, None
        pending = state.held + text
        match = state.table.first_match(pending)
        if match is not None:
            start, stop = match
            verdict = StopVerdict(FinishReason.STOP_STRING, stop, keep_token_text=False)
            return StopStringState(state.table, "", verdict), pending[:start], verdict
        keep = 0 if final else state.table.hold_length(pending)
        cut = len(pending) - keep
        return StopStringState(state.table, pending[cut:]), pending[:cut], None
