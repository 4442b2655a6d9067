"""``Grammar``: the value that says what shape a request's output must have (docs/design.md §11).

Owns the :class:`Grammar` value type carried by ``GenerationConfig.grammar``, its named
constructors (a JSON schema, any JSON object, a grammar in llguidance's Lark dialect, as
the tool-call grammars of :mod:`pipeline.tools.grammars` are, or in EBNF, a regular expression,
a choice among strings), and its check: every
``Grammar`` that exists has been compiled once by the grammar engine (llguidance), so a
schema feature the engine does not support (``if``/``then``, a dangling ``$ref``) is an
:class:`~pipeline.errors.InvalidValueError` naming it when the request is made, never a
failure mid-generation. A ``format`` the engine cannot assert is dropped as the annotation JSON
Schema makes it, and the engine's own keys (``x-guidance``) in a caller's schema are refused
naming where (:func:`annotations_dropped`). A JSON schema is also checked for a finite value
(:func:`check_finite`): one that requires itself (``{"properties": {"a": {"$ref": "#"}},
"required": ["a"], "type": "object"}``) compiles, but every output would be infinitely deep,
and the engine would fail at the first token (its parser's item limit), so it is refused
naming the cycle. The engine's copy of a schema bounds its numbers, which would otherwise run
on (:mod:`pipeline.schema_compat`: the schema's bounds, else ±(2^53 − 1) for integers and 15
significant digits for numbers). :func:`after_thinking` prefixes a grammar with free
reasoning up to ``</think>``. The per-token masking is in :mod:`stages.structured`.

JSON is generated in the layout of Python's ``json.dumps`` (``", "`` between items, ``": "``
after keys, no other whitespace): the layout chat templates render tool calls in, and one
that cannot run on with blank space until ``max_tokens``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import attrs

from pipeline.errors import InvalidValueError
from pipeline.schema_compat import (
    escape_pointer, open_values_bounded, resolve_pointer, rewrite, subschemas, without_unique,
)

KINDS = ("json_schema", "json_object", "lark", "regex", "choice")
"""What a grammar's ``source`` is: a JSON schema (JSON text), nothing (any JSON object), a
grammar in llguidance's Lark dialect (which may embed schemas with ``%json {...}``), a regular
expression the whole output matches, or a JSON list of the strings the output may be."""
MAX_CHOICES = 4096
"""Strings a choice constraint may list."""
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
    distinct_calls: bool = attrs.field(default=False, kw_only=True,
                                       validator=attrs.validators.instance_of(bool))
    """The output is tool calls that must differ: once a call repeats an earlier one of the
    output byte for byte, the output takes its shortest way to an end (the model is
    looping; the tool-call reader drops the repeat). Set by the tool-call grammars of
    :mod:`pipeline.tools.grammars` when several calls are allowed; a call there is a JSON
    object at the top level or an item of a top-level array."""

    def __attrs_post_init__(self) -> None:
        schema = json.loads(self.source) if self.kind == "json_schema" else None
        check(self.engine_source(), self.field, schema)
        if schema is not None:
            check_finite(schema, self.field)

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
        tidy = annotations_dropped(schema, field)
        check(_schema_source(tidy), field, schema)   # an error points into the caller's schema
        return cls("json_schema", json.dumps(tidy), field)   # key order kept: the output's

    @classmethod
    def json_object(cls) -> Grammar:
        """Output that is one JSON object (any keys and values)."""
        return cls("json_object", "", "json_object")

    @classmethod
    def lark(cls, text: str, *, field: str = "grammar", distinct_calls: bool = False
             ) -> Grammar:
        """Output in the language of ``text``, a grammar in llguidance's Lark dialect
        (``distinct_calls``: see the attribute)."""
        return cls("lark", text, field, distinct_calls=distinct_calls)

    @classmethod
    def text(cls, text: str, *, field: str = "grammar") -> Grammar:
        """Output in the language of ``text``: a context-free grammar in Lark syntax (rules
        ``name: ...``), or in EBNF as llama.cpp's GBNF writes it (rules ``name ::= ...``,
        translated to Lark), the two forms servers take for a ``grammar`` constraint."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidValueError(field, text, "must be a non-empty grammar text")
        if re.search(r"^\s*[A-Za-z_][\w-]*\s*::=", text, re.MULTILINE):
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                text = gbnf_to_lark(text)
            except Exception as e:   # the converter's own error names the line
                raise InvalidValueError(field, "(grammar)", f"is not valid EBNF: {e}") from None
        return cls("lark", text, field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "regex") -> Grammar:
        """Output that matches the regular expression ``pattern`` as a whole (Rust ``regex``
        syntax, as llguidance reads it; no look-around or back-references)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidValueError(field, pattern, "must be a non-empty regular expression")
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], *, field: str = "choice") -> Grammar:
        """Output that is exactly one of ``options`` (non-empty strings)."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise InvalidValueError(field, options, "must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise InvalidValueError(field, len(options), f"at most {MAX_CHOICES} choices")
        for i, option in enumerate(options):
            if not isinstance(option, str) or not option:
                raise InvalidValueError(f"{field}[{i}]", option, "must be a non-empty string")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), field)

    @property
    def digest(self) -> str:
        """A short hash of kind and source: the compiled-grammar cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()[:32]

    def engine_source(self) -> str:
        """The grammar in the form llguidance compiles (its JSON grammar list)."""
        import llguidance

        if self.kind == "lark":
            return json.dumps({"grammars": [{"name": "main", "lark_grammar": self.source}]})
        if self.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(self.source))
        if self.kind == "choice":
            options = " | ".join(json.dumps(o) for o in json.loads(self.source))
            lark = f"start: CHOICE\nCHOICE: {options}\n"   # one terminal: no parser row
            return json.dumps({"grammars": [{"name": "main", "lark_grammar": lark}]})
        return _schema_source(open_values_bounded({"type": "object"})
                              if self.kind == "json_object" else json.loads(self.source))


def _schema_source(schema: Any) -> str:
    """The engine's grammar for a JSON schema (its ``uniqueItems`` left to the processor)."""
    import llguidance

    text = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(without_unique(schema)), overrides=cast(Any, JSON_LAYOUT))
    return str(text)


@attrs.frozen
class ForcedCall:
    """What a required tool call makes of the output: it starts with ``prefix`` (forced
    tokens; a marker that is a special token as that token) and follows ``grammar`` from its
    first token."""

    prefix: str
    grammar: Grammar


Marker = Callable[[str], str]
"""A tool-call marker's text -> its Lark expression: a string literal, or ``<[id]>`` for a
marker that is one special token of the vocabulary (which text never spells)."""


def text_marker(text: str) -> str:
    """``text`` as a Lark string literal (a marker the vocabulary spells as text)."""
    return json.dumps(text)


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


ENGINE_KEYS = ("x-guidance",)
"""Keys that set the grammar engine's own options when found in a schema: a caller's schema
may not carry them (``{"x-guidance": {"lenient": true}}`` would turn validity off silently)."""


def annotations_dropped(schema: Any, field: str) -> Any:
    """``schema`` with each ``format`` the engine does not know removed, and refused
    (:class:`InvalidValueError` naming the JSON Pointer) if a subschema carries an engine key
    (:data:`ENGINE_KEYS`).

    JSON Schema makes ``format`` an annotation unless a validator opts in to asserting it, so a
    format the engine cannot enforce (``byte``, ``non-blank``) constrains nothing rather than
    failing the request; formats it knows (``date-time``, ``email``, ``uuid``, ...) are kept
    and enforced. Only schema positions are walked (a property *named* ``format`` is kept).
    Keywords the engine lacks are rewritten into ones it has where the result allows no
    instance the original forbids (:mod:`pipeline.schema_compat`: dependencies, ``not``,
    ``propertyNames``, exclusive ``oneOf``, ``if`` on a constant), and numbers are bounded
    (the schema's bounds or the defaults there), open values included."""
    if not isinstance(schema, Mapping):
        return open_values_bounded(schema)
    return open_values_bounded(_tidy(schema, "", field, schema))


def _tidy(node: Any, pointer: str, field: str, root: Any,
          siblings: Mapping[str, Any] | None = None, negated: bool = False) -> Any:
    if not isinstance(node, Mapping):
        return node
    for key in ENGINE_KEYS:
        if key in node:
            raise InvalidValueError(field, "(schema)", f"is not supported here: at "
                                    f"{pointer or '/'}: {key!r} sets the grammar engine's own "
                                    "options and is not JSON Schema; remove it")
    out: dict[str, Any] = {
        key: (list(value) if isinstance(value, list) else dict(value)
              if isinstance(value, Mapping) else value)
        for key, value in node.items()
        if not (key == "format" and isinstance(value, str) and not _engine_format(value))}
    props = node.get("properties") if isinstance(node.get("properties"), Mapping) else None
    around = props if props is not None else siblings   # the object's declared properties
    for key, within, at, child in subschemas(node, pointer):
        context = around if key in ("allOf", "then", "else") else None
        inner = negated or key == "not"   # a stricter rewrite under "not" would loosen it
        if within is None:
            out[key] = _tidy(child, at, field, root, context, inner)
        else:
            out[key][within] = _tidy(child, at, field, root, context, inner)
    return out if negated else rewrite(out, root, around)


@functools.lru_cache(maxsize=256)
def _engine_format(name: str) -> bool:
    """Whether the engine enforces string format ``name`` (compiled once per name)."""
    import llguidance

    text = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps({"type": "string", "format": name}))
    is_error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    return not is_error


@functools.lru_cache(maxsize=256)
def _validated(engine_source: str) -> tuple[bool, tuple[str, ...]]:
    """The engine's verdict on ``engine_source`` and its messages (kept per source: every
    request of a tool list or a schema brings the same grammar)."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(engine_source)
    return bool(is_error), tuple(messages)


def check(engine_source: str, field: str, schema: Any = None) -> None:
    """Compile ``engine_source`` (without a vocabulary); :class:`InvalidValueError` naming the
    first thing the engine cannot do, and where in ``schema`` (a JSON Pointer) when the engine
    names keywords it does not implement."""
    is_error, messages = _validated(engine_source)
    if is_error:
        reason = messages[0] if messages else "the grammar engine cannot compile it"
        keys = re.search(r"Unimplemented keys: (\[.*?\])", reason)
        named: list[str] = []
        if keys is not None:
            try:
                named = [k for k in json.loads(keys.group(1)) if isinstance(k, str)]
            except json.JSONDecodeError:
                pass
        elif "min/maxProperties" in reason:
            named = ["minProperties", "maxProperties"]
        elif re.search(r"in regex /", reason):
            named = ["pattern", "patternProperties"]
        where = _where(schema, set(named), "") if named and schema is not None else None
        if where is not None:
            reason = f"{reason.splitlines()[0].strip()} at {where or '/'}"
        raise InvalidValueError(field, "(schema)" if schema is not None else "(grammar)",
                                f"is not supported here: {reason}")


def _where(node: Any, keys: set[str], pointer: str) -> str | None:
    """The JSON Pointer of the first subschema (in schema positions) that has one of ``keys``."""
    if not isinstance(node, Mapping):
        return None
    first = next((k for k in node if k in keys), None)
    if first is not None:
        return f"{pointer}/{escape_pointer(first)}"
    for _, _, at, child in subschemas(node, pointer):
        found = _where(child, keys, at)
        if found is not None:
            return found
    return None


def check_finite(schema: Any, field: str) -> None:
    """:class:`InvalidValueError` when no finite JSON value satisfies ``schema``: a required
    property, a non-empty array's item or every alternative leads back to where it started
    (or to ``false``), so the engine could only ever force the same opening again.

    The analysis is conservative: it follows local references (``$ref``), ``properties`` named in
    ``required``, ``items``/``prefixItems`` under ``minItems``, ``allOf``, ``anyOf`` and
    ``oneOf``, and takes anything else (other types, ``enum``, remote references) as
    satisfiable, so it never refuses a schema some finite value satisfies."""
    nodes: dict[str, _Need] = {}
    users: dict[str, list[str]] = {}  # pointer -> the schemas whose need names it
    todo = ["#"]
    while todo:
        pointer = todo.pop()
        if pointer not in nodes:
            nodes[pointer] = need = _needs(schema, pointer)
            for used in _pointers(need):
                users.setdefault(used, []).append(pointer)
                todo.append(used)
    # least fixpoint: a schema is finite once what it needs is; each schema is looked at
    # again only when one it names became finite (linear in the schema's size)
    finite: set[str] = set()
    look = list(nodes)
    while look:
        pointer = look.pop()
        if pointer not in finite and _holds(nodes[pointer], finite):
            finite.add(pointer)
            look.extend(users.get(pointer, ()))
    if "#" not in finite:
        chain = _cycle(nodes, finite)
        raise InvalidValueError(field, "(schema)", "is not supported here: no finite JSON value "
                                f"satisfies it: {chain}")


_Need = bool | str | tuple[str, tuple["_Need", ...]]
"""What a schema needs to have a finite value: always/never, the schema at a pointer, or
``("and" | "or", needs)``."""


def _needs(root: Any, pointer: str) -> _Need:
    """What the schema at ``pointer`` needs (see :data:`_Need`)."""
    node = resolve_pointer(root, pointer)
    if not isinstance(node, Mapping):
        return node is not False
    parts: list[_Need] = [_own(node, pointer)]
    ref = node.get("$ref")
    if isinstance(ref, str) and resolve_pointer(root, ref) is not None:
        parts.append(ref)
    for word in ("allOf", "anyOf", "oneOf"):
        subs = node.get(word)
        if isinstance(subs, list) and subs:
            needs = tuple(f"{pointer}/{word}/{i}" for i in range(len(subs)))
            parts.append(("and" if word == "allOf" else "or", needs))
    return ("and", tuple(parts))


def _own(node: Mapping[str, Any], pointer: str) -> _Need:
    """What the schema's ``type`` needs: an object its required properties, a non-empty
    array its first items; any other type (or none given) nothing."""
    types = node.get("type")
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if kinds is None or any(k not in ("object", "array") for k in kinds):
        return True
    options: list[_Need] = []
    if "object" in kinds:
        props = node.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = node.get("required")
        names = ([n for n in required if isinstance(n, str) and n in props]
                 if isinstance(required, list) else [])
        options.append(("and", tuple(f"{pointer}/properties/{escape_pointer(n)}" for n in names)))
    if "array" in kinds:
        options.append(_items(node, pointer))
    return ("or", tuple(options))


def _items(node: Mapping[str, Any], pointer: str) -> _Need:
    """What a non-empty array needs: its first ``minItems`` items' schemas."""
    least = node.get("minItems")
    count = least if isinstance(least, int) and not isinstance(least, bool) else 0
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    needs: list[_Need] = [f"{pointer}/prefixItems/{i}" for i in range(min(count, len(prefix)))]
    if count > len(prefix) and isinstance(node.get("items"), (Mapping, bool)):
        needs.append(f"{pointer}/items")
    return ("and", tuple(needs))


def _holds(need: _Need, finite: set[str]) -> bool:
    if isinstance(need, bool):
        return need
    if isinstance(need, str):
        return need in finite
    word, parts = need
    return (all if word == "and" else any)(_holds(p, finite) for p in parts)


def _pointers(need: _Need) -> list[str]:
    if isinstance(need, bool):
        return []
    if isinstance(need, str):
        return [need]
    return [p for part in need[1] for p in _pointers(part)]


def _blocking(need: _Need, finite: set[str]) -> str | None:
    """The first schema ``need`` waits for that has no finite value (None: it is ``false``)."""
    if isinstance(need, str):
        return need
    if isinstance(need, bool):
        return None
    for part in need[1]:
        if not _holds(part, finite):
            return _blocking(part, finite)
    return None


def _cycle(nodes: dict[str, _Need], finite: set[str]) -> str:
    """Why the root has no finite value: the path of required schemas that leads back into
    itself (``# -> #/properties/a -> #``), or to one that allows no value."""
    path, at = ["#"], _blocking(nodes["#"], finite)
    while at is not None and at not in path:
        path.append(at)
        at = _blocking(nodes[at], finite)
    if at is None:
        return f"{_arrows(path)}, which allows no value"
    return f"{at} requires itself ({_arrows([*path, at])}), so every value would be infinitely deep"


def _arrows(path: list[str]) -> str:
    """``a -> b -> c``, the middle of a long path elided (it may run through every
    definition of a large schema)."""
    shown = path if len(path) <= 8 else [*path[:4], f"... {len(path) - 7} more ...", *path[-3:]]
    return " -> ".join(shown)


def grammar_value(value: Any) -> Grammar | None:
    """``GenerationConfig.grammar``'s converter: a :class:`Grammar`, None, or a mapping
    ``{"kind": ..., "source": ..., "field"?: ..., "distinct_calls"?: ...}`` (how a config
    written out as JSON reads back)."""
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, str):
        return Grammar.text(value)
    if isinstance(value, Mapping) and set(value) <= {"kind", "source", "field",
                                                     "distinct_calls"}:
        return Grammar(str(value.get("kind")), str(value.get("source", "")),
                       str(value.get("field", "grammar")),
                       distinct_calls=value.get("distinct_calls") is True)
    raise InvalidValueError("grammar", value, "must be a Grammar (pipeline.Grammar.json_schema"
                            "(...), .json_object(), .lark(...), .regex(...), .choice(...)) "
                            "or a grammar's text (Lark or EBNF)")
