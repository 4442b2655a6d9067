"""The ``grammar`` logit processor: only tokens the request's grammar allows next survive.

Owns :class:`GrammarProcessor` and its two caches. Compiled grammars are kept per
(grammar, vocabulary width, whether the output starts as reasoning) for the tokenizer the processor was built with: a pristine
llguidance matcher, deep-copied for each request (a copy costs microseconds; a compilation
about a millisecond per small schema). A request's matcher, having consumed its output so
far, is its state (:class:`~pipeline.contracts.decode.StatefulProcessor`: the strategy starts it,
tells it each committed token and finishes it), and only a cache of a pure function of
(grammar, ``row.output_ids``): each step it is brought to the row's ids by rolling back
what the row no longer has and consuming what it has new, comparing only the ids past the
committed tokens it is known to hold (so a step does not grow with the output), and rebuilt
from nothing when that is impossible. A row with no state (a strategy that keeps none) uses
a per-stream cache of the same matchers, compared over its whole ids. So the processor stays
a function of (scores, batch), as :class:`~pipeline.contracts.decode.LogitProcessor` asks, and is
correct for batches mixing constrained and unconstrained rows, for a request whose rows come
back after preemption, and under speculative decoding, where each verified position is a row
of its own whose ids end in that position's drafts.

When the prompt ends inside an open ``<think>`` block (templates that start the model's
reasoning for it), the output is reasoning first: the grammar then allows any text up to the
first ``</think>`` and applies after it (:func:`~pipeline.grammar.after_thinking`).

A row whose ids leave the grammar (a draft the grammar forbids, seen by the verified
positions after it; or forced tokens) gets EOS only: the strategy discards a rejected
draft's row, and a committed output that broke the grammar should end rather than go on.
EOS (any of the row's EOS ids) is allowed exactly when the output is a whole sentence of the
grammar (with ``ignore_eos`` too: an EOS mid-sentence would leave the grammar).

A matcher that fails (llguidance's error state: a parser limit, as a grammar whose forced
continuation never ends reaches) is not a sentence that ended: the processor raises
:class:`~pipeline.errors.InvalidValueError` naming the request and the engine's reason, and
the engine fails the request (never an EOS that would pass a cut output off as finished).
The engine's own logging is off (``log_level=0``): the error reaches the caller instead.

Every constrained output is kept finishable within ``max_tokens`` (the budget): the row's
closing path (:mod:`stages.structured.closing`, a token sequence after which the grammar
accepts) is measured when the budget comes near it, and once the budget left would hold only
the path, its EOS and :data:`MARGIN` tokens, the path's next token is the only one allowed;
an output that accepts with no room to spare gets EOS only. So a schema whose objects stay
open or whose numbers run on still ends valid, with ``finish_reason`` ``stop``.

In a JSON output the guard of :mod:`stages.structured.guard` also removes the tokens that would
repeat a key of the open object or an item of a ``uniqueItems`` array (which the grammar
engine's copy of the schema leaves out). In a tool-call output whose calls must differ
(:attr:`~pipeline.grammar.Grammar.distinct_calls`), once a call repeats an earlier one byte
for byte only the closing path's tokens are allowed, then EOS: a model that writes the same
call again is looping, and its turn ends there (the tool-call reader drops the repeat).
:meth:`GrammarProcessor.check_request` refuses, before anything is queued, a request whose
``max_tokens`` cannot hold the closing path from its start (forced prefix included).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from pipeline.errors import InvalidValueError
from pipeline.grammar import Grammar, after_thinking
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.text import Tokenizer
from pipeline.contracts.request import GenerationConfig
from pipeline.output_parts import THINK_CLOSE, THINK_OPEN
from pipeline.room import room
from stages.structured.bitmask import allowed_mask, apply_bitmask, bitmask_words
from stages.structured.closing import Closer
from stages.structured.guard import CallRepeats, JsonGuard, JsonScan, unique_paths
from stages.structured.vocab import ll_tokenizer, token_table

MAX_COMPILED = 64
"""Compiled grammars kept (least recently used evicted)."""
MAX_TRACKS = 1024
"""Request streams whose matcher is kept between steps (least recently used evicted; an
evicted one is rebuilt from the row's ids when its request comes back)."""
MARGIN = 2
"""Tokens of slack kept beyond the closing path and its EOS (a path measured again after one
of its tokens may come out a token longer: the tokenizer's encoding of a suffix)."""
WINDOW = 32
"""The closing path is measured every step once the budget left is within this many tokens
of the last measure ..."""
RECHECK = 16
"""... and every this many tokens before that (a path may grow as the output nests)."""
GUARD_WORK = 16_000
"""Grammar checks the guard's look-ahead may make in one row's step (then the rest of the
candidates stand unchecked)."""
WORK_PER_CHECK = 4_000
"""... and for one candidate."""
FEW = 64
"""Inside a guarded string with at most this many tokens allowed, each is checked for a way
on (an enum's values can run into a dead end once one is taken)."""
RETRIES = 3
"""A failed search (the output ends inside a character's bytes, say) is tried again at each
of the next this many steps before waiting :data:`RECHECK` steps."""
CHECKED = 4
"""Structure-opening tokens checked per step near the budget (the likeliest ones)."""
STRUCTURAL = frozenset(b'{[(,;:"<\n')
"""Bytes with which a token may open a structure (an object, an array, a string, a key, a
tool-call marker, another call after ``;``) and so lengthen the closing path by more than a
token."""


class _Track:
    """One request stream's matcher: the ids it was brought to, of which the first ``valid``
    were consumed (the rest the grammar refused), and whether the matcher itself failed."""

    def __init__(self, matcher: Any, key: tuple[str, int, bool]) -> None:
        self.matcher = matcher
        self.key = key
        self.ids: list[int] = []
        self.valid = 0
        self.failed = False
        self.measured_at = -1
        """How many ids the closing path was last measured after (-1: never)."""
        self.distance: int | None = None
        """That path's length (None: the search gave up)."""
        self.jump = 0
        """The most one token has lengthened the path (measured on consecutive steps)."""
        self.misses = 0
        """Searches for the path that failed in a row (mid-character, say: tried again)."""
        self.path: tuple[list[int], int] = ([], 0)
        """The last closing path measured and how many ids preceded it: while the output
        follows it, the rest of it is the path (no new search)."""
        self.ahead: tuple[list[int], dict[int, list[int]]] = ([], {})
        """The ids of the last steered step and the closing paths found after the candidates
        checked there: the path after the token the output took is then known (only
        a search that ended within the first half of its work is kept: a search with the
        whole work finds the same)."""
        self.scan: JsonScan | None = None
        """Where a JSON output is (keys and unique items so far: :mod:`stages.structured.guard`)."""
        self.calls: CallRepeats | None = None
        """A tool-call output's calls so far (grammars with ``distinct_calls``)."""

    @property
    def broken(self) -> bool:
        """The ids left the grammar (or the matcher failed): only EOS may follow."""
        return self.failed or len(self.ids) > self.valid


class _Stream:
    """A request's grammar state, kept by its strategy: its track (None until the first
    step), how many committed tokens it has been told of, and how many of the track's
    leading ids are known to be those committed tokens."""

    def __init__(self) -> None:
        self.track: _Track | None = None
        self.committed = 0
        self.agree = 0


class GrammarProcessor:
    """``grammar``: masks every token ``row.config.grammar`` does not allow next.

    Built once per pipeline with its tokenizer; active for rows with a grammar. Not
    argmax-invariant. Raises :class:`~pipeline.errors.InvalidValueError` when a grammar row
    reaches a processor built without a tokenizer, and when the grammar engine fails on a row
    (the engine then fails that request: see the module docstring).

    Example::

        proc = GrammarProcessor(tokenizer)
        row = attrs.evolve(row, config=GenerationConfig(grammar=Grammar.json_object()))
        scores = proc(Scores(logits), Batch((row,), vocab_size=V))   # only "{" (or " {")
    """

    name: str = "grammar"
    argmax_invariant: bool = False

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tok = tokenizer
        self._table: list[bytes] | None = None
        self._ll: dict[int, Any] = {}
        self._compiled: OrderedDict[tuple[str, int, bool], Any] = OrderedDict()
        self._think: tuple[int, str] | None | bool = False   # False: not looked up yet
        self._tracks: OrderedDict[tuple[str, int], _Track] = OrderedDict()
        self._closer: Closer | None = None
        self._guard: JsonGuard | None = None
        self._commas: dict[int, torch.Tensor] = {}
        self._unique: dict[str, frozenset[tuple[str, ...]]] = {}
        self._plain_masks: dict[int, torch.Tensor] = {}
        self._plain_packed: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()   # check_request runs on callers' threads

    def active(self, row: Row) -> bool:
        """Active when the row's config has a grammar."""
        return row.config.grammar is not None

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Remove, in each grammar row, the tokens its grammar forbids next."""
        values = scores.to_dense(batch.vocab_size)              # [B, V]
        rows = [i for i, r in enumerate(batch.rows) if self.active(r)]
        bitmask = torch.zeros(len(rows), bitmask_words(values.shape[1]), dtype=torch.int32)
        for k, i in enumerate(rows):
            self._fill(batch.rows[i], values.shape[1], bitmask[k], values[i])
        if len(rows) == len(batch.rows):
            apply_bitmask(values, bitmask)
            return Scores(values)
        index = torch.tensor(rows, dtype=torch.long, device=values.device)
        sub = values.index_select(0, index)                      # [R, V]
        apply_bitmask(sub, bitmask)
        values.index_copy_(0, index, sub)
        return Scores(values)

    def _fill(self, row: Row, vocab: int, out: torch.Tensor, logits: torch.Tensor) -> None:
        """Write ``row``'s allowed next tokens into ``out`` (one int32 row of bits; ``logits``
        the row's, for steering); raises :class:`InvalidValueError` when the grammar engine
        fails on the row."""
        track = self._sync(row, vocab)
        m = track.matcher
        if not track.broken:
            m.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
            track.failed = bool(m.is_error())   # e.g. a parser limit
        if track.failed:
            self._tracks.pop((row.request_id, row.stream), None)
            stream = row.states.get(self.name)
            if isinstance(stream, _Stream):
                stream.track = None
            raise _engine_failed(row, m)
        if track.broken:
            out.zero_()
        else:
            if track.scan is not None:
                self._guard_row(row, track, out, vocab)
            if track.calls is not None and track.calls.repeated:
                self._end(row, track, out)
            else:
                self._steer(row, track, out, logits)
        accepting = track.broken or m.is_accepting() or m.is_stopped()
        for eos in row.eos_token_ids:
            if eos < vocab:
                _set_bit(out, eos, accepting)

    def _guard_row(self, row: Row, track: _Track, out: torch.Tensor, vocab: int) -> None:
        """Remove the tokens that would repeat a key or a unique item (:mod:`.guard`); where
        the open object or unique array has keys or items already and few tokens are left
        (a key's letters, an enum's values, another item), also those after which the
        closing search finds a dead end (``"admin`` when ``"admin"`` is taken and no other
        value starts so), within :data:`GUARD_WORK` grammar checks a step; and never leave
        the grammar's mask empty (the direct bans stand while anything else is left; a true
        dead end lets the guard yield)."""
        scan = track.scan
        assert scan is not None
        guard = self._json_guard()
        saved = out.clone()
        for token in guard.forbidden(scan):
            if token < vocab:
                _set_bit(out, token, False)
        direct = out.clone()
        top = scan.stack[-1] if scan.stack else None
        frame = scan.string_frame or top
        item = top is not None and top.unique and (scan.scalar is not None
                                                   or scan.string is not None)
        if frame is not None and top is not None and (frame.seen or item):
            allowed = allowed_mask(out.unsqueeze(0), vocab, torch.device("cpu"))[0]
            few = int(allowed.sum()) <= FEW
            if not (few or top.unique):
                ids = []   # many ways on, and a free key cannot dead-end
            else:
                suspects = [t for t in dict.fromkeys(guard.suspects(scan)) if t < vocab
                            and bool(allowed[t])]   # those that start a repeat go first
                if few:   # a choice among few: any may lead to a dead end
                    ids = suspects + [t for t in allowed.nonzero().flatten().tolist()
                                      if t not in suspects
                                      and (frame.seen or t in guard.commas)]
                else:   # in a unique array, those, and those ending one item and beginning
                    ids = suspects + self._with_comma(allowed)[:FEW]   # another
            if ids:
                table, closer = self._closing_table(), self._closing()
                left = GUARD_WORK
                for token in ids:
                    if left <= 0:
                        break
                    if token in row.eos_token_ids or token >= len(table):
                        continue
                    after = track.matcher.deep_copy()
                    if after.try_consume_tokens([token]) != 1 or after.is_accepting():
                        continue
                    ahead = scan.copy()
                    ahead.feed(table[token])
                    found, gave_up, spent = closer.reach(after, ahead, guard,
                                                         work=min(left, WORK_PER_CHECK))
                    left -= spent
                    if found is None and not gave_up:
                        _set_bit(out, token, False)
        if not bool(out.any()):
            out.copy_(direct if bool(direct.any()) else saved)

    def _end(self, row: Row, track: _Track, out: torch.Tensor) -> None:
        """A call repeated an earlier one: allow only the closing path's next token (none
        once the output is whole, so EOS only), so the turn ends there."""
        if track.matcher.is_accepting():
            out.zero_()
            return
        path = self._path(row, track)
        if path:
            out.zero_()
            _set_bit(out, path[0], True)

    def _path(self, row: Row, track: _Track) -> list[int] | None:
        """The closing path from the row's state: the rest of the last path measured when the
        output has followed it since (the rest of a path is a path), else a new search."""
        done = len(row.output_ids)
        last, at = track.path
        if last and 0 < done - at <= len(last) and list(row.output_ids[at:]) == last[:done - at]:
            return last[done - at:]
        before, paths = track.ahead
        if paths and row.output_ids[-1:] and row.output_ids[-1] in paths \
                and len(before) == done - 1 and list(row.output_ids[:-1]) == before:
            track.path = (paths[row.output_ids[-1]], done)
            return track.path[0]
        guard = self._json_guard() if track.scan is not None else None
        path = self._closing().path(track.matcher, track.scan, guard)
        if path is not None:
            track.path = (path, done)
        return path

    def _with_comma(self, allowed: torch.Tensor) -> list[int]:
        """The allowed tokens with a ``,`` in them (they may end one item and begin another)."""
        vocab = allowed.shape[0]
        commas = self._commas.get(vocab)
        if commas is None:
            commas = torch.zeros(vocab, dtype=torch.bool)
            ids = [t for t in self._json_guard().commas if t < vocab]
            commas[ids] = True
            self._commas[vocab] = commas
        found: list[int] = (allowed & commas).nonzero().flatten().tolist()
        return found

    def _steer(self, row: Row, track: _Track, out: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep the row finishable within ``max_tokens`` (see the module docstring): measure
        the closing path when due; with no slack left allow only its next token; with little
        slack (less than :data:`WINDOW` plus twice the largest jump of the path's length one
        token has made) allow a token that may open structure (:data:`STRUCTURAL`), or any
        token where the grammar allows at most :data:`FEW` (a key's or an enum's letters
        choose among values of different lengths), only if it is among the :data:`CHECKED`
        likeliest and the path after it still fits."""
        done = len(row.output_ids)
        budget = room(row.config.max_tokens, done)       # tokens left, this one included
        before = track.distance
        near = before is not None and budget <= before + WINDOW + 2 * track.jump
        retry = before is None and 0 < track.misses <= RETRIES   # a search that failed
        if not (near or retry or track.measured_at < 0 or done - track.measured_at >= RECHECK):
            return
        path = self._path(row, track)
        if path is not None and before is not None and track.measured_at == done - 1:
            track.jump = max(track.jump, len(path) - before + 1)
        track.measured_at, track.distance = done, None if path is None else len(path)
        track.misses = track.misses + 1 if path is None else 0
        if path is None:
            return
        slack = budget - (len(path) + 1 + MARGIN)
        if slack > WINDOW + 2 * track.jump:
            return
        if slack <= 0:
            out.zero_()
            if path:   # followed, it is reused (its rest) to its end
                _set_bit(out, path[0], True)
            return
        masked = logits.clone()
        apply_bitmask(masked.unsqueeze(0), out.unsqueeze(0))
        scan = track.scan
        few = (int(torch.isfinite(masked).sum()) <= FEW   # a choice among few: keys, enums
               or scan is None                            # not JSON: any token may jump
               or (scan.string_frame is not None and scan.string_frame.kind == "o"))  # a key
        risky = masked if few else masked.masked_fill(
            self._plain(masked.shape[0], masked.device), float("-inf"))
        top = risky.topk(min(CHECKED, risky.shape[0]))
        if few:
            out.zero_()
        else:
            out.bitwise_and_(self._plain_words(masked.shape[0]))
        if path:
            _set_bit(out, path[0], True)
        paths: dict[int, list[int]] = {}
        track.ahead = (list(row.output_ids), paths)
        for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if value == float("-inf"):
                break
            if token in row.eos_token_ids or (path and token == path[0]):
                continue   # EOS is the grammar's; the path's own next token fits
            after = track.matcher.deep_copy()
            after.consume_token(token)
            ahead = None
            if scan is not None:
                ahead = scan.copy()
                ahead.feed(self._closing_table()[token] if token < len(self._closing_table())
                           else b"")
            guard = self._json_guard() if scan is not None else None
            then, _, spent = self._closing().reach(after, ahead, guard, work=WORK_PER_CHECK)
            if then is not None and spent < WORK_PER_CHECK // 2:
                paths[token] = then   # the first search's own: what a fuller one finds
            if then is not None and len(then) + 1 + MARGIN <= budget - 1:
                _set_bit(out, token, True)

    def _plain(self, vocab: int, device: torch.device) -> torch.Tensor:
        """``[vocab]`` bool: tokens with no :data:`STRUCTURAL` byte (they cannot open a
        structure, so cannot make the closing path jump)."""
        found = self._plain_masks.get(vocab)
        if found is None:
            table = self._closing_table()
            plain = [bool(t) and not any(b in STRUCTURAL for b in t) for t in table]
            plain += [False] * (vocab - len(plain))
            found = torch.tensor(plain[:vocab], dtype=torch.bool)
            words = torch.zeros(bitmask_words(vocab) * 32, dtype=torch.int64)
            words[:vocab] = found.to(torch.int64)
            packed = (words.view(-1, 32) << torch.arange(32)).sum(1)
            self._plain_packed[vocab] = torch.where(packed >= 1 << 31, packed - (1 << 32),
                                                    packed).to(torch.int32)
            self._plain_masks[vocab] = found
        return found.to(device)

    def _plain_words(self, vocab: int) -> torch.Tensor:
        """:meth:`_plain` as packed int32 words."""
        self._plain(vocab, torch.device("cpu"))
        return self._plain_packed[vocab]

    def check_request(self, config: GenerationConfig, prompt_ids: Sequence[int]) -> None:
        """Refuse (:class:`InvalidValueError` on ``max_tokens``) a request whose grammar's
        closing path, after its forced prefix, does not fit in ``max_tokens`` with its EOS:
        no output could be whole. Nothing to check without a grammar, or when the output
        starts as reasoning (its length is the model's)."""
        grammar = config.grammar
        if grammar is None or self._tok is None or self._opens_thinking(prompt_ids):
            return
        m = self._matcher(grammar, (grammar.digest, self._tok.vocab_size, False))
        prefix = list(config.forced_prefix)
        if prefix and m.try_consume_tokens(prefix) != len(prefix):
            raise InvalidValueError(grammar.field, "(grammar)", "the forced prefix leaves it")
        key = (grammar.digest, self._tok.vocab_size, False)
        scan = self._scan(grammar, key)
        if scan is not None:
            table = self._closing_table()
            scan.feed(b"".join(table[i] if i < len(table) else b"" for i in prefix))
        path = self._closing().shortest(m, scan,
                                        self._json_guard() if scan is not None else None)
        if path is not None and room(config.max_tokens, len(prefix)) < len(path) + 1:
            raise InvalidValueError(
                "max_tokens", config.max_tokens,
                f"cannot hold any output {grammar.field} allows: the shortest this server "
                f"finds takes {len(prefix) + len(path) + 1} tokens (with the end-of-sequence "
                "token; a search's result, not a proven minimum); raise max_tokens")

    def _closing(self) -> Closer:
        if self._closer is None:
            assert self._tok is not None
            self._closer = Closer(self._tok, self._closing_table())
        return self._closer

    def _closing_table(self) -> list[bytes]:
        assert self._tok is not None
        if self._table is None:
            self._table = token_table(self._tok)
        return self._table

    # --- per-request state (StatefulProcessor) ------------------------------------------------

    def start(self, row: Row) -> _Stream:
        """A request's stream: its matcher comes at its first step."""
        return _Stream()

    def advance(self, state: _Stream, token: int) -> None:
        """A committed token: the matcher already took it when a verified position's row
        held it there (a draft accepted); otherwise the next step brings it there."""
        n = state.committed
        track = state.track
        if (track is not None and state.agree == n and n < len(track.ids)
                and track.ids[n] == token):
            state.agree += 1
        state.committed += 1

    def finish(self, state: _Stream) -> None:
        """Let the matcher go."""
        state.track = None

    def _sync(self, row: Row, vocab: int) -> _Track:
        """The row's matcher, having consumed exactly ``row.output_ids``: from the request's
        stream when the strategy keeps one (only the ids past what is known to agree are
        compared), else from the per-stream cache (the whole ids compared)."""
        grammar = row.config.grammar
        assert grammar is not None
        compiled = (grammar.digest, vocab, self._opens_thinking(row.prompt_ids))
        stream = row.states.get(self.name)
        if isinstance(stream, _Stream) and stream.committed <= len(row.output_ids):
            track, known = stream.track, stream.agree
            if track is None or track.key != compiled:
                track, known = self._fresh(grammar, compiled), 0
            stream.track = self._bring(track, row.output_ids, known, grammar, compiled)
            stream.agree = stream.committed  # the row begins with every committed token
            return stream.track
        key = (row.request_id, row.stream)
        track = self._tracks.pop(key, None)
        if track is None or track.key != compiled:
            track = self._fresh(grammar, compiled)
        track = self._bring(track, row.output_ids, 0, grammar, compiled)
        self._tracks[key] = track
        while len(self._tracks) > MAX_TRACKS:
            self._tracks.popitem(last=False)
        return track

    def _bring(self, track: _Track, ids: Sequence[int], known: int, grammar: Grammar,
               compiled: tuple[str, int, bool]) -> _Track:
        """``track`` brought to ``ids`` (its first ``known`` ids are known to agree): roll
        back what ``ids`` no longer has, consume what it has new (a fresh track when the
        matcher cannot roll back that far)."""
        common = known + _common_prefix(track.ids[known:], ids[known:])
        if track.failed or (common < track.valid
                            and not track.matcher.rollback(track.valid - common)):
            track, common = self._fresh(grammar, compiled), 0
        track.valid = min(track.valid, common)
        if common < len(track.ids) and (track.scan is not None or track.calls is not None):
            track.scan = self._scan(grammar, compiled)   # went back: scan again
            track.calls = self._calls(grammar, compiled)
            self._feed(track, track.ids[:common])
        del track.ids[common:]
        self._consume(track, ids[common:])
        return track

    def _consume(self, track: _Track, new: Sequence[int]) -> None:
        """Extend ``track`` by ``new``: the matcher takes what the grammar allows of it, up
        to the first refused id; ids after a refused one are only recorded."""
        if new and not track.broken:
            track.valid += track.matcher.try_consume_tokens(list(new))
            track.failed = bool(track.matcher.is_error())
        self._feed(track, new)
        track.ids.extend(new)

    def _feed(self, track: _Track, ids: Sequence[int]) -> None:
        """Feed ``ids``' bytes to the track's JSON scan and call record (those it has)."""
        if ids and (track.scan is not None or track.calls is not None):
            table = self._closing_table()
            data = b"".join(table[i] if i < len(table) else b"" for i in ids)
            if track.scan is not None:
                track.scan.feed(data)
            if track.calls is not None:
                track.calls.feed(data)

    def _fresh(self, grammar: Grammar, key: tuple[str, int, bool]) -> _Track:
        track = _Track(self._matcher(grammar, key), key)
        track.scan = self._scan(grammar, key)
        track.calls = self._calls(grammar, key)
        return track

    def _calls(self, grammar: Grammar, key: tuple[str, int, bool]) -> CallRepeats | None:
        """A fresh call record for a grammar whose calls must differ (None for others)."""
        if not grammar.distinct_calls:
            return None
        close = self._think[1] if key[2] and isinstance(self._think, tuple) else ""
        return CallRepeats(close.encode())

    def _scan(self, grammar: Grammar, key: tuple[str, int, bool]) -> JsonScan | None:
        """A fresh JSON scan for a JSON grammar's output (None for other grammars, and for an
        output that starts as reasoning)."""
        if grammar.kind not in ("json_schema", "json_object") or key[2]:
            return None
        with self._lock:
            unique = self._unique.get(grammar.digest)
            if unique is None:
                unique = (unique_paths(json.loads(grammar.source))
                          if grammar.kind == "json_schema" else frozenset())
                self._unique[grammar.digest] = unique
                while len(self._unique) > MAX_COMPILED:
                    self._unique.pop(next(iter(self._unique)))
        return JsonScan(unique)

    def _json_guard(self) -> JsonGuard:
        if self._guard is None:
            self._guard = JsonGuard(self._closing_table())
        return self._guard

    def _matcher(self, grammar: Grammar, key: tuple[str, int, bool]) -> Any:
        """A fresh copy of the compiled matcher of ``grammar`` at vocabulary width ``key[1]``,
        after a reasoning block when ``key[2]``."""
        with self._lock:
            return self._matcher_locked(grammar, key).deep_copy()

    def _matcher_locked(self, grammar: Grammar, key: tuple[str, int, bool]) -> Any:
        found = self._compiled.pop(key, None)
        if found is None:
            source = grammar.engine_source()
            if key[2]:
                assert isinstance(self._think, tuple)
                source = after_thinking(source, self._think[1])
            found = llguidance.LLMatcher(self._ll_tokenizer(key[1]), source, log_level=0)
            if found.is_error():
                raise InvalidValueError(grammar.field, "(grammar)",
                                        f"is not supported here: {found.get_error()}")
        self._compiled[key] = found
        while len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return found

    def _opens_thinking(self, prompt: Sequence[int]) -> bool:
        """Whether ``prompt`` ends in an open ``<think>`` (then blank tokens): the output
        starts as reasoning, which the grammar leaves free up to ``</think>``."""
        if self._think is False:
            self._think = self._think_markers()
        if not isinstance(self._think, tuple):
            return False
        assert self._tok is not None
        for token in reversed(prompt[-8:]):
            if token == self._think[0]:
                return True
            if token >= self._tok.vocab_size or self._tok.token_bytes(token).strip():
                return False
        return False

    def _think_markers(self) -> tuple[int, str] | None:
        """The ``<think>`` id and the closing marker's text, when ``<think>`` is one token."""
        if self._tok is None:
            return None
        ids = self._tok.encode_text(THINK_OPEN, special=True)
        return (ids[0], THINK_CLOSE) if len(ids) == 1 else None

    def _ll_tokenizer(self, vocab: int) -> Any:
        if self._tok is None:
            raise InvalidValueError("grammar", "(grammar)",
                                    "needs a pipeline with a tokenizer")
        if vocab not in self._ll:
            if self._table is None:
                self._table = token_table(self._tok)
            self._ll[vocab] = ll_tokenizer(self._tok, self._table, n_vocab=vocab)
        return self._ll[vocab]


def _engine_failed(row: Row, matcher: Any) -> InvalidValueError:
    """The error for a row whose matcher failed: the grammar's field, the request, how far
    its output had come and the engine's reason (its first line; the rest is a dump of the
    parser's state)."""
    grammar = row.config.grammar
    assert grammar is not None
    reason = (str(matcher.get_error()).strip().splitlines() or ["no reason given"])[0]
    return InvalidValueError(grammar.field, "(grammar)",
                             f"the grammar engine failed on request {row.request_id!r} after "
                             f"{len(row.output_ids)} output tokens: {reason}")


def _common_prefix(a: list[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (the usual case, ``b`` extends ``a``, is one
    list comparison)."""
    if len(b) >= len(a) and list(b[:len(a)]) == a:
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    word, bit = divmod(token, 32)
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if on else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value
