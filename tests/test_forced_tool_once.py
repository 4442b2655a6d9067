"""A forced tool call is one call unless the request allows several, and never the same call
twice in one turn.

``tool_choice`` required or named (OpenAI chat and Responses), Anthropic ``any`` / ``tool``:
with parallel calls refused (``parallel_tool_calls=false``, ``disable_parallel_tool_use``)
exactly one call; with them allowed (each dialect's default) no two calls with the same name
and the same arguments text. Oracles: the official ``openai`` and ``anthropic`` SDKs (they
parse our responses and streams into their own types), ``json.loads`` of the arguments, and
for the reader a call text written by hand. The default model (``build()``) is the one that
repeated its call; a scripted model that writes the same call forever shows that the turn
ends right after the repeat instead of running to ``max_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
import pytest

from pipeline import EngineConfig, build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from pipeline.contracts.output import TextPiece, ToolCallDelta, ToolCallEnd
from pipeline.contracts.request import GenerationConfig, ToolSpec
from pipeline.tools.formats import HermesParser, Llama3Parser, MistralParser
from stages.tokenize import HFTokenizer
from tests.http_support import IM_END, IM_START, TOOL_CALL_TEXT, config, running
from transports.http import Gateway

KEY = "sk-test-key"
CASES = 11
"""The requests of the SDK test: all decoded together (a slot and a client thread each)."""
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
WEATHER = ToolSpec("get_weather", "Get the current weather in a city.", PARAMETERS)
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def distinct(calls: Sequence[tuple[str, str]]) -> bool:
    """No two calls with the same name and the same arguments text."""
    return len(set(calls)) == len(calls)


# --- the reader: a repeat is dropped, a call that only begins like one is not --------------

def _read(parser: Any, text: str) -> list[Any]:
    """The reader's pieces for ``text`` fed one character at a time (the streamed case)."""
    reader = parser.start("req")
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    ends = [p.call for p in pieces if isinstance(p, ToolCallEnd)]
    assert list(reader.calls) == ends
    return pieces


def _streamed_calls(pieces: list[Any]) -> list[tuple[str, str]]:
    """The calls as a client rebuilds them from the deltas (OpenAI's streaming rule)."""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for p in pieces:
        if isinstance(p, ToolCallDelta):
            if p.name is not None:
                names[p.index] = p.name
            args[p.index] = args.get(p.index, "") + p.arguments
    assert sorted(names) == list(range(len(names)))
    return [(names[i], args[i]) for i in sorted(names)]


PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
PARIS_TX = '{"name": "get_weather", "arguments": {"city": "Paris, TX"}}'
TOKYO = '{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}'


LAYOUTS = {   # each format's several calls, as its template writes them
    "hermes": (HermesParser(), lambda calls: "\n".join(
        f"<tool_call>\n{c}\n</tool_call>" for c in calls)),
    "llama3_json": (Llama3Parser(), lambda calls: "; ".join(calls)),
    "mistral": (MistralParser(), lambda calls: f"[TOOL_CALLS][{', '.join(calls)}]"),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_the_reader_drops_a_repeated_call_and_keeps_the_others(family: str) -> None:
    parser, layout = LAYOUTS[family]
    pieces = _read(parser, layout([PARIS, PARIS, PARIS_TX, TOKYO, PARIS_TX, PARIS]))
    expected = [(json.loads(c)["name"], json.dumps(json.loads(c)["arguments"]))
                for c in (PARIS, PARIS_TX, TOKYO)]
    assert _streamed_calls(pieces) == expected
    assert [(e.call.name, e.call.arguments) for e in pieces
            if isinstance(e, ToolCallEnd)] == expected
    assert [e.index for e in pieces if isinstance(e, ToolCallEnd)] == [0, 1, 2]
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)).strip() == ""


def test_a_repeat_cut_off_is_given_back_as_text_not_a_call() -> None:
    text = f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{PARIS[:30]}"
    pieces = _read(HermesParser(), text)
    assert _streamed_calls(pieces) == [("get_weather", '{"city": "Paris"}')]
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)).endswith(PARIS[:30])


# --- the grammar: after a repeated call the turn ends ---------------------------------------

def looping_model() -> Pipeline:
    """A scripted model that writes ``TOOL_CALL_TEXT`` again and again, one per line, never
    ending by itself (text-level, so it continues any forced prefix)."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    header = len(tok.encode_text("assistant\n"))
    target = "\n".join([TOOL_CALL_TEXT] * 40)

    def choose(ids: Sequence[int]) -> int:
        start = len(ids) - 1 - list(reversed(ids)).index(IM_START)
        text = tok.decode(ids[start + 1 + header:], skip_special_tokens=False)
        rest = target[len(text):] if target.startswith(text) else ""
        return tok.encode_text(rest, special=True)[0] if rest else IM_END

    backend = ScriptedBackend(tok.vocab_size, peaked(tok.vocab_size, choose, 30.0))
    return build(TINY_MODEL_DIR, backend=backend)


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_repeated_call_ends_the_turn(choice: str) -> None:
    with looping_model() as pipe:
        done = pipe.generate(ASK, tools=[WEATHER], tool_choice=choice, max_tokens=400)
        assert done.text.count("<tool_call>") == 2, done.text   # the repeat, then the end
        assert done.finish_reason.value == "eos"
        assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        streamed = [p for d in pipe.stream(ASK, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=400) for p in d.parts]
        assert _streamed_calls(streamed) == [("get_weather", '{"city": "Paris"}')]
        once = pipe.generate(ASK, tools=[WEATHER], tool_choice=choice, max_tokens=400,
                             parallel_tool_calls=False)
        assert once.text.count("<tool_call>") == 1 and len(once.tool_calls) == 1


# --- the default model through both SDKs and the Responses API ------------------------------

@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("forced"), api_keys={KEY}, models={"default": None})
    unpaced = EngineConfig(step_latency_ratio=None)   # as test_structured_default_model's
    # The pipeline default's loop guard (DRY) happens to steer this model off its repeated
    # call; without it the model writes the same call again, the case the constraint itself
    # must handle (the requests below are greedy, temperature 0).
    unguarded = GenerationConfig(temperature=0.2, top_p=0.9)
    with running(Gateway(cfg, lambda folder, c: build(options={"num_slots": CASES},
                                                      engine=unpaced,
                                                      defaults=unguarded))) as url:
        yield url


OPENAI_TOOLS: Any = [{"type": "function", "function": {
    "name": WEATHER.name, "description": WEATHER.description, "parameters": PARAMETERS}}]
CLAUDE_TOOLS: Any = [{"name": WEATHER.name, "description": WEATHER.description,
                      "input_schema": PARAMETERS}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": WEATHER.name,
                         "description": WEATHER.description, "parameters": PARAMETERS}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _openai(oai: openai.OpenAI, choice: Any, parallel: bool | None,
            stream: bool = False) -> tuple[list[tuple[str, str]], str | None]:
    extra: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    if not stream:
        done = oai.chat.completions.create(model="default", messages=ASK,  # type: ignore[arg-type]
                                           tools=OPENAI_TOOLS, tool_choice=choice,
                                           max_tokens=96, temperature=0, **extra)
        calls = done.choices[0].message.tool_calls or []
        return ([(c.function.name, c.function.arguments) for c in calls],  # type: ignore[union-attr]
                done.choices[0].finish_reason)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in oai.chat.completions.create(model="default", messages=ASK,  # type: ignore[arg-type]
                                             tools=OPENAI_TOOLS, tool_choice=choice,
                                             max_tokens=96, temperature=0, stream=True, **extra):
        for choice_delta in chunk.choices:
            finish = choice_delta.finish_reason or finish
            for d in choice_delta.delta.tool_calls or []:
                if d.function is not None and d.function.name:
                    names[d.index] = d.function.name
                if d.function is not None and d.function.arguments:
                    args[d.index] = args.get(d.index, "") + d.function.arguments
    return [(names[i], args.get(i, "")) for i in sorted(names)], finish


def _claude(claude: anthropic.Anthropic, choice: dict[str, Any]
            ) -> tuple[list[tuple[str, str]], str | None]:
    done = claude.messages.create(model="default", messages=ASK,  # type: ignore[arg-type]
                                  tools=CLAUDE_TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                  max_tokens=96, extra_body={"temperature": 0})
    uses = [b for b in done.content if b.type == "tool_use"]
    return [(b.name, json.dumps(b.input)) for b in uses], done.stop_reason


def _responses(oai: openai.OpenAI, choice: Any, parallel: bool | None
               ) -> tuple[list[tuple[str, str]], str | None]:
    extra: dict[str, Any] = {} if parallel is None else {"parallel_tool_calls": parallel}
    done = oai.responses.create(model="default", input=ASK, tools=RESPONSES_TOOLS,  # type: ignore[arg-type]
                                tool_choice=choice, max_output_tokens=96, temperature=0,
                                **extra)
    calls = [(i.name, i.arguments) for i in done.output if i.type == "function_call"]
    return calls, done.status


def test_forced_calls_through_both_sdks_and_the_responses_api(base_url: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=600)
    claude = anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=600)
    cases: dict[str, tuple[Any, bool]] = {   # what to ask -> (how, whether one call only)
        "openai required": (lambda: _openai(oai, "required", None), False),
        "openai named": (lambda: _openai(oai, NAMED, None), False),
        "openai required streamed": (lambda: _openai(oai, "required", None, True), False),
        "openai required, parallel false": (lambda: _openai(oai, "required", False), True),
        "openai named, parallel false, streamed": (
            lambda: _openai(oai, NAMED, False, True), True),
        "anthropic any": (lambda: _claude(claude, {"type": "any"}), False),
        "anthropic tool": (lambda: _claude(claude, {"type": "tool", "name": "get_weather"}),
                           False),
        "anthropic any, parallel disabled": (lambda: _claude(claude, {
            "type": "any", "disable_parallel_tool_use": True}), True),
        "responses required": (lambda: _responses(oai, "required", None), False),
        "responses named, parallel true": (lambda: _responses(
            oai, {"type": "function", "name": "get_weather"}, True), False),
        "responses required, parallel false": (lambda: _responses(oai, "required", False),
                                               True),
    }
    assert len(cases) == CASES
    with ThreadPoolExecutor(CASES) as pool:
        results = dict(zip(cases, pool.map(lambda how: how[0](), cases.values()), strict=True))
    for name, (calls, finish) in results.items():
        assert calls, name
        assert all(n == "get_weather" and isinstance(json.loads(a), dict) for n, a in calls), \
            (name, calls)
        assert distinct(calls), (name, calls)
        if cases[name][1]:
            assert len(calls) == 1, (name, calls)
        assert finish in ("tool_calls", "tool_use", "completed"), (name, finish)
    # the default model's repeat was byte for byte: what it asks for is one call
    assert all(len(calls) == 1 for calls, _ in results.values()), results
