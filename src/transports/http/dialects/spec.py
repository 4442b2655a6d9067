"""The field specification the dialects parse from, and the schema building blocks.

Owns the tables each dialect reads its plain fields with and documents them from: a field's
entry (:class:`Number`, :class:`Choice`, :class:`Typed`, :class:`Refused`) both reads it from
an :class:`~transports.http.dialects.fields.Obj` (type and range checked, the 400 naming it)
and gives its schema in the OpenAPI document (:mod:`~transports.http.dialects.openapi_requests`),
so a range is written once: the sampling fields (:data:`SAMPLING`, and each endpoint's share
of it), the OpenAI fields that change nothing here (:data:`OPENAI_IGNORED`), and the
documented fields refused with a 400 (:data:`CHAT_REFUSED`, :data:`ANTHROPIC_REFUSED`).
:func:`read` reads a table's fields from a body, :func:`schemas` documents them. Also the
helpers every schema is built with (a request object refuses unknown keys and takes ``null``
wherever a parser reads it as absent).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import attrs

from pipeline.errors import InvalidValueError
from transports.http.dialects.fields import Obj

Schema = dict[str, Any]

# The parsers' upper bound on every token count and top_k (Obj.num(..., 1 << 30)).
MAX_COUNT = 1 << 30
# GenerationConfig: at most 16 stop strings, none empty.
MAX_STOPS = 16


def ref(name: str) -> Schema:
    """A reference to a component schema."""
    return {"$ref": f"#/components/schemas/{name}"}


def nullable(schema: Schema) -> Schema:
    """An optional field's schema: every parser reads ``null`` as "absent"."""
    kind = schema.get("type")
    if kind == "null":
        return schema
    if isinstance(kind, str) and "const" not in schema and "enum" not in schema:
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def request_object(required: Schema, optional: Schema | None = None, *,
                   description: str | None = None) -> Schema:
    """A request object: ``required`` keys must be present and non-null, ``optional`` ones may
    be null or absent, and any other key is a 400 (``Obj.done``)."""
    properties = {**required, **{k: nullable(v) for k, v in (optional or {}).items()}}
    schema: Schema = {"type": "object", "properties": properties,
                      "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    return schema


def response_object(required: Schema, optional: Schema | None = None) -> Schema:
    """A response object: open to new keys, so clients must ignore the ones they do not know."""
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required)}


def integer(lo: int, hi: int = MAX_COUNT, description: str | None = None) -> Schema:
    """An integer in ``[lo, hi]``."""
    schema: Schema = {"type": "integer", "minimum": lo, "maximum": hi}
    if description:
        schema["description"] = description
    return schema


def array(items: Schema, **limits: int) -> Schema:
    """An array of ``items`` (``minItems`` / ``maxItems`` as keywords)."""
    return {"type": "array", "items": items, **limits}


def enum(*values: str, description: str | None = None) -> Schema:
    """One of ``values``."""
    schema: Schema = {"type": "string", "enum": list(values)}
    if description:
        schema["description"] = description
    return schema


def refused(why: str) -> Schema:
    """A documented field this server refuses: only ``null`` (absent) is accepted."""
    return {"type": "null", "description": f"not supported here: {why} (a 400 when given)"}


STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
OBJECT: Schema = {"type": "object"}
COUNT: Schema = {"type": "integer", "minimum": 0}
TOOL_NAME: Schema = {"type": "string", "minLength": 1}  # ToolSpec refuses an empty name
STOP_STRINGS = array({"type": "string", "minLength": 1}, maxItems=MAX_STOPS)
STOP = {"oneOf": [{"type": "string", "minLength": 1}, STOP_STRINGS]}
EFFORT = ("low", "medium", "high", "xhigh", "max")


# --- field entries ---------------------------------------------------------------------------


class Spec(Protocol):
    """One field's entry: how it is read, and how it is documented."""

    def read(self, body: Obj, name: str) -> Any:
        """The field's value (None when absent), checked; a 400 naming it otherwise."""

    def schema(self) -> Schema:
        """The field's schema in the OpenAPI document."""


@attrs.frozen
class Number:
    """A number (an integer if ``integer``) in ``[lo, hi]``; with ``lo_open`` the library
    refuses ``lo`` itself (:class:`~pipeline.contracts.request.GenerationConfig`), so the document says
    ``(lo, hi]``."""

    lo: float
    hi: float
    integer: bool = False
    lo_open: bool = False
    description: str | None = None

    def read(self, body: Obj, name: str) -> Any:
        return body.num(name, self.lo, self.hi, integer=self.integer)

    def schema(self) -> Schema:
        low = {"exclusiveMinimum": self.lo} if self.lo_open else {"minimum": self.lo}
        schema: Schema = {"type": "integer" if self.integer else "number", **low,
                          "maximum": self.hi}
        if self.description:
            schema["description"] = self.description
        return schema


@attrs.frozen
class Choice:
    """A string that must be one of ``values``."""

    values: tuple[str, ...]
    description: str | None = None

    def read(self, body: Obj, name: str) -> Any:
        value = body.get(name, "string")
        if value is not None and value not in self.values:
            raise InvalidValueError(body.at(name), value,
                                    f"must be one of {', '.join(self.values)}")
        return value

    def schema(self) -> Schema:
        return enum(*self.values, description=self.description)


@attrs.frozen
class Typed:
    """A value of one JSON type (``string``, ``boolean``, ``object``...), type-checked."""

    kind: str

    def read(self, body: Obj, name: str) -> Any:
        return body.get(name, self.kind)

    def schema(self) -> Schema:
        return {"type": self.kind}


@attrs.frozen
class Refused:
    """A documented field asking for what this server does not do: a 400 when given."""

    why: str

    def read(self, body: Obj, name: str) -> Any:
        if body.has(name):
            raise unsupported(body.at(name), body.value[name], self.why)
        return None

    def schema(self) -> Schema:
        return refused(self.why)


def unsupported(field: str, value: Any, what: str) -> InvalidValueError:
    """The 400 for a documented field asking for something this server does not do."""
    return InvalidValueError(field, value, f"is not supported here: {what}")


def one_of(body: Obj, name: str, choices: tuple[str, ...]) -> str | None:
    """A string field that must be one of ``choices`` (or absent)."""
    return Choice(choices).read(body, name)  # type: ignore[no-any-return]


def read(body: Obj, table: Mapping[str, Spec]) -> dict[str, Any]:
    """Each field of ``table`` that ``body`` gives, by name."""
    values = {name: spec.read(body, name) for name, spec in table.items()}
    return {name: value for name, value in values.items() if value is not None}


def schemas(table: Mapping[str, Spec]) -> dict[str, Schema]:
    """Each field of ``table`` documented, by name."""
    return {name: spec.schema() for name, spec in table.items()}


def pick(table: Mapping[str, Spec], *names: str) -> dict[str, Spec]:
    """The entries of ``table`` called ``names``, in that order."""
    return {name: table[name] for name in names}


# --- the tables ------------------------------------------------------------------------------


SAMPLING: dict[str, Spec] = {
    "temperature": Number(0.0, 2.0),
    "top_p": Number(0.0, 1.0, lo_open=True),
    "presence_penalty": Number(-2.0, 2.0),
    "frequency_penalty": Number(-2.0, 2.0),
    # common server extensions (vLLM spellings)
    "top_k": Number(0, MAX_COUNT, integer=True, description="0: off (an extension)"),
    "min_p": Number(0.0, 1.0),
    "repetition_penalty": Number(0.01, 100.0),
    # the DRY loop guard (llama.cpp's spellings)
    "dry_multiplier": Number(0.0, 100.0),
    "dry_base": Number(1.0, 10.0),
    "dry_allowed_length": Number(1, 64, integer=True, description="the DRY loop guard (an "
                                 "extension; left out: the server's default)"),
    "min_tokens": Number(0, MAX_COUNT, integer=True,
                         description="at most the effective max_tokens (an extension)"),
}
"""The numeric sampling fields both OpenAI endpoints take (``/v1/completions`` all of them),
each a :class:`~pipeline.contracts.request.GenerationConfig` field of the same name."""

CHAT_SAMPLING: dict[str, Spec] = {
    **SAMPLING,
    "top_logprobs": Number(0, 20, integer=True, description="above 0 needs `logprobs: true`"),
    "reasoning_budget_tokens": Number(0, MAX_COUNT, integer=True,
                                      description="caps a <think> block (an extension)"),
}
"""Chat's numeric fields: :data:`SAMPLING` and the logprobs count and reasoning budget."""

RESPONSES_SAMPLING = pick(SAMPLING, "temperature", "top_p", "top_k", "min_p",
                          "repetition_penalty", "dry_multiplier", "dry_base",
                          "dry_allowed_length")
"""The Responses API's numeric sampling fields (its own and the chat extensions)."""

ANTHROPIC_SAMPLING: dict[str, Spec] = {
    "temperature": Number(0.0, 1.0), "top_p": SAMPLING["top_p"],
    "top_k": Number(0, MAX_COUNT, integer=True, description="0: off"),
}
"""The Messages API's numeric sampling fields (its temperature stops at 1)."""

OPENAI_IGNORED: dict[str, Spec] = {
    "service_tier": Choice(("auto", "default", "flex", "scale", "priority", "fast")),
    "store": Typed("boolean"), "prompt_cache_key": Typed("string"),
    "safety_identifier": Typed("string"),
    "prompt_cache_retention": Choice(("in_memory", "24h")),
}
"""Fields of both OpenAI endpoints with no meaning here: type-checked and ignored (with
``metadata`` and ``prompt_cache_options``, :func:`~transports.http.dialects.documented.openai_ignored`)."""

CHAT_REFUSED: dict[str, Spec] = {
    "audio": Refused("audio output"),
    "functions": Refused("it is deprecated; send 'tools' and 'tool_choice'"),
    "function_call": Refused("it is deprecated; send 'tools' and 'tool_choice'"),
    "moderation": Refused("no moderation model"),
    "web_search_options": Refused("no web search"),
}
"""Chat fields asking for what this server does not do (with ``modalities`` other than text)."""

ANTHROPIC_REFUSED: dict[str, Spec] = {
    "mcp_servers": Refused("no MCP connector"),
    "context_management": Refused("no server-side context editing"),
    "compaction": Refused("no server-side compaction"),
    "thread": Refused("no server-held conversations"),
}
"""Beta Messages fields asking for what this server does not do."""
