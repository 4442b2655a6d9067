"""Tool-call grammars in each model family's own format (docs/design.md §11).

Owns the formats' markers, the :class:`CallGrammars` capability a parser offers (its
``calls``, which :mod:`pipeline.tools.choice` applies) and the grammars that make a model's
tool calls valid by construction, one class per format the parsers of
:mod:`pipeline.tools.formats` read, so a call a grammar forces is always parsed back:

- :class:`HermesCalls` (the tiny model, SmolLM2 through the renderer's fallback, Qwen):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, calls one per line;
- :class:`Llama3Calls` (Llama 3.x): the answer is the call, ``{"name": ..., "parameters":
  {...}}``, several joined by ``; ``;
- :class:`MistralCalls`: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.

Each has two grammars: :meth:`forced` (``tool_choice`` required or named: one call, or one or
more when parallel calls are allowed, with the text the output is made to start with) and
:meth:`optional` (``tool_choice`` auto: the model may answer instead, but a call it makes is
valid; with a JSON response format the answer is that JSON; without, free text). Where
several calls are allowed and the output is calls or JSON only (not free text), the grammar
asks for distinct calls (:attr:`~pipeline.grammar.Grammar.distinct_calls`): a call that
repeats an earlier one byte for byte ends the output, and the reader drops it
(:mod:`pipeline.tools.reader`), so a turn never holds the same call twice. In both,
``name`` is one of the allowed tools' names and the arguments validate against that tool's
``parameters``, which must be a valid object schema (else :class:`InvalidValueError` naming the
tool), rewritten as a response format's schema is (:mod:`pipeline.schema_compat`; a tool's
``uniqueItems`` is not enforced inside a call). A marker that is one special token of the
model's vocabulary (``[TOOL_CALLS]`` in Mistral's) is matched as that token (``<[id]>``), never
as text, which a special token's id would not spell (the ``marker`` argument:
:func:`text_marker` when every marker is text).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from pipeline.errors import InvalidValueError
from pipeline.grammar import JSON_LAYOUT, ForcedCall, Grammar, Marker, text_marker
from pipeline.schema_compat import ANY, ANY_NAME, without_unique
from pipeline.contracts.request import ToolSpec, check_tool_parameters

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"


@runtime_checkable
class CallGrammars(Protocol):
    """The grammars of one tool-call format (a parser's ``calls``)."""

    def forced(self, tools: Sequence[ToolSpec], name: str = "", *, parallel: bool = True,
               marker: Marker = text_marker) -> ForcedCall:
        """A required call to ``name`` (``""``: any of ``tools``)."""
        ...

    def optional(self, tools: Sequence[ToolSpec], answer: Grammar | None, *,
                 parallel: bool = True, marker: Marker = text_marker) -> Grammar:
        """Calls the model may make, each valid, or the ``answer``."""
        ...


def is_token(expression: str) -> bool:
    """Whether a marker's expression is a special token, not text."""
    return expression.startswith("<[")


def call_schema(tool: ToolSpec, arguments: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to ``tool``: its name, and its arguments under
    ``arguments`` (``parameters`` in Llama 3's format)."""
    check_tool_parameters(tool)
    parameters = tool.to_template()["function"]["parameters"]
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             arguments: parameters},
            "required": ["name", arguments], "additionalProperties": False}


def _any_call(tools: Sequence[ToolSpec], arguments: str) -> dict[str, Any]:
    """One call to any of ``tools``; each tool's schema is compiled alone first, so an
    unsupported feature names its tool."""
    if not tools:
        raise InvalidValueError("tools", [], "no tool to call")
    schemas = [without_unique(json.loads(Grammar.json_schema(
        call_schema(t, arguments), field=f"tools[{t.name}].parameters").source)) for t in tools]
    if len(schemas) == 1:
        one: dict[str, Any] = schemas[0]
        return one
    used = False   # the bound on open values, defined once at the new root
    for schema in schemas:
        defs = schema.get("$defs") or {}
        used = defs.pop(ANY_NAME, None) is not None or used
        if "$defs" in schema and not defs:
            del schema["$defs"]
    return {"anyOf": schemas, **({"$defs": {ANY_NAME: copy.deepcopy(ANY)}} if used else {})}


def _json(schema: Any) -> str:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"


def _answer(answer: Grammar) -> str:
    if answer.kind not in ("json_schema", "json_object"):
        raise InvalidValueError("grammar", answer.kind, "only a JSON answer combines with tools")
    return _json({"type": "object"} if answer.kind == "json_object"
                 else without_unique(json.loads(answer.source)))


def _picked(tools: Sequence[ToolSpec], name: str) -> list[ToolSpec]:
    allowed = [t for t in tools if not name or t.name == name]
    if not allowed:
        raise InvalidValueError("tool_choice", name or "required", "no tool to call")
    return allowed


class HermesCalls:
    """``<tool_call>`` blocks (Hermes, Qwen, the tiny model, the renderer's fallback)."""

    def forced(self, tools: Sequence[ToolSpec], name: str = "", *, parallel: bool = True,
               marker: Marker = text_marker) -> ForcedCall:
        """One call to ``name`` (``""``: any of ``tools``), or more when ``parallel``."""
        allowed = _picked(tools, name)
        first = TOOL_OPEN + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": '
                                    if name else "")
        more = f'("\\n" {marker(TOOL_OPEN)} body)*' if parallel else ""
        text = f"start: {marker(TOOL_OPEN)} body {more}\n{self._body(allowed, marker)}"
        return ForcedCall(first, Grammar.lark(text, field="tool_choice",
                                              distinct_calls=parallel))

    def optional(self, tools: Sequence[ToolSpec], answer: Grammar | None, *,
                 parallel: bool = True, marker: Marker = text_marker) -> Grammar:
        """Calls the model may make, each valid: one (or more when ``parallel``) or the JSON
        ``answer``; without ``answer``, free text with valid calls in it."""
        body = self._body(_picked(tools, ""), marker)
        opening = marker(TOOL_OPEN)
        if answer is not None:
            more = f'("\\n" {opening} body)*' if parallel else ""
            return Grammar.lark(f"start: {opening} body {more} | answer\n{body}"
                                f"answer: {_answer(answer)}\n", field=answer.field,
                                distinct_calls=parallel)
        if is_token(opening):
            text = (f"start: (PLAIN? {opening} body){'*' if parallel else '?'} PLAIN?\n"
                    f"PLAIN: /(?s:.+)/\n{body}")
        else:  # text with no opening in it; text that ends at its first opening
            text = (f"start: (LEAD body){'*' if parallel else '?'} PLAIN?\n"
                    "PLAIN: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n"
                    "LEAD: /(?s:.*)<tool_call>/ & ~/(?s:.*)<tool_call>(?s:.+)/\n" + body)
        return Grammar.lark(text, field="tools")

    @staticmethod
    def _body(tools: Sequence[ToolSpec], marker: Marker) -> str:
        return (f'body: "\\n" {_json(_any_call(tools, "arguments"))} "\\n" '
                f"{marker(TOOL_CLOSE)}\n")


class Llama3Calls:
    """Llama 3.x JSON calls: the answer is ``{"name", "parameters"}`` objects joined by
    ``; ``."""

    def forced(self, tools: Sequence[ToolSpec], name: str = "", *, parallel: bool = True,
               marker: Marker = text_marker) -> ForcedCall:
        """One call to ``name`` (``""``: any of ``tools``), or more when ``parallel``."""
        allowed = _picked(tools, name)
        first = f'{{"name": {json.dumps(name)}, "parameters": ' if name else ""
        more = '("; " call)*' if parallel else ""
        text = f"start: call {more}\ncall: {_json(_any_call(allowed, 'parameters'))}\n"
        return ForcedCall(first, Grammar.lark(text, field="tool_choice",
                                              distinct_calls=parallel))

    def optional(self, tools: Sequence[ToolSpec], answer: Grammar | None, *,
                 parallel: bool = True, marker: Marker = text_marker) -> Grammar:
        """Calls (one, or more when ``parallel``), or an answer: the JSON ``answer``, or
        text that does not open an object (the reader takes a leading ``{`` for a call)."""
        more = '("; " call)*' if parallel else ""
        other = "answer" if answer is not None else "TEXT"
        rules = (f"answer: {_answer(answer)}\n" if answer is not None
                 else "TEXT: /[^{\\s](?s:.*)/\n")
        text = (f"start: call {more} | {other}\n"
                f"call: {_json(_any_call(_picked(tools, ''), 'parameters'))}\n{rules}")
        return Grammar.lark(text, field=answer.field if answer is not None else "tools",
                            distinct_calls=parallel and answer is not None)


class MistralCalls:
    """Mistral calls: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``."""

    def forced(self, tools: Sequence[ToolSpec], name: str = "", *, parallel: bool = True,
               marker: Marker = text_marker) -> ForcedCall:
        """One call to ``name`` (``""``: any of ``tools``), or more when ``parallel``."""
        allowed = _picked(tools, name)
        first = MISTRAL_CALLS + (f'[{{"name": {json.dumps(name)}, "arguments": '
                                 if name else "")
        return ForcedCall(first, Grammar.lark(f"start: {self._calls(allowed, parallel, marker)}",
                                              field="tool_choice", distinct_calls=parallel))

    def optional(self, tools: Sequence[ToolSpec], answer: Grammar | None, *,
                 parallel: bool = True, marker: Marker = text_marker) -> Grammar:
        """The calls, or an answer: the JSON ``answer``, or text, which may end in the
        calls."""
        calls = self._calls(_picked(tools, ""), parallel, marker)
        if answer is not None:
            return Grammar.lark(f"start: {calls} | answer\nanswer: {_answer(answer)}\n",
                                field=answer.field, distinct_calls=parallel)
        opening = marker(MISTRAL_CALLS)
        plain = ("/(?s:.+)/" if is_token(opening) else
                 "/(?s:.+)/ & ~/(?s:.*)\\[TOOL_CALLS\\](?s:.*)/")
        return Grammar.lark(f"start: PLAIN? | PLAIN? {calls}\nPLAIN: {plain}\n", field="tools")

    @staticmethod
    def _calls(tools: Sequence[ToolSpec], parallel: bool, marker: Marker) -> str:
        items = _any_call(tools, "arguments")
        defs = items.pop("$defs", None)   # a definition belongs at the root
        array = {"type": "array", "items": items, "minItems": 1,
                 **({} if parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}
        return f"{marker(MISTRAL_CALLS)} {_json(array)}"

