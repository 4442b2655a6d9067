"""Documented request fields that change nothing here, or that ask for what is not here.

Owns the two rules for fields of the OpenAI and Anthropic APIs that the dialect parsers do
not turn into generation: a field with no meaning on this server (a billing tier, a cache
hint, an effort or verbosity hint, a region, an id) is type-checked and ignored; a field that
would change the answer in a way this server cannot honour (audio, other modalities, the
deprecated ``functions``, moderation, web search, server-side tools and state) is refused
with a 400 that says it is not supported, so nothing is silently dropped. Structured output is
served: :func:`response_format` and :func:`structured_outputs` turn its fields into the
request's :class:`~pipeline.grammar.Grammar`. Only names no API documents are unknown fields
(:meth:`~transports.http.dialects.fields.Obj.done`, with its "did you mean" hint).

:func:`openai_ignored`, :func:`openai_chat_refused` and :func:`anthropic_fields` read the
fields from an :class:`~transports.http.dialects.fields.Obj`; docs/serving.md lists them.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import InvalidValueError
from pipeline.grammar import Grammar
from transports.http.dialects.fields import Obj, check
from transports.http.dialects.spec import (
    ANTHROPIC_REFUSED, CHAT_REFUSED, OPENAI_IGNORED, one_of, read, unsupported,
)


# --- OpenAI --------------------------------------------------------------------------------


def openai_ignored(body: Obj) -> None:
    """Fields of both OpenAI endpoints with no meaning here, type-checked and ignored:
    ``service_tier``, ``store``, ``metadata`` (at most 16 string values),
    ``prompt_cache_key``, ``prompt_cache_retention``, ``prompt_cache_options`` and
    ``safety_identifier``. (Chat-only ones are read by :func:`openai_chat_ignored`.)"""
    read(body, OPENAI_IGNORED)
    metadata = body.get("metadata", "object")
    if metadata is not None:
        if len(metadata) > 16:
            raise InvalidValueError("metadata", len(metadata), "at most 16 entries")
        for key, value in metadata.items():
            check(f"metadata.{key}", value, "string")
    options = body.obj("prompt_cache_options")
    if options is not None:
        one_of(options, "mode", ("implicit", "explicit"))
        one_of(options, "ttl", ("30m",))
        options.done()


def openai_chat_ignored(body: Obj) -> str | None:
    """Chat hints with no control here, type-checked and ignored (``verbosity``,
    ``prediction``); returns ``reasoning_effort``, which :mod:`~transports.http.dialects.openai`
    turns into the template's ``enable_thinking``."""
    one_of(body, "verbosity", ("low", "medium", "high"))
    prediction = body.obj("prediction")
    if prediction is not None:  # a latency hint: the answer does not depend on it
        if prediction.need("type", "string") != "content":
            raise InvalidValueError("prediction.type", prediction.value["type"],
                                    "must be 'content'")
        content = prediction.value.get("content")
        prediction.has("content")
        if not isinstance(content, str):
            for i, part in enumerate(check("prediction.content", content, "array")):
                text = Obj(part, f"prediction.content[{i}]")
                if text.need("type", "string") != "text":
                    raise InvalidValueError(text.at("type"), text.value["type"],
                                            "must be 'text'")
                text.need("text", "string")
                text.done()
        prediction.done()
    return one_of(body, "reasoning_effort",
                  ("none", "minimal", "low", "medium", "high", "xhigh", "max"))


def openai_chat_refused(body: Obj) -> None:
    """Chat fields asking for what this server does not do: a 400 each when given (a
    ``text`` ``response_format`` and ``modalities: ["text"]`` are what it does anyway)."""
    read(body, CHAT_REFUSED)
    modalities = body.get("modalities", "array")
    for i, kind in enumerate(modalities or ()):
        if check(f"modalities[{i}]", kind, "string") != "text":
            raise unsupported(f"modalities[{i}]", kind, "only text comes out")


def response_format(body: Obj) -> Grammar | None:
    """``response_format``: ``text`` (None), ``json_object`` (any JSON object) or
    ``json_schema`` (``{"name", "description"?, "schema"?, "strict"?}``: output valid for
    ``schema``, by construction whether ``strict`` or not; no schema means any JSON object),
    as the request's grammar. A schema feature the grammar engine lacks is a 400 naming it."""
    fmt = body.obj("response_format")
    if fmt is None:
        return None
    kind = one_of(fmt, "type", ("text", "json_object", "json_schema"))
    if kind is None:
        raise InvalidValueError("response_format.type", None, "is required")
    grammar = None if kind == "text" else Grammar.json_object()
    spec = fmt.obj("json_schema") if kind == "json_schema" else None
    if kind == "json_schema" and spec is None:
        raise InvalidValueError("response_format.json_schema", None, "is required")
    if spec is not None:
        spec.need("name", "string")
        spec.get("description", "string")
        spec.get("strict", "boolean")
        schema = spec.get("schema", "object")
        if schema is not None:
            grammar = Grammar.json_schema(schema, field="response_format.json_schema.schema")
        spec.done()
    fmt.done()
    return grammar


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs(body: Obj, fmt: Grammar | None) -> Grammar | None:
    """The constraint fields vLLM's OpenAI server takes, beside ``response_format``
    (``fmt``): ``structured_outputs`` (one of ``json`` (a schema), ``regex``, ``choice`` (a list
    of strings), ``grammar`` (Lark or EBNF text), ``json_object: true``) and the older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
    (``guided_decoding_backend`` and ``guided_whitespace_pattern`` are type-checked and
    ignored: there is one engine, and JSON has one layout). At most one constraint per
    request, counting ``response_format``; each is a 400 naming its field when it does not
    compile."""
    asked: list[tuple[str, str, Any]] = []
    spec = body.obj("structured_outputs")
    if spec is not None:
        for name in _CONSTRAINTS:
            if spec.has(name) and spec.value[name] is not None:
                asked.append((f"structured_outputs.{name}", name, spec.value[name]))
        spec.get("disable_fallback", "boolean")
        spec.get("disable_any_whitespace", "boolean")
        spec.get("disable_additional_properties", "boolean")
        spec.get("whitespace_pattern", "string")
        spec.done()
    for field, kind in _GUIDED.items():
        if body.has(field) and body.value[field] is not None:
            asked.append((field, kind, body.value[field]))
    body.get("guided_decoding_backend", "string")
    body.get("guided_whitespace_pattern", "string")
    if len(asked) + (fmt is not None) > 1:
        names = [a[0] for a in asked] + (["response_format"] if fmt is not None else [])
        raise InvalidValueError(names[1], "(constraint)",
                                f"give one constraint, not {' and '.join(names)}")
    if not asked:
        return fmt
    field, kind, value = asked[0]
    if kind == "json":
        if not isinstance(value, (dict, bool, str)):
            raise InvalidValueError(field, value, "must be a JSON schema (an object)")
        return Grammar.json_schema(value, field=field)
    if kind == "json_object":
        if value is not True:
            raise InvalidValueError(field, value, "must be true")
        return Grammar.json_object()
    if kind == "regex":
        if not isinstance(value, str):
            raise InvalidValueError(field, value, "must be a string")
        return Grammar.regex(value, field=field)
    if kind == "choice":
        if not isinstance(value, list):
            raise InvalidValueError(field, value, "must be a list of strings")
        return Grammar.choice(value, field=field)
    if not isinstance(value, str):
        raise InvalidValueError(field, value, "must be a grammar's text (Lark or EBNF)")
    return Grammar.text(value, field=field)


# --- Anthropic -----------------------------------------------------------------------------

# billing and model fallbacks (a substitute model when the requested one declines: ours
# never does): their JSON types, checked, then ignored
_BETA_IGNORED: dict[str, tuple[tuple[str, ...], str | None]] = {
    "billing_policy": (("object",), None), "fallbacks": (("array",), "default"),
    "fallback_credit_token": (("string", "object"), None)}
_SERVER_TOOLS = "only custom (client) tools exist here, no server tools"


def anthropic_fields(body: Obj) -> Grammar | None:
    """Anthropic fields with no meaning here (type-checked, ignored) and ones asking for
    what is not here (refused), of ``/v1/messages`` and ``/v1/messages/count_tokens`` alike
    (a count takes a Messages body without ``max_tokens``, ``stream`` and ``metadata``).
    Returns the grammar ``output_config.format`` asks for (``{"type": "json_schema",
    "schema": {...}}``), if any."""
    cache_control(body)
    output = body.obj("output_config")
    grammar = None
    if output is not None:
        one_of(output, "effort", ("low", "medium", "high", "xhigh", "max"))
        fmt = output.obj("format")
        if fmt is not None:
            if one_of(fmt, "type", ("json_schema",)) is None:
                raise InvalidValueError("output_config.format.type", None, "is required")
            grammar = Grammar.json_schema(fmt.need("schema", "object"),
                                          field="output_config.format.schema")
            fmt.done()
        output.done()
    one_of(body, "speed", ("standard", "fast"))
    body.get("user_profile_id", "string")
    body.get("workspace_id", "string")
    one_of(body, "service_tier", ("auto", "standard_only"))
    body.get("inference_geo", "string")
    diagnostics = body.obj("diagnostics")
    if diagnostics is not None:
        diagnostics.get("previous_message_id", "string")
        diagnostics.done()
    _container(body)
    read(body, ANTHROPIC_REFUSED)
    for name, (kinds, literal) in _BETA_IGNORED.items():
        _loosely(body, name, kinds, literal)
    return grammar


def _loosely(body: Obj, name: str, kinds: tuple[str, ...], literal: str | None) -> None:
    """A field that must be of one of the JSON ``kinds``, or the string ``literal``."""
    value = body.value.get(name)
    body.has(name)
    if value is None or (literal is not None and value == literal):
        return
    for kind in kinds:
        try:
            check(name, value, kind)
            return
        except InvalidValueError:
            continue
    allowed = [f"{'an' if k[0] in 'aeiou' else 'a'} {k}" for k in kinds]
    allowed += [repr(literal)] if literal is not None else []
    raise InvalidValueError(name, value, f"must be {' or '.join(allowed)}")


def cache_control(body: Obj) -> None:
    """``cache_control``: a prompt-caching hint (``{"type": "ephemeral", "ttl"?}``)."""
    hint = body.obj("cache_control")
    if hint is not None:
        kind = hint.need("type", "string")
        if kind != "ephemeral":
            raise InvalidValueError(hint.at("type"), kind, "must be 'ephemeral'")
        one_of(hint, "ttl", ("5m", "1h"))
        hint.done()


def _container(body: Obj) -> None:
    """``container``: an id (or ``{id, skills}``) of a code-execution container, which only
    server tools use; none run here."""
    value = body.value.get("container")
    body.has("container")
    if value is None or isinstance(value, str):
        return
    container = Obj(value, "container")
    container.get("id", "string")
    for path, skill in container.items("skills"):
        check(path, skill, "object")
    container.done()


def anthropic_tool(tool: Obj) -> None:
    """A custom tool's fields with no meaning here (type-checked, ignored; ``strict`` is
    type-checked here and read by the dialect, which then constrains the tool's calls); a
    server tool (any other ``type``) is refused."""
    kind = tool.get("type", "string", "custom")
    if kind != "custom":
        raise unsupported(tool.at("type"), kind, _SERVER_TOOLS)
    cache_control(tool)
    for path, caller in tool.items("allowed_callers"):
        check(path, caller, "string")
    tool.get("defer_loading", "boolean")
    tool.get("eager_input_streaming", "boolean")
    tool.get("strict", "boolean")
    for path, example in tool.items("input_examples"):
        check(path, example, "object")
