"""``Grammar``: the value that says what shape a request's output must have (DESIGN §11).

Owns the :class:`Grammar` value type carried by ``GenerationConfig.grammar``, its named
constructors (a JSON schema, any JSON object, or a grammar in llguidance's Lark dialect, as
the tool-call grammars of :mod:`stages.grammar.tools` are), and its check: every
``Grammar`` that exists has been compiled once by the grammar engine (llguidance), so a
schema feature the engine does not support (``if``/``then``, an unknown ``format``, a
dangling ``$ref``) is an :class:`~pipeline.errors.InvalidValueError` naming it when the request
is made, never a failure mid-generation. :func:`after_thinking` prefixes a grammar with free
reasoning up to ``</think>``. The per-token masking is in :mod:`stages.grammar`.

JSON is generated in the layout of Python's ``json.dumps`` (``", "`` between items, ``": "``
after keys, no other whitespace): the layout chat templates render tool calls in, and one
that cannot run on with blank space until ``max_tokens``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, cast

import attrs

from pipeline.errors import InvalidValueError

KINDS = ("json_schema", "json_object", "lark")
"""What a grammar's ``source`` is: a JSON schema (JSON text), nothing (any JSON object), or a
grammar in llguidance's Lark dialect (which may embed schemas with ``%json {...}``)."""
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for every schema we compile (``x-guidance``)."""


def _kind(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in KINDS:
        raise InvalidValueError("grammar.kind", value, f"must be one of {', '.join(KINDS)}")


@attrs.frozen
class Grammar:
    """A constraint the output satisfies by construction: at every step only tokens that
    keep it a prefix of a sentence of the grammar may be chosen, and EOS only once it is a
    whole sentence. Build it with a named constructor; it is checked (compiled) then.

    Example::

        g = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
        pipe.generate(messages, grammar=g)    # or pipe.generate(messages, json_schema=...)
    """

    kind: str = attrs.field(validator=_kind)
    source: str = attrs.field(validator=attrs.validators.instance_of(str))
    field: str = attrs.field(default="grammar", eq=False)
    """The request field the grammar came from, for error messages."""

    def __attrs_post_init__(self) -> None:
        check(self.engine_source(), self.field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str, *,
                    field: str = "json_schema") -> Grammar:
        """Output that validates against ``schema`` (a JSON schema: a mapping, ``True``, or its
        JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidValueError(field, schema, f"is not JSON: {e}") from None
        if not isinstance(schema, (Mapping, bool)):
            raise InvalidValueError(field, schema, "a JSON schema is an object or a boolean")
        return cls("json_schema", json.dumps(schema), field)   # key order kept: it is the output's

    @classmethod
    def json_object(cls) -> Grammar:
        """Output that is one JSON object (any keys and values)."""
        return cls("json_object", "", "json_object")

    @classmethod
    def lark(cls, text: str, *, field: str = "grammar") -> Grammar:
        """Output in the language of ``text``, a grammar in llguidance's Lark dialect."""
        return cls("lark", text, field)

    @property
    def digest(self) -> str:
        """A short hash of kind and source: the compiled-grammar cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()[:32]

    def engine_source(self) -> str:
        """The grammar in the form llguidance compiles (its JSON grammar list)."""
        import llguidance

        if self.kind == "lark":
            return json.dumps({"grammars": [{"name": "main", "lark_grammar": self.source}]})
        schema: Any = {"type": "object"} if self.kind == "json_object" else json.loads(self.source)
        text = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                             overrides=cast(Any, JSON_LAYOUT))
        return str(text)


def after_thinking(engine_source: str, close: str) -> str:
    """``engine_source`` preceded by free reasoning up to the first ``close`` marker (then at
    most two newlines): for an output that starts inside a thinking block the prompt opened,
    which the grammar must not constrain."""
    grammars = json.loads(engine_source)["grammars"]
    grammars[0]["name"] = "answer"
    marker = re.escape(close).replace("/", "\\/")
    top = {"name": "thinking", "lark_grammar": (
        "start: REASONING /\\n{0,2}/ @answer\n"
        f"REASONING: /(?s:.*){marker}/ & ~/(?s:.*){marker}(?s:.+)/\n")}
    return json.dumps({"grammars": [top, *grammars]})


def check(engine_source: str, field: str) -> None:
    """Compile ``engine_source`` (without a vocabulary); :class:`InvalidValueError` naming the
    first thing the engine cannot do."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(engine_source)
    if is_error:
        reason = messages[0] if messages else "the grammar engine cannot compile it"
        raise InvalidValueError(field, "(schema)", f"is not supported here: {reason}")


def grammar_value(value: Any) -> Grammar | None:
    """``GenerationConfig.grammar``'s converter: a :class:`Grammar`, None, or a mapping
    ``{"kind": ..., "source": ..., "field"?: ...}`` (how a config written out as JSON reads
    back)."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, Mapping) and set(value) <= {"kind", "source", "field"}:
        return Grammar(str(value.get("kind")), str(value.get("source", "")),
                       str(value.get("field", "grammar")))
    raise InvalidValueError("grammar", value, "must be a Grammar (pipeline.Grammar.json_schema"
                            "(...), .json_object(), .lark(...))")
