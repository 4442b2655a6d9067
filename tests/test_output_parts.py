"""Typed output parts, made once by the engine: every delta's ``parts`` and the completion's.

Oracles: the text the model wrote (what the parts must account for, markers aside), the
tool call the scripted model was told to write (parsed by ``json.loads``, not by the
reader), and a second splitter fed the whole text at once (the parts may not depend on how
the text was cut into deltas).
"""

from __future__ import annotations

import json

from pipeline.output_parts import OutputSplitter, joined
from pipeline.types import Completion, Delta, Part, TextPart, ToolCallDelta, ToolCallEnd
from tests.http_support import TOOL_CALL_TEXT, thinker_model, tool_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def streamed(deltas: list[Delta]) -> list[Part]:
    parts: list[Part] = []
    for d in deltas:
        joined(parts, d.parts)
    return parts


def whole(text: str, thinking: bool) -> list[Part]:
    splitter = OutputSplitter(tools=None, thinking=thinking)
    parts: list[Part] = []
    joined(parts, splitter.feed(text) + splitter.finish())
    return parts


def test_a_tool_call_comes_out_typed_once_in_process() -> None:
    pipe, _ = tool_model()
    with pipe:
        handle = pipe.submit([{"role": "user", "content": "Weather in Paris?"}],
                             tools=[WEATHER], max_tokens=64, temperature=0)
        deltas = list(handle.deltas())
        done: Completion = handle.result()
    parts = streamed(deltas)
    assert parts == list(done.parts)
    want = json.loads(TOOL_CALL_TEXT.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    (first,) = [p for p in parts if isinstance(p, ToolCallDelta) and p.name is not None]
    assert first.name == want["name"] and first.arguments == ""
    arguments = "".join(p.arguments for p in parts if isinstance(p, ToolCallDelta))
    assert json.loads(arguments) == want["arguments"]
    (end,) = [p for p in parts if isinstance(p, ToolCallEnd)]
    assert end.call is not None and json.loads(end.call.arguments) == want["arguments"]
    assert done.tool_calls == (end.call,)
    # the deltas' own tool_calls are the call deltas among their parts
    assert [c for d in deltas for c in d.tool_calls] == [
        p for d in deltas for p in d.parts if isinstance(p, ToolCallDelta)]
    assert not any(isinstance(p, TextPart) and "<tool_call>" in p.text for p in parts)


def test_thinking_is_typed_as_the_text_is_released() -> None:
    with thinker_model() as pipe:
        handle = pipe.submit([{"role": "user", "content": "Think, then answer."}],
                             max_tokens=12, reasoning_budget_tokens=4, temperature=0)
        deltas = list(handle.deltas())
        done = handle.result()
    parts = streamed(deltas)
    assert parts == list(done.parts)
    kinds = [p.kind for p in parts if isinstance(p, TextPart)]
    assert kinds == ["thinking", "text"], parts
    assert parts == whole(done.text, thinking=False)  # however the deltas cut the text
    thinking, answer = (p.text for p in parts if isinstance(p, TextPart))
    assert "<think>" in done.text and "</think>" in done.text
    assert thinking and thinking in done.text and answer == "Done."
