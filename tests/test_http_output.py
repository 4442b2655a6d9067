"""The output splitter (thinking / text / tool calls): fed at every split it agrees with a
plain regular-expression reading of the whole text; a call's arguments are the model's own
text (oracle: ``json`` reading what the model wrote); and the engine's reasoning budget."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.handle import RequestHandle
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked
from pipeline.contracts.output import Delta, FinishReason, ToolCallEnd
from pipeline.tools.formats import HermesParser
from pipeline.tools.scan import judge
from transports.http.server.inbox import batches
from pipeline.output_parts import OutputSplitter, Part, TextPart

TEXT = ('<think>The user wants weather.</think>Let me check.\n<tool_call>\n{"name": "get_weather",'
        ' "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n<tool_call>\n{"name": "bad"'
        '\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>\n')


# Qwen3's layout: newlines open and close the reasoning, and separate it from the answer.
LAID_OUT = TEXT.replace("<think>The user wants weather.</think>",
                        "<think>\nThe user\n\nwants weather.\n</think>\n\n")


def regex_reading(text: str) -> tuple[str, str, list[tuple[str, dict[str, object]]], str]:
    """(thinking, text, calls, leftover) by a second, whole-text implementation; reasoning
    and the answer after it lose their outer newlines, as Qwen3's model card strips them."""
    thinking = "".join(b.strip("\n") for b in re.findall(r"<think>(.*?)</think>", text, re.S))
    rest = re.sub(r"<think>.*?</think>\n*", "", text, flags=re.S)
    calls, shown = [], []
    at, after_call = 0, False
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>", rest, re.S):
        gap = rest[at:m.start()]
        if not (after_call and not gap.strip()):  # whitespace right after a call is not shown
            shown.append(gap)
        try:
            body = json.loads(m.group(1))
            calls.append((body["name"], body["arguments"]))
            after_call = True
        except (ValueError, KeyError):
            shown.append(m.group(0))
            after_call = False
        at = m.end()
    tail = rest[at:]
    return thinking, "".join(shown), calls, tail


def split(text: str, cuts: list[int]) -> list[Part]:
    splitter = OutputSplitter(tools=HermesParser().start("req"))
    parts = []
    at = 0
    for cut in [*cuts, len(text)]:
        parts += splitter.feed(text[at:cut])
        at = cut
    return parts + splitter.finish()


def summary(parts: list[Part]) -> tuple[str, str, list[tuple[str, object]]]:
    thinking = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "thinking")
    text = "".join(p.text for p in parts if isinstance(p, TextPart) and p.kind == "text")
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in parts
             if isinstance(p, ToolCallEnd) and p.call is not None]
    return thinking, text, calls


@pytest.mark.parametrize("text", [TEXT, LAID_OUT], ids=["plain", "laid-out"])
def test_every_split_agrees_with_the_regex_reading(text: str) -> None:
    thinking, shown, calls, tail = regex_reading(text)
    assert tail.strip() == ""  # whitespace after the last call is not shown
    expected = (thinking, shown, calls)
    assert expected[2] == [("get_weather", {"city": "Paris", "unit": "°C"}), ("time", {})]
    assert thinking in ("The user wants weather.", "The user\n\nwants weather.")
    for cut in range(len(text) + 1):
        assert summary(split(text, [cut])) == expected, cut
    assert summary(split(text, list(range(1, len(text))))) == expected


def test_a_prompt_that_opened_thinking_starts_the_output_as_thinking() -> None:
    splitter = OutputSplitter(tools=None, thinking=True)
    parts = splitter.feed("plan it</th") + splitter.feed("ink>answer") + splitter.finish()
    assert summary(parts) == ("plan it", "answer", [])


def test_without_tools_markers_stay_text_and_unclosed_calls_are_kept() -> None:
    splitter = OutputSplitter(tools=None)
    parts = splitter.feed("a <tool_call>{}</tool_call> b") + splitter.finish()
    assert summary(parts) == ("", "a <tool_call>{}</tool_call> b", [])
    assert summary(split('x<tool_call>{"name": "f"', [3])) == ("", 'x<tool_call>{"name": "f"', [])


THINK_OPEN, THINK_CLOSE = ord("{"), ord("}")


class ThinkTokenizer(ByteTokenizer):
    """The byte tokenizer, with "{" and "}" standing for the thinking markers."""

    def encode_text(self, text: str, *, special: bool = False) -> list[int]:
        markers = {"<think>": [THINK_OPEN], "</think>": [THINK_CLOSE]}
        return markers[text] if special and text in markers else super().encode_text(
            text, special=special)


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_reasoning_budget_forces_the_end_of_thinking_marker(budget: int) -> None:
    """A model that would think forever ("{" then "a" for ever) is cut at the budget: the
    engine forces "}" after exactly ``budget`` thinking tokens, and the model, seeing the
    marker, answers ("!") and stops."""
    vocab = ByteTokenizer.VOCAB
    eos = 256

    def choose(ids: list[int]) -> int:
        if ids[-1] == THINK_CLOSE:
            return ord("!")
        if ids[-1] == ord("!"):
            return eos
        return ord("a") if THINK_OPEN in ids else THINK_OPEN

    backend = ScriptedBackend(vocab, peaked(vocab, choose))
    with build_scripted(backend, tokenizer=ThinkTokenizer()) as pipe:
        done = pipe.generate("q", max_tokens=50, temperature=0, reasoning_budget_tokens=budget)
        free = pipe.generate("q", max_tokens=20, temperature=0)
    ids = list(done.token_ids)
    assert ids == [THINK_OPEN] + [ord("a")] * budget + [THINK_CLOSE, ord("!"), eos]
    assert [e.event_type for e in done.trace].count("reasoning.budget_reached") == 1
    assert THINK_CLOSE not in free.token_ids and len(free.token_ids) == 20  # no budget: no cut


def test_a_forced_prefix_comes_first_then_the_model_goes_on() -> None:
    vocab = ByteTokenizer.VOCAB
    backend = ScriptedBackend(vocab, peaked(vocab, lambda ids: ord("a")))
    with build_scripted(backend) as pipe:
        done = pipe.generate("q", max_tokens=6, temperature=0, forced_prefix=(ord("x"), ord("y")),
                             logprobs=True)
    assert done.text == "xyaaaa"
    assert [e.event_type for e in done.trace].count("token.forced") == 2
    assert done.logprobs is not None and [lp.logprob for lp in done.logprobs[:2]] == [0.0, 0.0]


def test_batches_merge_deltas_in_order_and_an_early_exit_cancels() -> None:
    """Deltas of a real engine reach the event loop merged, in order, ending with the final
    one; closing the iterator early (what the server does when a client leaves) cancels."""
    vocab = ByteTokenizer.VOCAB
    backend = ScriptedBackend(vocab, peaked(vocab, lambda ids: ord("a") + len(ids) % 26))

    async def collect(handle: RequestHandle) -> list[Delta]:
        return [d async for d in batches(handle, ping_s=5.0) if d is not None]

    async def leave_early(handle: RequestHandle) -> None:
        stream = batches(handle, ping_s=5.0)
        assert (await anext(stream)) is not None
        await stream.aclose()

    with build_scripted(backend) as pipe:
        handle = pipe.submit("q", max_tokens=400, temperature=0)
        got = asyncio.run(collect(handle))
        done = handle.result(timeout=10)
        assert "".join(d.text for d in got) == done.text and len(done.text) == 400
        assert [t for d in got for t in d.token_ids] == list(done.token_ids)
        assert got[-1].final and not handle.cancel_requested
        slow = ScriptedBackend(vocab, peaked(vocab, lambda ids: ord("a")), delay_s=0.01)
        with build_scripted(slow) as slow_pipe:
            early = slow_pipe.submit("q", max_tokens=5000, temperature=0)
            asyncio.run(leave_early(early))
            assert early.cancel_requested
            assert early.result(timeout=10).finish_reason is FinishReason.CANCELLED


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": NaN}}',
    '{"name": "f", "arguments": {"x": Infinity}}',
    '{"name": "f", "arguments": "{\\"x\\": -Infinity}"}',
    '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"name": "\\ud800", "arguments": {}}',
    '{"name": "f", "arguments": {"\\udfff": 1}}',
])
def test_model_output_that_is_not_json_text_is_no_tool_call(body: str) -> None:
    # what a model may write: answering with it must never fail (NaN cannot be encoded in a
    # JSON answer, deep nesting overflows the parser, a lone surrogate cannot be sent)
    assert isinstance(judge(body), str)


@pytest.mark.parametrize(("body", "arguments"), [
    ('{"name": "f", "arguments": {"city": "Paris", "n": 1.50}}', '{"city": "Paris", "n": 1.50}'),
    ('{"name":"f","arguments":{"city":"Paris"}}', '{"city":"Paris"}'),
    ('{ "arguments" :\n  {\n    "a": [1, {"b": "}"}]\n  } , "name": "f" }',
     '{\n    "a": [1, {"b": "}"}]\n  }'),
    ('{"name": "f", "arguments": "{\\"x\\": \\"é\\"}"}', '{"x": "é"}'),
    ('{"name": "f", "parameters": {"x": "\\u00e9"}}', '{"x": "\\u00e9"}'),
    ('{"name": "f"}', '{}'),
])
def test_a_tool_call_s_arguments_are_the_model_s_own_text(body: str, arguments: str) -> None:
    """Not a re-encoding: sent back in the next turn, the call renders as it was generated
    (so the prefix cache can reuse it); the text still means what the model wrote."""
    call = _hermes_call(body)
    assert call is not None and call.name == "f" and call.arguments == arguments
    value = json.loads(body)
    wrote = value.get("arguments", value.get("parameters", {}))
    assert json.loads(call.arguments) == (json.loads(wrote) if isinstance(wrote, str) else wrote)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(args=st.dictionaries(st.text(max_size=6), _JSON, max_size=4),
       extra=st.dictionaries(st.text(max_size=6), _JSON, max_size=2),
       indent=st.sampled_from([None, 0, 2]),
       separators=st.sampled_from([(",", ":"), (", ", ": "), (" , ", " :  ")]),
       ascii_only=st.booleans(), arguments_first=st.booleans())
def test_arguments_text_is_cut_from_any_layout(args: dict[str, object], extra: dict[str, object],
                                               indent: int | None,
                                               separators: tuple[str, str], ascii_only: bool,
                                               arguments_first: bool) -> None:
    members = {k: v for k, v in extra.items() if k not in ("name", "arguments", "parameters")}
    call = {"arguments": args, "name": "f"} if arguments_first else {"name": "f", "arguments": args}
    body = json.dumps({**members, **call} if arguments_first else {**call, **members},
                      indent=indent, separators=separators, ensure_ascii=ascii_only)
    parsed = _hermes_call(body)
    # a piece of what the model wrote, which reads as the arguments it wrote
    assert parsed is not None and parsed.arguments in body
    assert parsed.arguments.startswith("{") and parsed.arguments.endswith("}")
    assert json.loads(parsed.arguments) == args


def _hermes_call(body: str) -> object:
    """The call the Hermes reader makes of ``body`` between its markers (None if malformed)."""
    reader = HermesParser().start("r")
    pieces = reader.feed(f"<tool_call>\n{body}\n</tool_call>") + reader.finish()
    ends = [p for p in pieces if isinstance(p, ToolCallEnd)]
    return ends[0].call if ends else None


def _sse_bodies(data: bytes) -> list[dict[str, object]]:
    return [json.loads(line[len("data: "):]) for line in data.decode().splitlines()
            if line.startswith("data: {")]


def test_both_dialects_stream_argument_fragments_as_the_text_arrives() -> None:
    """Fed one character per engine delta, the OpenAI chunks carry the call's id and name,
    then its arguments in fragments; Anthropic opens a tool_use block and streams
    input_json_delta fragments; both join to the call's arguments."""
    from pipeline.contracts.request import Message, Request
    from transports.http.dialects.anthropic import MessageStream
    from transports.http.dialects.common import Parsed
    from transports.http.dialects.openai import ChatStream

    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = Parsed("m", Request(messages=[Message("user", "hi")]), True, False, True)
    chat, message = ChatStream(parsed, "r", ByteTokenizer()), MessageStream(parsed, "r", 0)
    out_chat, out_message = b"", b""
    splitters = [OutputSplitter(tools=HermesParser().start("r")) for _ in range(2)]
    for seq, char in enumerate(text):
        final = seq == len(text) - 1
        delta = Delta("r", seq, char, finish_reason=FinishReason.EOS if final else None)
        parts = [s.feed(char) + (s.finish() if final else []) for s in splitters]
        out_chat += chat.delta(0, parts[0], delta)
        out_message += message.delta(0, parts[1], delta)
    calls = [c for body in _sse_bodies(out_chat) for choice in body["choices"]  # type: ignore[attr-defined]
             for c in choice["delta"].get("tool_calls", [])]
    assert calls[0]["id"] and calls[0]["function"]["name"] == "get_weather"
    fragments = [c["function"]["arguments"] for c in calls[1:]]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'
    events = _sse_bodies(out_message)
    kinds = [e["type"] for e in events]
    start = kinds.index("content_block_start", kinds.index("content_block_stop"))
    assert events[start]["content_block"]["name"] == "get_weather"  # type: ignore[index]
    partial = [e["delta"]["partial_json"] for e in events  # type: ignore[index]
               if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]  # type: ignore[index]
    assert len(partial) > 5 and "".join(partial) == '{"city": "Paris"}'
    assert kinds[-1] == "content_block_stop"


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": 1}, "arguments": {"x": 2}}',
    '{"name": "f", "arguments": {"x": 1}, "parameters": {"x": 2}}',
])
def test_a_call_with_two_arguments_members_is_malformed(body: str) -> None:
    # their fragments were streamed one after the other: no one object to hand a client
    assert _hermes_call(body) is None
