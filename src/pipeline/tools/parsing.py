"""Which tool-call parser a model gets: the one whose format its chat template writes.

Owns :func:`choose_parser`. Named parsers come from the registry (kind ``tool_parser``);
with none named, the template renders a probe conversation in which the assistant calls a
tool, and the first registered parser that recognizes that rendering wins (Hermes when the
template cannot render a call, the most common format and the tiny model's).
"""

from __future__ import annotations

from typing import cast

from pipeline.errors import PipelineError
from pipeline.contracts.text import Renderer, ToolCallParser
from pipeline.registry import BuildContext, Registry
from pipeline.contracts.request import Message, ToolCall, ToolSpec

FALLBACK = "hermes"
PROBE_TOOL = ToolSpec("get_weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
PROBE = (Message("user", "What is the weather in Paris?"),
         Message("assistant", None, (ToolCall("get_weather", '{"city": "Paris"}',
                                              "call12345"),)))


def probe_rendering(renderer: Renderer) -> str:
    """The template's rendering of an assistant turn that calls a tool ("" if it cannot)."""
    try:
        return renderer.render(PROBE, tools=(PROBE_TOOL,), add_generation_prompt=False).text
    except (PipelineError, ValueError, TypeError, KeyError):
        return ""


def choose_parser(registry: Registry, context: BuildContext,
                  value: str | ToolCallParser | None,
                  renderer: Renderer | None) -> ToolCallParser | None:
    """The parser ``value`` names (or is); for None, the one the renderer's template writes."""
    if value is not None and not isinstance(value, str):
        return value
    if isinstance(value, str):
        return cast(ToolCallParser, registry.create("tool_parser", value, context))
    if renderer is None:
        return None
    rendered = probe_rendering(renderer)
    names = registry.names("tool_parser")
    for name in names:
        parser = cast(ToolCallParser, registry.create("tool_parser", name, context))
        if rendered and parser.recognizes(rendered):
            return parser
    return (cast(ToolCallParser, registry.create("tool_parser", FALLBACK, context))
            if FALLBACK in names else None)
