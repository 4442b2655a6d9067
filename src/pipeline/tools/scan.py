"""Reading one tool call's JSON object as it is generated, and judging the finished object.

Owns :class:`CallScanner`, a character-at-a-time reader of ``{"name": ..., "arguments": ...}``
that knows, without parsing the whole text, when the call's name is complete and which
characters belong to its arguments value (so they can stream before the object closes), and
:func:`judge`, the strict reading of a finished object: a string ``name`` and an object of
arguments (or JSON text of one), valid JSON text with no NaN, no nesting too deep to parse
and no lone surrogate. Both are shared by every format's reader.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline.contracts.request import unicode_error

ARGUMENT_KEYS = ("arguments", "parameters")
"""The keys a call's arguments may be under (Hermes/Mistral write the first, Llama the second)."""


def strict_json(text: str) -> Any:
    """``json.loads`` of model output; NaN / Infinity (not JSON) are malformed like any other
    bad JSON. Raises ``ValueError`` or ``RecursionError``."""
    return json.loads(text, parse_constant=_not_json)


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def judge(body: str) -> tuple[str, Any] | str:
    """``(name, arguments as a dict)`` of a finished call object, or why it is not a call."""
    try:
        value = strict_json(body)
    except (ValueError, RecursionError) as exc:
        return f"not JSON: {str(exc)[:80]}"
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return "not an object with a string name"
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    args = value[key] if key is not None else {}
    if isinstance(args, str):
        try:
            args = strict_json(args)
        except (ValueError, RecursionError):
            return "the arguments string is not JSON"
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    try:
        again = json.dumps(args, ensure_ascii=False)
    except RecursionError:
        return "the arguments nest too deeply"
    if unicode_error(again) or unicode_error(value["name"]):  # a "\ud800" escape
        return "the call holds a lone surrogate"
    return value["name"], args


class CallScanner:
    """Reads one call object a character at a time, tracking only its top level.

    ``name`` is set once the ``name`` value is a complete string; ``take()`` returns the
    arguments text that arrived since the last call, without leading whitespace and holding
    trailing whitespace until more of the value follows. An arguments value written as a
    JSON string is released decoded, once complete; any other non-object value is held to the
    end (the call will not judge well). ``done`` is set when the object closes; ``broken``
    when the text cannot be an object (a stray closing bracket, text before ``{``) or
    holds two arguments members (their streamed fragments would not be one object).
    """

    def __init__(self) -> None:
        self.text: list[str] = []
        self.name: str | None = None
        self.done = False
        self.broken = False
        self.args_started = False
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        self._expect_key = True
        self._key: str | None = None
        self._piece_start: int | None = None  # where the current top-level string/value began
        self._value: list[str] | None = None  # the current top-level value's characters
        self._args_kind: str | None = None  # "{" (streamed), '"' or "other" (held)
        self._args_out: list[str] = []
        self._held_space = ""

    def feed(self, text: str) -> str:
        """Read ``text``; return what follows the object's end (empty while it is open)."""
        for at, char in enumerate(text):
            if self.done or self.broken:
                return text[at:]
            self._char(char)
        return ""

    @property
    def in_string(self) -> bool:
        """Whether the object's text so far ends inside a JSON string (a marker read there is
        the string's content, not markup)."""
        return self._in_string

    def spoil(self) -> None:
        """Mark the object as no call (its reader saw text where none may be)."""
        self.broken = True

    def take(self) -> str:
        """Arguments text read since the last ``take``."""
        out = "".join(self._args_out)
        self._args_out.clear()
        return out

    def _char(self, char: str) -> None:
        self.text.append(char)
        if not self._stack:
            if char == "{":
                self._stack.append("}")
            elif not char.isspace():
                self.broken = True
            return
        if self._in_string:
            self._string_char(char)
        elif char == '"':
            self._in_string = True
            self._begin_piece()
            self._value_char(char)
        elif char in "{[":
            self._begin_piece()
            self._stack.append("}" if char == "{" else "]")
            self._value_char(char)
        elif char in "}]":
            self._close(char)
        elif len(self._stack) == 1:
            self._top_level(char)
        else:
            self._value_char(char)

    def _string_char(self, char: str) -> None:
        self._value_char(char)
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            if len(self._stack) == 1 and self._expect_key:
                self._key = _loads_str("".join(self.text[self._piece_start or 0:]))

    def _begin_piece(self) -> None:
        if len(self._stack) == 1 and self._expect_key:
            self._piece_start = len(self.text) - 1

    def _top_level(self, char: str) -> None:
        if char == ":" and self._expect_key:
            self._expect_key, self._value = False, []
            if self._key in ARGUMENT_KEYS:
                if self.args_started:  # a second arguments member: which one was meant?
                    self.broken = True
                self._args_kind, self.args_started = None, True
            return
        if char == ",":
            self._end_value()
            self._expect_key = True
            return
        self._value_char(char)

    def _close(self, char: str) -> None:
        if self._stack[-1] != char:
            self.broken = True
            return
        self._stack.pop()
        if self._stack:
            self._value_char(char)
            return
        self._end_value()
        self.done = True

    def _value_char(self, char: str) -> None:
        if self._value is None or self._expect_key:
            return
        self._value.append(char)
        if self._key not in ARGUMENT_KEYS:
            return
        if self._args_kind is None:
            if char.isspace():
                return
            self._args_kind = char if char in '{"' else "other"
        if self._args_kind != "{":
            return
        if char.isspace() and len(self._stack) == 1:
            self._held_space += char  # after the value: dropped unless the value goes on
            return
        self._args_out.append(self._held_space + char)
        self._held_space = ""

    def _end_value(self) -> None:
        if self._value is None:
            return
        raw = "".join(self._value).strip()
        if self._key == "name":
            self.name = _loads_str(raw)
        elif self._key in ARGUMENT_KEYS and self._args_kind == '"':
            decoded = _loads_str(raw)
            if decoded is not None:
                self._args_out.append(decoded)
        self._value, self._key, self._held_space = None, None, ""


def _loads_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
