"""Tool-call grammars: an output that is exactly one call to an allowed tool (DESIGN §11).

Owns :func:`tool_call_grammar`, the grammar of one call in the Hermes format the chat
templates of the tiny model, SmolLM2 and Qwen use (``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``): ``name`` is one of the allowed tools' names and ``arguments``
validates against that tool's ``parameters`` schema. With it, ``tool_choice`` required (any
tool) or named (that tool) yields a parseable, schema-valid call on every seed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pipeline.errors import InvalidValueError
from pipeline.grammar import JSON_LAYOUT, Grammar
from pipeline.types import ToolSpec

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": tool.name},
                           "arguments": tool.to_template()["function"]["parameters"]},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: Sequence[ToolSpec], name: str = "") -> Grammar:
    """One Hermes-format call to ``name`` (``""``: to any of ``tools``), its arguments valid
    for that tool's schema. :class:`InvalidValueError` when no tool is allowed or a tool's
    schema uses a feature the grammar engine lacks (naming the tool)."""
    allowed = [t for t in tools if not name or t.name == name]
    if not allowed:
        raise InvalidValueError("tool_choice", name or "required", "no tool to call")
    for tool in allowed:   # each alone first, so an error names its tool
        Grammar.json_schema(_call_schema(tool), field=f"tools[{tool.name}].parameters")
    schema = {"anyOf": [_call_schema(t) for t in allowed], "x-guidance": JSON_LAYOUT}
    text = (f"start: {json.dumps(TOOL_OPEN + chr(10))} call {json.dumps(chr(10) + TOOL_CLOSE)}\n"
            f"call: %json {json.dumps(schema)}\n")
    return Grammar.lark(text, field="tool_choice")
