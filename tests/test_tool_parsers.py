"""The tool-call parsers against the chat templates' own rendering of tool calls.

Oracle: transformers renders an assistant turn with tool calls through each format's template
(tests/tool_templates.py); the reader must give back exactly those calls, whether fed the
whole text, split at any character boundary, or one token at a time; its streamed argument
fragments must join to each call's arguments. Template detection picks each format from the
template's rendering alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from pipeline import build
from pipeline.contracts.text import ToolCallParser, ToolCallReader
from pipeline.registry import BuildContext, Registry
from pipeline.contracts.output import OutputPiece, TextPiece, ToolCallDelta, ToolCallEnd
from pipeline.contracts.request import ToolCall
from pipeline.tools.formats import HermesParser, Llama3Parser, MistralParser, choose_parser
from qwen_files import oracle as qwen_oracle
from qwen_files import renderer as qwen_renderer
from stages.render import HFChatTemplateRenderer
from tool_templates import LLAMA31_CALLS, MISTRAL_V3_CALLS, render_turn, tiny_oracle
from pipeline.output_parts import OutputSplitter, TextPart

CALLS = [
    ToolCall("get_weather", json.dumps({"city": "Zürich", "days": [1, 2],
                                        "opts": {"unit": "°C", "note": "a \"quoted\" }{ ]"}}),
             "abcdefgh1"),
    ToolCall("now", "{}", "abcdefgh2"),
]
HEADER = "<|start_header_id|>assistant<|end_header_id|>\n\n"
ENDS = ("<|im_end|>\n", "<|im_end|>", "<|eot_id|>")


def model_output(rendered: str) -> str:
    """The text a model writes for the turn: without the turn's header and end marker."""
    text = rendered.removeprefix(HEADER)
    for end in ENDS:
        if text.endswith(end):
            return text[:-len(end)]
    return text


def read(parser: ToolCallParser, pieces: Sequence[str]) -> tuple[list[OutputPiece],
                                                               ToolCallReader]:
    reader = parser.start("req-1")
    out: list[OutputPiece] = []
    for piece in pieces:
        out += reader.feed(piece)
    return out + reader.finish(), reader


def reading(parser: ToolCallParser, pieces: Sequence[str]) -> tuple[str, list[tuple[str, Any]]]:
    """(answer text, [(name, arguments)]) from the finished calls, after checking that the
    streamed deltas say the same: name first, fragments joining to the arguments."""
    out, reader = read(parser, pieces)
    streamed: dict[int, list[ToolCallDelta]] = {}
    for piece in out:
        if isinstance(piece, ToolCallDelta):
            streamed.setdefault(piece.index, []).append(piece)
    ends = [p for p in out if isinstance(p, ToolCallEnd) and p.call is not None]
    assert [e.call for e in ends] == list(reader.calls)
    for end in ends:
        assert end.call is not None
        deltas = streamed[end.index]
        assert deltas[0].name == end.call.name and deltas[0].id == end.call.id
        assert all(d.name is None for d in deltas[1:])
        assert "".join(d.arguments for d in deltas) == end.call.arguments
    text = "".join(p.text for p in out if isinstance(p, TextPiece))
    return text, [(c.name, json.loads(c.arguments)) for c in reader.calls]


def expected(calls: Sequence[ToolCall]) -> tuple[str, list[tuple[str, Any]]]:
    return "", [(c.name, json.loads(c.arguments)) for c in calls]


def splits(text: str) -> list[list[str]]:
    """The whole text, every two-piece split, and one character at a time."""
    return [[text], *([text[:cut], text[cut:]] for cut in range(1, len(text))), list(text)]


def token_pieces(text: str) -> list[str]:
    """``text`` as a detokenizer streams it: one token at a time (tiny model's tokenizer)."""
    tok = tiny_oracle()
    ids = tok.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k])
        if not now.endswith("\ufffd"):
            pieces.append(now[len(done):])
            done = now
    assert done == text
    return pieces


FORMATS = {
    "hermes": (HermesParser(), None, CALLS),
    "llama3_json": (Llama3Parser(), LLAMA31_CALLS, CALLS[:1]),  # Llama 3.1: one call a turn
    "mistral": (MistralParser(), MISTRAL_V3_CALLS, CALLS),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_template_rendering_reads_back_at_every_split(name: str) -> None:
    parser, template, calls = FORMATS[name]
    text = model_output(render_turn(tiny_oracle(), calls, template))
    assert reading(parser, [text]) == expected(calls), text
    for pieces in splits(text):
        assert reading(parser, pieces) == expected(calls), pieces
    assert reading(parser, token_pieces(text)) == expected(calls)


def test_qwen3s_rendering_reads_back_through_the_http_splitter() -> None:
    """Qwen3's template writes an (empty) thinking block before its calls: the splitter
    strips it, the Hermes reader takes the rest, at every split and every Qwen3 token."""
    text = model_output(render_turn(qwen_oracle(), CALLS))
    assert text.startswith("<think>")
    ids = qwen_oracle().encode(text, add_special_tokens=False)
    by_token, done = [], ""
    for k in range(1, len(ids) + 1):
        now = qwen_oracle().decode(ids[:k])
        if not now.endswith("\ufffd"):
            by_token.append(now[len(done):])
            done = now
    for pieces in [*splits(text), by_token]:
        splitter = OutputSplitter(tools=HermesParser().start("r"))
        parts = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
        text_parts = [p for p in parts if isinstance(p, TextPart) and p.text.strip()]
        calls = [(p.call.name, json.loads(p.call.arguments)) for p in parts
                 if isinstance(p, ToolCallEnd) and p.call is not None]
        assert (text_parts, calls) == ([], expected(CALLS)[1]), pieces


def test_answer_text_around_calls_is_kept_and_bad_calls_stay_text() -> None:
    text = ('Sure.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>\nDone.')
    for pieces in splits(text):
        out, reader = read(HermesParser(), pieces)
        shown = "".join(p.text for p in out if isinstance(p, TextPiece))
        assert [c.name for c in reader.calls] == ["now"]
        assert shown == ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n'
                         '</tool_call>\nDone.'), pieces
        bad = [p for p in out if isinstance(p, ToolCallEnd) and p.call is None]
        assert len(bad) == 1 and "not JSON" in str(bad[0].error)


@pytest.mark.parametrize("text", ["The answer is {42}.", '{"answer": 42}', "<|python_tag",
                                  '{"name": "f", "parameters": {"a": 1'])
def test_llama_output_that_is_not_a_whole_call_is_text(text: str) -> None:
    for pieces in splits(text):
        out, reader = read(Llama3Parser(), pieces)
        assert reader.calls == ()
        assert "".join(p.text for p in out if isinstance(p, TextPiece)) == text, pieces


def test_llama_python_tag_and_several_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    for pieces in splits(text):
        assert reading(Llama3Parser(), pieces) == ("", [("a", {"x": 1}), ("b", {})]), pieces


def test_arguments_stream_before_the_call_closes() -> None:
    reader = HermesParser().start("r")
    first = reader.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [type(p) for p in first] == [ToolCallDelta, ToolCallDelta]
    assert first[0].name == "get_weather" and first[1].arguments == '{"city": "Par'
    rest = reader.feed('is"}}\n</tool_call>') + reader.finish()
    assert "".join(p.arguments for p in rest if isinstance(p, ToolCallDelta)) == 'is"}'
    assert reader.calls[0].arguments == '{"city": "Paris"}'


def test_mistral_ids_fit_its_template() -> None:
    """Ids the Mistral reader makes are accepted by Mistral's template when fed back."""
    text = model_output(render_turn(tiny_oracle(), CALLS, MISTRAL_V3_CALLS))
    _, reader = read(MistralParser(), [text])
    again = render_turn(tiny_oracle(), list(reader.calls), MISTRAL_V3_CALLS)
    assert reading(MistralParser(), [model_output(again)]) == expected(CALLS)


@pytest.mark.parametrize("template,name", [(LLAMA31_CALLS, "llama3_json"),
                                           (MISTRAL_V3_CALLS, "mistral")])
def test_build_picks_the_parser_the_template_writes(template: str, name: str) -> None:
    registry = Registry()
    renderer = HFChatTemplateRenderer.from_template(template, special_tokens={
        "eos_token": "</s>"})
    chosen = choose_parser(registry, BuildContext(), None, renderer)
    assert chosen is not None and chosen.name == name
    assert choose_parser(registry, BuildContext(), None, qwen_renderer()).name == "hermes"
    with build("tiny") as pipe:
        assert pipe.stages.tool_parser is not None
        assert pipe.stages.tool_parser.name == "hermes"


def test_parsers_satisfy_the_protocols() -> None:
    for parser in (HermesParser(), Llama3Parser(), MistralParser()):
        checked: ToolCallParser = parser
        reader: ToolCallReader = checked.start("r")
        assert isinstance(checked, ToolCallParser) and isinstance(reader, ToolCallReader)


def test_a_call_mentioned_while_thinking_is_not_made() -> None:
    """Qwen3 reasons first; a call it only considers there is text, the one after is made."""
    text = ('<think>\nMaybe <tool_call>{"name": "now", "arguments": {}}</tool_call>?\n</think>'
            '\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>')
    for pieces in splits(text):
        shown, calls = reading(HermesParser(), pieces)
        assert calls == [("get_weather", {"city": "Oslo"})], pieces
        assert shown == text[:text.index("</think>") + len("</think>\n\n")], pieces


def test_a_complete_call_cut_before_its_closing_tag_is_made_and_a_partial_one_is_text() -> None:
    """A stop string of "</tool_call>" trims the closing tag: the call is still whole."""
    whole = '<tool_call>\n{"name": "now", "arguments": {}}\n'
    assert reading(HermesParser(), [whole]) == ("", [("now", {})])
    cut = '<tool_call>\n{"name": "now", "arguments": {"a": 1'
    out, reader = read(HermesParser(), [cut])
    assert reader.calls == () and "".join(p.text for p in out if isinstance(p, TextPiece)) == cut
    ended = [p for p in out if isinstance(p, ToolCallEnd)]
    assert len(ended) == 1 and "cut off" in str(ended[0].error)  # it had begun streaming
