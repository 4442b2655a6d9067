"""Reading JSON request bodies: typed field access that names the field in every error.

Owns :func:`parse_json` (bytes → a JSON value; malformed JSON, ``NaN`` and ``Infinity`` are
errors) and :class:`Obj`, a view of one JSON object whose getters check type and range and
record which keys were read, so :meth:`Obj.done` can reject every key nobody asked for. Every
error is an :class:`~pipeline.errors.InvalidValueError` or
:class:`~pipeline.errors.UnknownFieldError` whose field is the JSON path
(``messages[2].content``), which the transport turns into a 400.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

from pipeline.errors import InvalidValueError, UnknownFieldError

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}
_MISSING = object()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Any:
    """Decode a request body; anything but strict UTF-8 JSON is a 400 naming ``body``."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidValueError("body", raw[:80].decode("utf-8", "replace"),
                                f"malformed JSON: {exc}") from None


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
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."


class Obj:
    """One JSON object of a request body, read field by field."""

    def __init__(self, value: Any, path: str) -> None:
        if not isinstance(value, dict):
            raise InvalidValueError(path, _short(value), "must be a JSON object")
        self.value: dict[str, Any] = value
        self.path = path
        self._read: set[str] = set()

    def _at(self, name: str) -> str:
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
        return check(self._at(name), value, kind)

    def need(self, name: str, kind: str) -> Any:
        """A required field."""
        value = self.get(name, kind, _MISSING)
        if value is _MISSING:
            raise InvalidValueError(self._at(name), None, "is required")
        return value

    def num(self, name: str, lo: float, hi: float, default: Any = None, *,
            integer: bool = False) -> Any:
        """A number (an integer if ``integer``) within ``[lo, hi]``."""
        value = self.get(name, "integer" if integer else "number", default)
        if value is not None and value is not default and not lo <= value <= hi:
            raise InvalidValueError(self._at(name), value, f"must be in [{lo}, {hi}]")
        return value

    def obj(self, name: str) -> Obj | None:
        """A nested object, or None when absent."""
        value = self.get(name, "object")
        return None if value is None else Obj(value, self._at(name))

    def items(self, name: str, *, required: bool = False) -> Iterator[tuple[str, Any]]:
        """``(path, item)`` for each element of an array field."""
        value = self.need(name, "array") if required else self.get(name, "array", [])
        for i, item in enumerate(value):
            yield f"{self._at(name)}[{i}]", item

    def done(self) -> None:
        """Every key must have been read: an unknown field is a 400 naming it."""
        for key in self.value:
            if key not in self._read:
                raise UnknownFieldError("the request body", self._at(key),
                                        (self._at(k) for k in self._read))
