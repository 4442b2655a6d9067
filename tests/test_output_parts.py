"""Typed output parts, made once by the engine: every delta's ``parts`` and the completion's.

Oracles: the text the model wrote (what the parts must account for, markers aside), the
tool call the scripted model was told to write (parsed by ``json.loads``, not by the
reader), and a second splitter fed the whole text at once (the parts may not depend on how
the text was cut into deltas).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai

from pipeline import build
from pipeline.engine.handle import RequestHandle
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.output_parts import OutputSplitter, joined
from pipeline.contracts.output import Completion, Delta, Part, TextPart, ToolCallDelta, ToolCallEnd
from tests.http_support import (
    TOOL_CALL_TEXT, config, endless_model, running, thinker_model, tool_model,
)
from transports import AsyncioTransport
from transports.http import Gateway

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


class CountingTransport:
    """The asyncio transport, noting every request it delivers."""

    name = "counting"

    def __init__(self) -> None:
        self.delivered: list[str] = []
        self.inner = AsyncioTransport()

    def deliver(self, handle: RequestHandle) -> AsyncIterator[Delta]:
        self.delivered.append(handle.request_id)
        return self.inner.deliver(handle)


def test_streams_go_through_the_pipelines_transport_stage(tmp_path: Path) -> None:
    # the HTTP server streams each choice through the async transport build() wired (it had
    # a bridge of its own beside the stage), as Pipeline.astream does
    counting = CountingTransport()
    plain, _ = endless_model()
    pipe = build(TINY_MODEL_DIR, backend=plain.engine.backend,  # type: ignore[union-attr]
                 async_transport=counting)
    plain.close()

    async def in_process() -> str:
        return "".join([d.text async for d in pipe.astream("x", max_tokens=3, temperature=0)])

    assert asyncio.run(in_process()) == "aaa" and len(counting.delivered) == 1
    gateway = Gateway(config(tmp_path), lambda f, c: pipe)
    with running(gateway) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        chunks = list(oa.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "go"}], max_tokens=3,
            n=2, stream=True, temperature=0))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks
                     if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == ["aaa", "aaa"]
    assert len(counting.delivered) == 3  # one per choice
    gateway.close()
