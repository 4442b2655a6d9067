"""Tool-call grammars in the Hermes format (DESIGN §11).

Owns the grammars of tool calls as the chat templates of the tiny model, SmolLM2 and Qwen
write them (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), ``name``
one of the allowed tools' names and ``arguments`` valid for that tool's ``parameters``
schema:

- :func:`tool_call_grammar`: exactly one call (``tool_choice`` required, or named): the
  output parses as a call to an allowed tool on every seed;
- :func:`tools_grammar`: the model may call (``tool_choice`` auto) but whatever call it makes
  is valid: with a response format, the output is one call or the format's JSON (so tools
  stay callable beside ``response_format``); without one (tools marked ``strict``), free text
  with calls in it, each call constrained from its ``<tool_call>`` on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.errors import InvalidValueError
from pipeline.grammar import JSON_LAYOUT, Grammar
from pipeline.types import ToolSpec

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_OPEN = json.dumps(TOOL_OPEN)
_BODY = f'body: "\\n" %json {{schema}} {json.dumps(chr(10) + TOOL_CLOSE)}\n'
# free text with no call opening in it; text that ends by opening a call
_TEXT = ('PLAIN: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n'
         'LEAD: /(?s:.*)<tool_call>/ & ~/(?s:.*)<tool_call>(?s:.+)/\n')


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.name},
                           "arguments": tool.to_template()["function"]["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def _calls(tools: Sequence[ToolSpec]) -> str:
    """The ``body`` rule: a call's JSON to any of ``tools``, then the closing marker. Each
    tool's schema is compiled alone first, so an unsupported feature names its tool."""
    for tool in tools:
        Grammar.json_schema(_call_schema(tool), field=f"tools[{tool.name}].parameters")
    schema = {"anyOf": [_call_schema(t) for t in tools], "x-guidance": JSON_LAYOUT}
    return _BODY.replace("{schema}", json.dumps(schema))


def tool_call_grammar(tools: Sequence[ToolSpec], name: str = "") -> Grammar:
    """One call to ``name`` (``""``: to any of ``tools``), its arguments valid for that tool's
    schema. :class:`InvalidValueError` when no tool is allowed or a tool's schema uses a
    feature the grammar engine lacks (naming the tool)."""
    allowed = [t for t in tools if not name or t.name == name]
    if not allowed:
        raise InvalidValueError("tool_choice", name or "required", "no tool to call")
    return Grammar.lark(f"start: {_OPEN} body\n{_calls(allowed)}", field="tool_choice")


def tools_grammar(tools: Sequence[ToolSpec], answer: Grammar | None) -> Grammar:
    """Calls to ``tools`` that validate, the model free to make none: one call or the JSON
    ``answer`` asks for (a ``json_schema`` or ``json_object`` grammar), or, when ``answer`` is
    None, any text with valid calls in it."""
    if not tools:
        raise InvalidValueError("tools", [], "no tool to call")
    if answer is None:
        return Grammar.lark(f"start: (LEAD body)* PLAIN?\n{_TEXT}{_calls(tools)}",
                            field="tools")
    if answer.kind not in ("json_schema", "json_object"):
        raise InvalidValueError("grammar", answer.kind, "only a JSON answer combines with tools")
    schema = {"type": "object"} if answer.kind == "json_object" else json.loads(answer.source)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    text = (f"start: {_OPEN} body | answer\n{_calls(tools)}"
            f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}\n")
    return Grammar.lark(text, field=answer.field)
