"""What a chat template does with tools, and the Hermes tool block for one that renders none.

Owns the probes of a template, :func:`probe_rendering` (its rendering of an assistant turn
that calls a tool: which call format it writes, :func:`pipeline.tools.formats.choose_parser`)
and :func:`renders_tools` (whether it shows the tools it is given, or at least writes calls in
a format of its own), and :func:`hermes_messages`, the documented fallback for templates that
do neither: the conversation rewritten so any template shows the tools and the calls, in the
Hermes format, as servers do for templates without tool support (docs/tools.md):

- the tool definitions go into the system message (one is added first when there is none),
  after its text, as the block Qwen 2.5's template writes: the functions as JSON lines inside
  ``<tools></tools>``, then how to call one (``<tool_call>`` ... ``</tool_call>``);
- an assistant turn's calls become its text: each call as
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after the turn's content;
- tool results become a ``user`` turn of ``<tool_response>`` ... ``</tool_response>`` blocks
  (consecutive results in one turn), since such a template may know no ``tool`` role.

The Hermes parser reads what the model writes back, so a call made under the fallback is
parsed like one under Qwen's own template; ``/tokenize`` and ``count_tokens`` count the block,
since they render through the same renderer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from pipeline.errors import PipelineError
from pipeline.contracts.request import Message, ToolCall, ToolSpec
from pipeline.contracts.text import Rendered, Renderer

PROBE_TOOL = ToolSpec("get_weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
PROBE_CALL = ToolCall("get_weather", '{"city": "Paris"}', "call12345")
PROBE_MESSAGES = (Message("system", "You are helpful."), Message("user", "Hello."))
SUFFIX = "+hermes_tools"
"""Added to the renderer's name in a rendering that used the fallback (the trace shows it)."""

_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
           "You are provided with function signatures within <tools></tools> XML tags:\n"
           "<tools>")
_FOOTER = ("</tools>\n\nFor each function call, return a json object with function name and "
           "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
           '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def probe_rendering(renderer: Renderer) -> str:
    """The template's rendering of an assistant turn that calls a tool ("" if it cannot)."""
    probe = (Message("user", "What is the weather in Paris?"),
             Message("assistant", None, (PROBE_CALL,)))
    try:
        return renderer.render(probe, tools=(PROBE_TOOL,), add_generation_prompt=False).text
    except (PipelineError, ValueError, TypeError, KeyError):
        return ""


def renders_tools(render: Callable[[Sequence[Message], Sequence[ToolSpec]], Rendered]) -> bool:
    """Whether ``render`` (a template's rendering of messages and tools) knows tools at all:
    a probe conversation renders differently with a tool than without, or an assistant turn
    renders differently with a call than without (a template that writes calls in its own
    format keeps it). A template that fails on a probe counts as knowing them (its own error
    then reaches the caller)."""
    try:
        if render(PROBE_MESSAGES, (PROBE_TOOL,)).text != render(PROBE_MESSAGES, ()).text:
            return True
        with_call = [*PROBE_MESSAGES, Message("assistant", None, (PROBE_CALL,))]
        without = [*PROBE_MESSAGES, Message("assistant", "")]
        return render(with_call, (PROBE_TOOL,)).text != render(without, (PROBE_TOOL,)).text
    except (PipelineError, ValueError, TypeError, KeyError):
        return True


def tool_block(tools: Sequence[ToolSpec]) -> str:
    """The system-prompt block that describes ``tools`` and the call format."""
    lines = [json.dumps(t.to_template(), ensure_ascii=False) for t in tools]
    return "\n".join([_HEADER, *lines, _FOOTER])


def hermes_messages(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> list[Message]:
    """``messages`` with ``tools`` in the system message and calls and results as text."""
    block = tool_block(tools) if tools else ""
    out: list[Message] = []
    if block:
        first = messages[0] if messages else None
        if first is not None and first.role == "system":
            text = f"{first.content}\n\n{block}" if first.content else block
            out.append(Message("system", text))
            messages = messages[1:]
        else:
            out.append(Message("system", block))
    for message in messages:
        if message.role == "tool":
            result = f"<tool_response>\n{message.content or ''}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content is not None \
                    and out[-1].content.startswith("<tool_response>"):
                out[-1] = Message("user", f"{out[-1].content}\n{result}")
            else:
                out.append(Message("user", result))
        elif message.role == "assistant" and message.tool_calls:
            calls = [_call_text(c.name, c.arguments) for c in message.tool_calls]
            text = "\n".join(([message.content] if message.content else []) + calls)
            out.append(Message("assistant", text, reasoning_content=message.reasoning_content))
        else:
            out.append(message)
    return out


def _call_text(name: str, arguments: str) -> str:
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        args = arguments   # the model's own text, kept as it wrote it
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}' \
           "\n</tool_call>"
