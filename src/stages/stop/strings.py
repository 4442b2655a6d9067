"""The ``stop_strings`` stopper: ``config.stop`` matched on text across token boundaries.

It owns :class:`StopStringStopper`, its per-request tables :class:`StopTable` and its state
:class:`StopStringState`. Matching runs on detokenized text, never on token ids, so a stop
string split over any number of tokens (or spelled by a different tokenization) is found.
Between calls the stopper holds back the longest suffix of the text that is a proper prefix of
some stop string.

Algorithm: one streaming Knuth–Morris–Pratt automaton per stop string. Its failure table is
built once at ``start`` (one machine integer per character, so memory is linear in the total
length of the stop strings) and the state carries each automaton's position, so a call reads
only its new text, in time linear in it (amortized). The held text is never stored: it is a
prefix of a stop string, sliced from that string when it is released.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import attrs

from pipeline.contracts.text import StopContext, StopVerdict
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import Request


def _failure_table(stop: str) -> array[int]:
    """``table[q]`` (for ``1 <= q < len(stop)``) is the length of the longest proper border of
    ``stop[:q]``: where the automaton falls back to when ``stop[q]`` does not come next.
    ``table[0]`` is unused. An ``array`` of C ints keeps it at 4 bytes a character; a list
    would take a pointer plus an int object (up to 36 bytes) for each."""
    table = array("i" if len(stop) < 2**31 else "q", [0]) * max(len(stop), 1)
    border = 0  # of stop[:q]
    for q in range(1, len(stop) - 1):
        border = _advance(stop, table, border, stop[q])
        table[q + 1] = border
    return table


def _advance(stop: str, table: Sequence[int], position: int, char: str) -> int:
    """The automaton's position after ``char``, from ``position < len(stop)``."""
    while position and stop[position] != char:
        position = table[position]
    return position + 1 if stop[position] == char else 0


@attrs.frozen
class StopTable:
    """A request's stop strings with their failure tables, built once at start.

    A position is the length of the longest suffix of the text read so far that is a prefix
    of that stop string; it reaches the stop's length exactly where the stop string ends.
    Equality and hashing look at ``stops`` only, as the tables follow from them.
    """

    stops: tuple[str, ...]
    failures: tuple[Sequence[int], ...] = attrs.field(eq=False, repr=False)  # array("i")s

    @classmethod
    def build(cls, stops: Sequence[str]) -> StopTable:
        """Tables for ``stops`` (non-empty strings, as ``GenerationConfig`` guarantees)."""
        return cls(tuple(stops), tuple(_failure_table(s) for s in stops))

    def origin(self) -> tuple[int, ...]:
        """Every automaton's position before any text (or after a release at final)."""
        return (0,) * len(self.stops)

    def scan(self, index: int, position: int, text: str) -> tuple[int | None, int]:
        """Feed ``text`` to stop ``index``'s automaton from ``position``: the offset in ``text``
        just past the first match (then the position is the stop's length), or None and the
        position after all of ``text``."""
        stop, table = self.stops[index], self.failures[index]
        for offset, char in enumerate(text):
            position = _advance(stop, table, position, char)
            if position == len(stop):
                return offset + 1, position
        return None, position

    def feed(self, positions: Sequence[int], text: str
             ) -> tuple[tuple[int, str] | None, tuple[int, ...]]:
        """Run every automaton over ``text``. The match that completes first — the smallest
        end, and among matches ending there the longest (the earliest start) — as ``(offset
        in text just past it, stop string)``, or None; and the positions after ``text``
        (meaningless after a match, as nothing is read past one)."""
        scans = [self.scan(i, p, text) for i, p in enumerate(positions)]
        # Two matches of equal end and length are the same string, so min() never has to
        # compare further than the stop string itself.
        ends = [(end, -len(stop), stop) for (end, _), stop in zip(scans, self.stops)
                if end is not None]
        positions_after = tuple(position for _, position in scans)
        if not ends:
            return None, positions_after
        end, _, stop = min(ends)
        return (end, stop), positions_after

    def held_head(self, positions: Sequence[int], count: int) -> str:
        """The first ``count`` characters of the text ``positions`` hold back: the longest of
        the prefixes they stand for, sliced so that only what is asked for is copied."""
        longest = max(positions, default=0)
        return self.stops[positions.index(longest)][:min(count, longest)] if longest else ""


@attrs.frozen
class StopStringState:
    """The request's tables, each automaton's position, and the verdict once a stop string
    matched (after which all further text is dropped)."""

    table: StopTable
    positions: tuple[int, ...]
    stopped: StopVerdict | None = None

    @property
    def held(self) -> str:
        """The text held back, built on demand (the state stores only positions)."""
        return self.head("", max(self.positions, default=0))

    def head(self, text: str, count: int) -> str:
        """The first ``count`` characters of the held text followed by ``text``."""
        held = max(self.positions, default=0)
        return self.table.held_head(self.positions, count) + text[:max(0, count - held)]


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
        """Tables for the request's ``generation_config.stop``, every automaton at 0."""
        table = StopTable.build(request.generation_config.stop)
        return StopStringState(table, table.origin())

    def check_token(self, state: StopStringState, token_id: int,
                    generated: int) -> StopVerdict | None:
        """Never stops on a token."""
        return None

    def check_text(self, state: StopStringState, text: str, final: bool
                   ) -> tuple[StopStringState, str, StopVerdict | None]:
        """Run every automaton over ``text``; release what cannot begin a stop string."""
        if state.stopped is not None:
            return state, "", state.stopped
        if not state.table.stops:
            return state, text, None
        held = max(state.positions)
        match, positions = state.table.feed(state.positions, text)
        if match is not None:
            end, stop = match
            verdict = StopVerdict(FinishReason.STOP_STRING, stop, keep_token_text=False)
            released = state.head(text, held + end - len(stop))
            return StopStringState(state.table, state.table.origin(), verdict), released, verdict
        if final:
            positions = state.table.origin()
        released = state.head(text, held + len(text) - max(positions))
        return StopStringState(state.table, positions), released, None
