"""Reading JSON request bodies: typed field access that names the field in every error.

Owns :func:`parse_json` (bytes → a JSON value; malformed JSON, ``NaN`` and ``Infinity``, a
key given twice in one object (at any depth: JSON leaves which one counts undefined, so a
proxy that reads the first would judge another request than the one served), a lone UTF-16
surrogate in any string or key, and nesting deeper than ``max_depth`` are errors: text is
checked once, here at the door) and :class:`Obj`, a view of one JSON object whose getters
check type and range and record which keys were read, so :meth:`Obj.done` can reject every key
nobody asked for. Every error is an :class:`~pipeline.errors.InvalidValueError` or
:class:`~pipeline.errors.UnknownFieldError` whose field is the JSON path
(``messages[2].content``), which the transport turns into a 400.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.errors import InvalidValueError, LimitExceededError, UnknownFieldError, brief
from pipeline.contracts.request import unicode_error

MAX_DEPTH = 64
# A surrogate can only enter a decoded string through a \uD800-\uDFFF escape (strict UTF-8
# decoding refuses encoded surrogates), so bodies without one skip the string check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}
_MISSING = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


class _DuplicateKey(Exception):
    """A JSON object of the body holds ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _repeat(pairs: list[tuple[str, Any]]) -> str | None:
    """The first key of a JSON object's members given a second time, if any."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members as a dict, unless a key repeats: JSON leaves which one counts
    undefined, and Python keeps the last where a proxy in front may keep the first, and judge
    another request than the one served."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey(_repeat(pairs) or "")
    return obj


class _Repeated(dict[str, Any]):
    """An object that held ``key`` twice (built only to say where, after a refusal)."""

    key = ""


def _marking(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    marked = _Repeated(obj)
    marked.key = _repeat(pairs) or ""
    return marked


def _duplicate(text: str, key: str) -> InvalidValueError:
    """The 400 for a body known to repeat ``key`` somewhere, naming a repeated key's JSON
    path (a second parse, on this error only, finds where)."""
    field = _ascii(key)
    try:
        value = json.loads(text, object_pairs_hook=_marking, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # too deep to walk: the key alone
        value = None
    path, holder = _find(value, lambda item, _: isinstance(item, _Repeated))
    if isinstance(holder, _Repeated):
        key, field = holder.key, _ascii(holder.key)
        field = f"{path}.{field}" if path != "body" else field
    return InvalidValueError(field, key, "is given twice in one JSON object; each key may "
                             "appear once (which one counts would be ambiguous)")


def parse_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Decode a request body; anything but strict UTF-8 JSON of valid Unicode text, nested
    at most ``max_depth`` deep, each object's keys distinct, is a 400 naming where."""
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique)
    except _DuplicateKey as exc:
        raise _duplicate(text, exc.key) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidValueError("body", raw[:80].decode("utf-8", "replace"),
                                f"malformed JSON: {exc}") from None
    _check_tree(value, max_depth, _SURROGATE_ESCAPE.search(raw) is not None)
    return value


def _check_tree(value: Any, max_depth: int, strings: bool) -> None:
    """Nesting depth, and (when ``strings``) every key and string's Unicode, without recursion.
    Only on a failure is the walk redone to name the path."""
    if isinstance(value, str):
        if strings and unicode_error(value) is not None:
            _bad_text(value)
        return
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            path, _ = _find(value, lambda _, d: d > max_depth)
            raise LimitExceededError(path, "max_json_depth", depth, max_depth, "levels of nesting")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, sub in children:
            bad = strings and ((isinstance(key, str) and unicode_error(key) is not None)
                               or (isinstance(sub, str) and unicode_error(sub) is not None))
            if bad:
                _bad_text(value)
            if sub and isinstance(sub, (dict, list)):  # an empty one cannot nest deeper
                stack.append((sub, depth + 1))


def _bad_text(value: Any) -> None:
    """Raise for the first invalid string or key in ``value`` (known to hold one)."""
    def invalid(item: Any, _: int) -> bool:
        return isinstance(item, str) and unicode_error(item) is not None
    path, text = _find(value, invalid)
    raise InvalidValueError(path, text, unicode_error(text) or "is not valid Unicode")


def _find(value: Any, hit: Callable[[Any, int], bool]) -> tuple[str, Any]:
    """``(JSON path, node)`` of the first node (keys count as nodes, at their value's depth)
    for which ``hit(node, depth)``; the root is at depth 1."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, at, level = stack.pop()
        if hit(item, level):
            return at or "body", item
        if isinstance(item, dict):
            for key, sub in item.items():
                name = f"{at}.{_ascii(key)}" if at else _ascii(key)
                if hit(key, level + 1):
                    return f"{name} (the key)", key
                stack.append((sub, name, level + 1))
        elif isinstance(item, list):
            stack.extend((sub, f"{at}[{i}]", level + 1) for i, sub in enumerate(item))
    return "body", None


def _ascii(key: Any) -> str:
    """A key as printable text: lone surrogates become their escapes."""
    return str(key).encode("utf-8", "backslashreplace").decode()


def check(path: str, value: Any, kind: str) -> Any:
    """``value`` if it is of JSON ``kind`` (booleans are not numbers); else a 400."""
    ok = isinstance(value, _TYPES[kind]) and not (kind in ("integer", "number")
                                                   and isinstance(value, bool))
    if ok and kind == "number" and not math.isfinite(value):
        ok = False
    if not ok:
        raise InvalidValueError(path, _short(value), f"must be {_article(kind)}")
    return value


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _short(value: Any) -> Any:
    """``value`` itself if its repr is short, else a bounded repr (never the repr of a
    megabyte-sized value built only to be cut)."""
    scalar = isinstance(value, (int, float, bool, type(None))) or (
        isinstance(value, str) and len(value) <= 80)
    if scalar and len(repr(value)) <= 80:
        return value
    return brief(value, 77)


class Obj:
    """One JSON object of a request body, read field by field."""

    def __init__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise InvalidValueError(path, _short(value), "must be a JSON object")
        self.value: dict[str, Any] = value
        self.path = path
        self._read: set[str] = set()

    def at(self, name: str) -> str:
        """The JSON path of field ``name`` of this object."""
        return f"{self.path}.{name}" if self.path and self.path != "body" else name

    def has(self, name: str) -> bool:
        """True when the key is present and not null."""
        self._read.add(name)
        return self.value.get(name) is not None

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        """The field if present and not null (type-checked), else ``default``."""
        self._read.add(name)
        value = self.value.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        return check(self.at(name), value, kind)

    def need(self, name: str, kind: str) -> Any:
        """A required field."""
        value = self.get(name, kind, _MISSING)
        if value is _MISSING:
            raise InvalidValueError(self.at(name), None, "is required")
        return value

    def num(self, name: str, lo: float, hi: float, default: Any = None, *,
            integer: bool = False) -> Any:
        """A number (an integer if ``integer``) within ``[lo, hi]``."""
        value = self.get(name, "integer" if integer else "number", default)
        if value is not None and value is not default and not lo <= value <= hi:
            raise InvalidValueError(self.at(name), value, f"must be in [{lo}, {hi}]")
        return value

    def obj(self, name: str) -> Obj | None:
        """A nested object, or None when absent."""
        value = self.get(name, "object")
        return None if value is None else Obj(value, self.at(name))

    def items(self, name: str, *, required: bool = False) -> Iterator[tuple[str, Any]]:
        """``(path, item)`` for each element of an array field."""
        value = self.need(name, "array") if required else self.get(name, "array", [])
        for i, item in enumerate(value):
            yield f"{self.at(name)}[{i}]", item

    def done(self) -> None:
        """Every key must have been read: an unknown field is a 400 naming it."""
        for key in self.value:
            if key not in self._read:
                raise UnknownFieldError("the request body", self.at(key),
                                        (self.at(k) for k in self._read))
