"""What a grammar cannot say about JSON: no key twice in an object, no item twice in a unique
array, no tool call twice in one output.

Owns :class:`JsonGuard` (per tokenizer: which tokens would complete a given key or item),
:class:`JsonScan` (per output: where in the JSON the output is, the keys each open object has,
the items each open ``uniqueItems`` array has) and :class:`CallRepeats` (per tool-call output:
whether a call has repeated an earlier one, byte for byte). The grammar processor applies it to outputs of
``json_schema`` and ``json_object`` grammars: each step, the tokens that would finish a key the
object already has, or a string or number item the unique array already has, are removed from
what the grammar allows. A context-free grammar cannot compare two keys, so an open object
(``additionalProperties`` not false) would otherwise allow ``{"a": 1, "a": 2, "a": 3, ...}``
until ``max_tokens``; JSON objects should not repeat names (RFC 8259), and a schema's
``uniqueItems`` is taken out of the engine's copy of the schema
(:func:`pipeline.schema_compat.without_unique`) and enforced here instead.

What is compared is the text as written (the output's layout is fixed, so equal strings and
numbers are written alike). An object or array item of a unique array is compared whole: the
tokens that would close it as the text of an earlier item are removed (objects equal but
written with their keys in another order, or numbers equal in value but not in text, are not
told apart).
Unique arrays are found by their place in the output (property names and array positions, an
additional property matching any name), the union over ``anyOf``/``oneOf`` branches: an
array is kept unique wherever some branch asks for it (a unique array is valid either way).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

ANY = "\0*"
"""A path step matching any array position or any additional property's name."""
_SPACE = b" \t\n\r"
_END = b" \t\n\r,]}"


class JsonGuard:
    """Token lookups over one vocabulary (``table``: every id's bytes), built once.

    ``closing[text]``: the tokens that begin with ``text`` and then a ``"`` (they finish a
    string whose rest is ``text``); ``whole[text]``: tokens that are blank or ``,`` then a whole
    string ``"text"``; ``ending[text]``: tokens that are ``text`` then a ``,``, ``]`` or ``}``
    (they finish a number or literal)."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self._table = table
        self._sorted: list[tuple[bytes, int]] | None = None   # for prefix look-ups
        self._enders: list[int] | None = None   # tokens that may end a number
        self._longest = max((len(t) for t in table), default=0)
        self.closing: dict[bytes, list[int]] = {}
        self.whole: dict[bytes, list[int]] = {}
        self.ending: dict[bytes, list[int]] = {}
        self.exact: dict[bytes, list[int]] = {}
        self.commas: set[int] = set()
        """Tokens with a ``,`` in them (they may end one item or value and begin another)."""
        for token, text in enumerate(table):
            if text:
                self.exact.setdefault(text, []).append(token)
            if b"," in text:
                self.commas.add(token)
            quote = text.find(b'"')
            if quote >= 0 and b"\\" not in text[:quote]:
                self.closing.setdefault(text[:quote], []).append(token)
                lead = text[:quote].lstrip(_SPACE + b",")
                if not lead:
                    second = text.find(b'"', quote + 1)
                    if second > 0 and b"\\" not in text[quote + 1:second]:
                        self.whole.setdefault(text[quote + 1:second], []).append(token)
            ends = [at for at in (text.find(b","), text.find(b"]"), text.find(b"}")) if at >= 0]
            if ends:
                self.ending.setdefault(text[:min(ends)], []).append(token)

    def starting(self, text: bytes) -> list[int]:
        """The tokens whose bytes begin with ``text``."""
        if self._sorted is None:
            self._sorted = sorted((t, i) for i, t in enumerate(self._table) if t)
        at = bisect.bisect_left(self._sorted, (text, -1))
        out: list[int] = []
        while at < len(self._sorted) and self._sorted[at][0].startswith(text):
            out.append(self._sorted[at][1])
            at += 1
        return out

    def _composite(self, scan: JsonScan) -> list[int]:
        """Inside an object or array item of a unique array: the tokens that would close it
        as an item the array has already: its text (a whole item's text ends where the item
        does, so a token that completes that text closes a repeat), or, outside a string,
        its text with each number's trailing fraction zeros dropped (``1.0`` is ``1``)."""
        out: list[int] = []
        for frame in scan.stack[:-1]:
            if not frame.unique or not frame.seen:
                continue
            current = bytes(scan.text[frame.start:]).lstrip(_SPACE)
            for earlier in frame.seen:
                rest = earlier[len(current):]
                if earlier.startswith(current) and 0 < len(rest) <= self._longest:
                    out += self.starting(rest)
            number = bytes(scan.scalar) if scan.scalar is not None else b""
            if scan.string is None and current.endswith(number):
                out += self._by_value(current, number, frame.seen)
        return out

    def _by_value(self, current: bytes, number: bytes, seen: Sequence[bytes]) -> list[int]:
        """The tokens after which ``current`` (ending in ``number``, the open number, or
        b"" outside one) reads as one of ``seen`` with numbers compared by value."""
        lead = _numbers_trimmed(current[:len(current) - len(number)])
        now = lead + _numbers_trimmed(number)
        near = [e[len(lead):] for e in map(_numbers_trimmed, seen)
                if e.startswith(now) and len(e) - len(now) <= self._longest + 1]
        if not near:
            return []
        if self._enders is None:
            self._enders = [i for i, t in enumerate(self._table)
                            if any(b in _END for b in t)]
        return [i for i in self._enders   # the number's end, by value, then the rest
                if any(_numbers_trimmed(number + self._table[i]).startswith(e) for e in near)]

    def suspects(self, scan: JsonScan) -> list[int]:
        """Where a key or an item is about to begin: the tokens that write the start of one
        the open object or unique array has already (``0`` in ``[0, 1, ``), which may lead
        where the only way on repeats it (the look-ahead's candidates when many are
        allowed)."""
        if not scan.stack or scan.string is not None or scan.scalar is not None:
            return []
        out: list[int] = []
        for earlier in scan.stack[-1].seen:
            for end in range(1, min(len(earlier), 12) + 1):
                for lead in (b"", b" ", b", "):
                    out += self.exact.get(lead + earlier[:end], [])
        return out

    def forbidden(self, scan: JsonScan) -> list[int]:
        """The tokens that would repeat a key or a unique item where ``scan`` stands."""
        if not scan.stack:
            return []
        frame = scan.stack[-1]
        out: list[int] = self._composite(scan)
        seen = frame.seen
        if not seen:
            return out
        if scan.string is not None and scan.string_frame is frame:
            current = bytes(scan.string)
            for earlier in seen:
                if earlier.startswith(b'"') and earlier[1:-1].startswith(current):
                    out += self.closing.get(earlier[1 + len(current):-1], [])
        elif scan.scalar is not None and frame.kind == "a":
            current = bytes(scan.scalar)
            value = _number(current)
            for earlier in seen:
                if earlier.startswith(current) and not earlier.startswith(b'"'):
                    out += self.ending.get(earlier[len(current):], [])
                if value is not None and _number(earlier) == value:   # -0 and 0, 1 and 1.0
                    out += self.ending.get(b"", [])
        elif scan.string is None and (frame.kind == "o" and (
                scan.scalar is not None or frame.expect in ("key", "comma"))
                or frame.kind == "a" and scan.scalar is None and frame.expect in ("value",
                                                                                  "comma")):
            for earlier in seen:
                if earlier.startswith(b'"'):
                    out += self.whole.get(earlier[1:-1], [])
        return out


class _Frame:
    __slots__ = ("kind", "path", "seen", "expect", "start", "key", "unique")

    def __init__(self, kind: str, path: tuple[str, ...], start: int, unique: bool) -> None:
        self.kind = kind              # "o" object, "a" array
        self.path = path
        self.seen: list[bytes] = []   # an object's keys / a unique array's items, as written
        self.expect = "key" if kind == "o" else "value"
        self.start = start            # where the array's current item began
        self.key = ""
        self.unique = unique

    def copy(self) -> _Frame:
        other = _Frame.__new__(_Frame)
        other.kind, other.path, other.seen = self.kind, self.path, list(self.seen)
        other.expect, other.start, other.key = self.expect, self.start, self.key
        other.unique = self.unique
        return other


class JsonScan:
    """Where an output is in its JSON, fed the output's bytes as they come. ``unique`` holds
    the paths (tuples of property names, :data:`ANY` for an array position or any name) of
    the arrays whose items must differ."""

    def __init__(self, unique: frozenset[tuple[str, ...]] = frozenset()) -> None:
        self.unique = unique
        self.text = bytearray()
        self.stack: list[_Frame] = []
        self.string: bytearray | None = None     # the open string's content so far
        self.string_frame: _Frame | None = None  # whose key or item it is (None: neither)
        self.escaped = False
        self.scalar: bytearray | None = None     # the open number or literal so far

    def copy(self) -> JsonScan:
        """An independent copy, as ``copy.deepcopy`` makes but without its per-object
        bookkeeping (the closing search copies a scan for every character it tries)."""
        other = JsonScan.__new__(JsonScan)
        other.unique, other.text = self.unique, bytearray(self.text)
        other.stack = [frame.copy() for frame in self.stack]
        other.string = None if self.string is None else bytearray(self.string)
        other.string_frame = None
        if self.string_frame is not None:   # a frame of the stack: its copy
            at = next(i for i, f in enumerate(self.stack) if f is self.string_frame)
            other.string_frame = other.stack[at]
        other.escaped = self.escaped
        other.scalar = None if self.scalar is None else bytearray(self.scalar)
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> JsonScan:
        return self.copy()

    def feed(self, data: bytes) -> None:
        """Read more of the output."""
        for byte in data:
            self._byte(byte)

    def _byte(self, c: int) -> None:
        at = len(self.text)
        self.text.append(c)
        if self.string is not None:
            if self.escaped:
                self.escaped = False
            elif c == 0x5C:   # backslash
                self.escaped = True
            elif c == 0x22:   # the closing quote
                self._string_done()
                return
            self.string.append(c)
            return
        if self.scalar is not None:
            if c not in _END:
                self.scalar.append(c)
                return
            self.scalar = None
            self._value_done()
        top = self.stack[-1] if self.stack else None
        if c in _SPACE:
            return
        if c == 0x7B or c == 0x5B:   # { [
            kind = "o" if c == 0x7B else "a"
            path = self._child_path(top)
            unique = kind == "a" and _matches(path, self.unique)
            self.stack.append(_Frame(kind, path, at + 1, unique))
        elif c == 0x22:
            self.string = bytearray()
            is_key = top is not None and top.kind == "o" and top.expect == "key"
            item = top is not None and top.kind == "a" and top.unique
            self.string_frame = top if (is_key or item) else None
        elif c == 0x3A and top is not None:   # :
            top.expect = "value"
        elif c == 0x2C and top is not None:   # ,
            if top.kind == "a":
                self._item_done(top, at)
                top.start, top.expect = at + 1, "value"
            else:
                top.expect = "key"
        elif (c == 0x5D or c == 0x7D) and top is not None:   # ] }
            if top.kind == "a":
                self._item_done(top, at)
            self.stack.pop()
            self._value_done()
        else:
            self.scalar = bytearray([c])

    def _child_path(self, top: _Frame | None) -> tuple[str, ...]:
        if top is None:
            return ()
        return top.path + ((top.key,) if top.kind == "o" else (ANY,))

    def _string_done(self) -> None:
        assert self.string is not None
        content, self.string, self.string_frame = bytes(self.string), None, None
        top = self.stack[-1] if self.stack else None
        if top is not None and top.kind == "o" and top.expect == "key":
            top.seen.append(b'"' + content + b'"')
            top.key = content.decode("utf-8", "replace")
            top.expect = "colon"
            return
        self._value_done()

    def _value_done(self) -> None:
        if self.stack:
            self.stack[-1].expect = "comma"

    def _item_done(self, frame: _Frame, at: int) -> None:
        if frame.unique:
            item = bytes(self.text[frame.start:at]).strip(_SPACE)
            if item:
                frame.seen.append(item)


class CallRepeats:
    """The calls of a tool-call output (a grammar with
    :attr:`~pipeline.grammar.Grammar.distinct_calls`), fed its bytes as they come: a call is a
    JSON object at the top level or an item of a top-level array (the forms of every
    format's calls; markup between them holds no quote or brace), and ``repeated`` is set
    once one closes whose text equals an earlier one's. ``after``: bytes before which
    nothing is read (``</think>`` when the output starts as reasoning)."""

    def __init__(self, after: bytes = b"") -> None:
        self.repeated = False
        self._after = after
        self._seen = bytearray()    # the output before ``after`` (to find it)
        self._stack = bytearray()   # open brackets: ``{`` or ``[``
        self._string = False
        self._escaped = False
        self._call: bytearray | None = None   # the open call's text
        self._depth = 0                       # the stack's height outside the open call
        self._calls: set[bytes] = set()

    def feed(self, data: bytes) -> None:
        """Read more of the output."""
        if self._after:
            self._seen += data
            at = self._seen.find(self._after)
            if at < 0:
                return
            data, self._after = bytes(self._seen[at + len(self._after):]), b""
        for byte in data:
            self._byte(byte)

    def _byte(self, c: int) -> None:
        if self._call is not None:
            self._call.append(c)
        if self._string:
            if self._escaped:
                self._escaped = False
            elif c == 0x5C:   # backslash
                self._escaped = True
            elif c == 0x22:
                self._string = False
        elif c == 0x22 and self._stack:
            self._string = True
        elif c == 0x7B or c == 0x5B:   # { [
            if c == 0x7B and self._call is None and bytes(self._stack) in (b"", b"["):
                self._call, self._depth = bytearray(b"{"), len(self._stack)
            self._stack.append(c)
        elif (c == 0x7D or c == 0x5D) and self._stack:   # } ]
            self._stack.pop()
            if self._call is not None and len(self._stack) == self._depth:
                call, self._call = bytes(self._call), None
                self.repeated = self.repeated or call in self._calls
                self._calls.add(call)


def _numbers_trimmed(text: bytes) -> bytes:
    """JSON ``text`` (maybe cut short) with each number's trailing fraction zeros, and then a
    bare point, dropped outside strings (``1.50`` is ``1.5``, ``1.0`` is ``1``)."""
    out = bytearray()
    run = bytearray()
    string = escaped = False
    for c in text + b" ":
        if string:
            out.append(c)
            string = escaped or c != 0x22
            escaped = not escaped and c == 0x5C
            continue
        if c in b"-+.0123456789eE":
            run.append(c)
            continue
        if run:
            if b"." in run and not (b"e" in run or b"E" in run):
                run = bytearray(run.rstrip(b"0").rstrip(b"."))
            out += run
            run = bytearray()
        out.append(c)
        string = c == 0x22
    return bytes(out[:-1])


def _number(text: bytes) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _matches(path: tuple[str, ...], patterns: frozenset[tuple[str, ...]]) -> bool:
    return any(len(p) == len(path) and all(a == b or a == ANY for a, b in zip(p, path,
                                                                             strict=True))
               for p in patterns)


def unique_paths(schema: Any) -> frozenset[tuple[str, ...]]:
    """The output paths of the arrays ``schema`` marks ``uniqueItems`` (see the module
    docstring), following local references (``$ref``)."""
    from pipeline.schema_compat import resolve_pointer

    found: set[tuple[str, ...]] = set()
    visiting: set[tuple[int, tuple[str, ...]]] = set()

    def walk(node: Any, path: tuple[str, ...], depth: int) -> None:
        if not isinstance(node, Mapping) or depth > 32 or (id(node), path) in visiting:
            return
        visiting.add((id(node), path))
        if node.get("uniqueItems") is True:
            found.add(path)
        ref = node.get("$ref")
        if isinstance(ref, str):
            walk(resolve_pointer(schema, ref), path, depth + 1)
        for word in ("allOf", "anyOf", "oneOf"):
            for branch in node.get(word) or ():
                walk(branch, path, depth + 1)
        for word in ("then", "else", "not"):
            walk(node.get(word), path, depth + 1)
        for name, sub in (node.get("properties") or {}).items():
            walk(sub, (*path, name), depth + 1)
        for sub in (node.get("patternProperties") or {}).values():
            walk(sub, (*path, ANY), depth + 1)
        walk(node.get("additionalProperties"), (*path, ANY), depth + 1)
        for sub in (node.get("dependentSchemas") or {}).values():
            walk(sub, path, depth + 1)
        walk(node.get("items"), (*path, ANY), depth + 1)
        for sub in node.get("prefixItems") or ():
            walk(sub, (*path, ANY), depth + 1)

    walk(schema, (), 0)
    return frozenset(found)
