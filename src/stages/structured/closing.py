"""The closing path: a short way from where an output is to a whole sentence of its grammar.

Owns :class:`Closer`, which finds, for a grammar matcher in any state, a token sequence that
completes the output (the matcher then accepts, so EOS may follow). The grammar processor uses
it to keep every constrained output finishable within ``max_tokens``: it forces the path's
first token whenever the budget left would no longer hold the path (so the output steers to a
valid end instead of being cut), and refuses a request whose budget cannot hold even the
path from the start.

The search is greedy and deterministic, not a shortest-path search: the matcher state has no
identity to search over. At each state it takes the tokens the grammar forces (llguidance's
fast-forward tokens), else the first single-character token the grammar allows in an order
that closes structures first (``"`` ``}`` ``]`` ``)`` ``>``, then ``,`` ``0`` ``:`` ``.`` ``-`` and the
letters of ``null``/``true``/``false``, then the rest of printable ASCII), a character chosen
three times in a row moving to the back so a pattern such as ``^a+b$`` ends; when that search
does not close (within :data:`MAX_PATH` tokens and half its work budget), a second one takes
the least-used character first (an e-mail address needs its ``@``). In both, where a quote is not allowed, runs of
up to three characters of :data:`LOOKAHEAD` are tried for the shortest after which one is (a
string with a format or a pattern closes sooner), and its first character goes first. The path found is
then re-encoded by the tokenizer (fewer tokens: ``"0001-01-01"`` is not ten tokens) when the
matcher accepts that encoding. It is a valid completion, and an upper bound on the shortest
one measured in the same tokens; a second search that does not end within :data:`MAX_PATH`
tokens gives None (the processor then does not steer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.contracts.text import Tokenizer
from stages.structured.guard import JsonGuard, JsonScan

MAX_PATH = 768
"""Tokens a search may take before it gives up (a grammar whose greedy path never closes;
each search also has half of a :data:`WORK` budget)."""
ORDER = '"}])>,0:.-1 tfnaelorus'
"""Characters tried first, structure-closing ones before the rest of printable ASCII."""
CLOSERS = '"}])>'
"""Characters that end a structure: first in both searches."""
LOOKAHEAD = "0aA@.-:/_ +"
"""Characters tried in runs of up to three when a quote is not allowed, for the shortest run
after which one is (formats and patterns: ``0@A`` closes an e-mail address)."""
RUN = 3
CAP = 8
"""A character chosen this many times in a row is tried last at the next step."""


WORK = 20_000
"""Grammar checks (token validations) one search may make before it gives up: a path of a
few hundred tokens with look-ahead fits; a schema built to make the search crawl does not
hold the engine thread (tens of milliseconds at most)."""


class _GaveUp(Exception):
    """The search's work ran out."""


class _Work:
    """The grammar checks a search has left."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.long = False   # a search stopped at its length limit

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise _GaveUp


class Closer:
    """Closing paths over one tokenizer's vocabulary (``table``: every id's bytes).

    Example::

        closer = Closer(tokenizer, table)
        path = closer.path(matcher)     # token ids after which matcher.is_accepting()
    """

    def __init__(self, tokenizer: Tokenizer, table: Sequence[bytes]) -> None:
        self._tok = tokenizer
        chars: dict[str, int] = {}
        for token, text in enumerate(table):
            if len(text) == 1 and 32 <= text[0] < 127:
                chars.setdefault(chr(text[0]), token)
        first = [c for c in ORDER if c in chars]
        self._order = [(c, chars[c]) for c in first + sorted(set(chars) - set(first))]
        self._chars = chars
        self._table = table

    def path(self, matcher: Any, scan: JsonScan | None = None,
             guard: JsonGuard | None = None, *, work: int = WORK) -> list[int] | None:
        """Token ids that take ``matcher`` (left unchanged) to an accepting state; ``[]``
        when it accepts already; None when none was found (a dead end, or the search gave up:
        :meth:`reach` tells them apart). With a JSON ``scan`` of the output and its
        ``guard``, the path repeats no key and no unique item either (a character that leads
        where nothing may follow is taken back and the next one tried). ``work`` bounds the
        grammar checks the search may make."""
        return self.reach(matcher, scan, guard, work=work)[0]

    def reach(self, matcher: Any, scan: JsonScan | None = None,
              guard: JsonGuard | None = None, *, work: int = WORK
              ) -> tuple[list[int] | None, bool, int]:
        """:meth:`path`, whether the search gave up (its ``work`` ran out, or its length
        limit) rather than found a dead end, and the work it spent."""
        gave_up, spent = False, 0
        for fresh in (False, True):   # each search with half the work
            budget = _Work(work // 2)
            try:
                found = self._search(matcher, scan, guard, fresh, budget)
            except _GaveUp:
                gave_up, spent = True, spent + work // 2
                continue
            spent += work // 2 - budget.left
            if found is not None:
                return self._shorter(matcher, found), False, spent
            gave_up = gave_up or budget.long
        return None, gave_up, spent

    def shortest(self, matcher: Any, scan: JsonScan | None = None,
                 guard: JsonGuard | None = None, *, work: int = 4 * WORK
                 ) -> list[int] | None:
        """The shorter of both searches' paths (None when neither finds one): for the
        refusal of a budget, where a longer path than needed would refuse a request that
        fits."""
        found = []
        for fresh in (False, True):
            try:
                path = self._search(matcher, scan, guard, fresh, _Work(work // 2))
            except _GaveUp:
                continue
            if path is not None:
                found.append(self._shorter(matcher, path))
        return min(found, key=len) if found else None

    def _search(self, matcher: Any, scan: JsonScan | None, guard: JsonGuard | None,
                fresh: bool, work: _Work) -> list[int] | None:
        """One greedy search: the order of :data:`ORDER` (``fresh`` False), or :data:`CLOSERS`
        (each but ``"`` until used :data:`CAP` times since the last ``"``) then the character
        used least so far, :data:`LOOKAHEAD`'s before the others (``fresh``:
        the second try, for a pattern the first order loops in, as an e-mail address's ``@``
        that comes after the letters, or the spaces of a cron line)."""
        m = matcher.deep_copy()
        scan = scan.copy() if scan is not None and guard is not None else None
        path: list[int] = []
        last, run = "", 0
        look = True
        used: dict[str, int] | None = {} if fresh else None
        limit = MAX_PATH
        while not m.is_accepting():
            if len(path) >= limit:
                work.long = True
                return None
            if m.is_error() or m.is_stopped():
                return None
            forced = list(m.compute_ff_tokens())
            work.spend(1)
            if forced:
                if scan is not None and guard is not None \
                        and forced[0] in guard.forbidden(scan):
                    return None   # the grammar's only way on repeats a key or an item
                if m.try_consume_tokens(forced[:1]) == 1:
                    path.append(forced[0])
                    self._feed(scan, forced[:1])
                    last, run = "", 0
                    look = look or b'"' in self._table[forced[0]] if forced[0] < len(
                        self._table) else look
                    continue
            pick = self._step(m, last if run >= RUN else "", scan, guard, used, work,
                              look)
            if pick is None:
                return None
            char, token, scan, found = pick
            look = found or char == '"'   # a failed look-ahead is not tried again in a string
            path.append(token)
            run = run + 1 if char == last else 1
            last = char
            if used is not None:
                used[char] = used.get(char, 0) + 1
                if char == '"':   # a string ended or began: the closers' caps start again
                    for closer in CLOSERS[1:]:
                        used.pop(closer, None)
        return path

    def _step(self, m: Any, tired: str, scan: JsonScan | None, guard: JsonGuard | None,
              used: dict[str, int] | None, work: _Work, look: bool
              ) -> tuple[str, int, JsonScan | None, bool] | None:
        """Consume the first allowed single-character token (``tired``, if any, tried last;
        with ``used``, the least used first) that the guard allows and after which something
        may follow; returns it and the scan after it."""
        banned = set(guard.forbidden(scan)) if guard is not None and scan is not None else set()
        order = [c for c in self._order if c[0] != tired] + [c for c in self._order
                                                              if c[0] == tired]
        if used is not None:   # closers first (until each was used RUN times), then the
            order.sort(key=lambda c: (   # rest, least used first, LOOKAHEAD's first
                c[0] not in CLOSERS or c[0] == tired or used.get(c[0], 0) >= CAP,
                c[0] not in LOOKAHEAD, used.get(c[0], 0)))
        quote = self._chars.get('"')
        found = look   # whether a look-ahead may still help in this string
        if look and quote is not None and (quote in banned or m.validate_tokens([quote]) != 1):
            toward = self._toward_closer(m, quote, work)
            found = toward is not None
            if toward is not None:
                order = [toward, *order]
        for char, token in order:
            work.spend(1)
            if token in banned or m.validate_tokens([token]) != 1:
                continue
            if scan is None:
                m.consume_token(token)
                return char, token, None, found
            after = scan.copy()
            self._feed(after, [token])
            m.consume_token(token)
            if m.is_accepting() or self.can_continue(m, after, guard, work):
                return char, token, after, found
            m.rollback(1)
        return None

    def _toward_closer(self, m: Any, quote: int, work: _Work) -> tuple[str, int] | None:
        """The first character of the shortest run of :data:`LOOKAHEAD` characters (at most
        three) after which a quote is allowed, if there is one (checked without consuming:
        an e-mail address is ``0@A`` before its closing quote)."""
        closers = [quote]
        alphabet = [(c, self._chars[c]) for c in LOOKAHEAD if c in self._chars]
        runs: list[list[tuple[str, int]]] = [[]]
        for _ in range(3):
            longer = []
            for run in runs:
                for pair in alphabet:
                    tokens = [t for _, t in run] + [pair[1]]
                    work.spend(2)
                    if m.validate_tokens(tokens) != len(tokens):
                        continue
                    if any(m.validate_tokens([*tokens, c]) == len(tokens) + 1 for c in closers):
                        return (run + [pair])[0]
                    longer.append(run + [pair])
            runs = longer
        return None

    def can_continue(self, m: Any, scan: JsonScan, guard: JsonGuard | None,
                     work: _Work | None = None) -> bool:
        """Whether some token may follow in ``m`` that the guard allows at ``scan`` (the
        grammar's forced token, or a single character); each check spends ``work``."""
        banned = set(guard.forbidden(scan)) if guard is not None else set()
        forced = m.compute_ff_tokens()
        if forced:
            return forced[0] not in banned
        for _, token in self._order:
            if work is not None:
                work.spend(1)
            if token not in banned and m.validate_tokens([token]) == 1:
                return True
        return False

    def _feed(self, scan: JsonScan | None, tokens: Sequence[int]) -> None:
        if scan is not None:
            scan.feed(b"".join(self._table[t] if t < len(self._table) else b""
                               for t in tokens))

    def _shorter(self, matcher: Any, path: list[int]) -> list[int]:
        """``path``'s text as the tokenizer encodes it, when that is shorter and the matcher
        takes all of it to an accepting state; else ``path``."""
        if len(path) < 2:
            return path
        text = self._tok.decode(path, skip_special_tokens=False)
        try:
            encoded = self._tok.encode_text(text)
        except Exception:  # a tokenizer that cannot encode its own text: keep the path
            return path
        if len(encoded) >= len(path) or matcher.validate_tokens(encoded) != len(encoded):
            return path
        m = matcher.deep_copy()
        m.consume_tokens(encoded)
        return encoded if m.is_accepting() else path
