"""Tool choice in the model's own format: forced calls always parse back, on every format.

``tool_choice`` required or named forces a call through the grammar of the parser the model
uses (Hermes on the tiny model, Llama 3 JSON and Mistral on the tiny model under those
families' templates, Hermes on the default model through the renderer's fallback for a
template that renders no tools). Oracles: the format's own parser reads every output back
(the readers are tested against transformers' renderings of each template in
``test_tool_parsers.py``), and ``jsonschema`` validates every call's arguments against its
tool's schema.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
import pytest

from pipeline import build
from pipeline.errors import InvalidValueError
from pipeline.contracts.request import Message, ToolCall, ToolSpec
from stages.render.hf_template import HFChatTemplateRenderer
from tests.tool_templates import LLAMA31_CALLS, MISTRAL_V3_CALLS

SEEDS = int(os.environ.get("PIPELINE_TOOL_SEEDS", "32"))
"""Seeds per forced-call check on the tiny model (32 in the suite; the issue's 100 with
``PIPELINE_TOOL_SEEDS=100``); the default model takes a quarter of them in the suite
(``benchmarks/structured.py`` runs it on 100)."""
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
TOOLS = [
    ToolSpec("get_weather", "The weather in a city.", {
        "type": "object", "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"enum": ["celsius", "fahrenheit"]}}}),
    ToolSpec("get_time", "The time in a time zone.", {
        "type": "object", "required": ["zone"], "properties": {
            "zone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}}}),
]
SCHEMAS = {t.name: dict(t.parameters) for t in TOOLS}


def _pipe(family: str) -> Any:
    if family == "hermes":
        return build("tiny", options={"num_slots": 8})
    template = LLAMA31_CALLS if family == "llama3_json" else MISTRAL_V3_CALLS
    renderer = HFChatTemplateRenderer.from_template(template, special_tokens={
        "eos_token": "<|im_end|>"})
    return build("tiny", renderer=renderer, options={"num_slots": 8})


def _calls(pipe: Any, n: int, **kwargs: Any) -> list[Any]:
    handles = [pipe.submit(ASK, tools=TOOLS, seed=s, temperature=1.0, **kwargs)
               for s in range(n)]
    return [h.result() for h in handles]


def _check(done: Any, name: str = "") -> None:
    assert done.tool_calls, done.text
    for call in done.tool_calls:
        assert call.name in SCHEMAS and (not name or call.name == name), done.text
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert done.finish_reason.value == "eos", done.text


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_a_required_call_parses_back_on_every_seed(family: str) -> None:
    with _pipe(family) as pipe:
        assert pipe.stages.tool_parser.name == family
        for done in _calls(pipe, SEEDS, tool_choice="required", max_tokens=64):
            _check(done)
        for done in _calls(pipe, 16, tool_choice="get_time", parallel_tool_calls=False,
                           max_tokens=64):
            _check(done, "get_time")
            assert len(done.tool_calls) == 1


def test_the_default_model_calls_through_the_fallback() -> None:
    with build(options={"num_slots": 8}) as pipe:
        assert pipe.stages.tool_parser.name == "hermes"
        with_tools = pipe.count_tokens(ASK, tools=TOOLS)
        assert with_tools > pipe.count_tokens(ASK) + 60   # the tool block is in the prompt
        rendered = pipe.render(ASK, tools=TOOLS)
        assert rendered.renderer.endswith("+hermes_tools")
        assert json.dumps(TOOLS[0].to_template()) in rendered.text
        for done in _calls(pipe, SEEDS // 4, tool_choice="required", max_tokens=64):
            _check(done)


def test_parallel_calls_are_each_parsed_and_can_be_refused() -> None:
    with _pipe("llama3_json") as pipe:
        several = 0
        for done in _calls(pipe, 24, tool_choice="required", max_tokens=96):
            _check(done)
            assert len(done.tool_calls) == done.text.count('{"name": ')
            several += len(done.tool_calls) > 1
        assert several > 0   # under this template the tiny model does make several calls
    with _pipe("hermes") as pipe:
        for done in _calls(pipe, 24, tool_choice="required", parallel_tool_calls=False,
                           max_tokens=96):
            _check(done)
            assert len(done.tool_calls) == 1 and done.text.count("<tool_call>") == 1
        for done in _calls(pipe, 12, parallel_tool_calls=False, max_tokens=96):
            assert len(done.tool_calls) <= 1   # auto: at most one, each valid
            for call in done.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_choices_that_cannot_be_honoured_are_refused() -> None:
    with _pipe("hermes") as pipe:
        scalar = ToolSpec("echo", "Echo a string.", {"type": "string"})
        with pytest.raises(InvalidValueError, match=r"tools\[echo\].parameters.*object"):
            pipe.generate(ASK, tools=[scalar], tool_choice="required")
        with pytest.raises(InvalidValueError, match="names no tool"):
            pipe.generate(ASK, tools=TOOLS, tool_choice="get_date")
        with pytest.raises(InvalidValueError, match="requires tools"):
            pipe.generate(ASK, tool_choice="required")
        none = pipe.generate(ASK, tools=TOOLS, tool_choice="none", max_tokens=24, seed=1)
        assert not none.tool_calls
        assert pipe.count_tokens(pipe.request(ASK, tools=TOOLS, tool_choice="none")) \
            == pipe.count_tokens(ASK)   # the tools are not shown


def test_a_template_without_tools_gets_the_hermes_block_and_round_trips() -> None:
    plain = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    renderer = HFChatTemplateRenderer.from_template(plain)
    assert not renderer.shows_tools
    history = [Message("system", "Be brief."), Message("user", "Weather in Paris?"),
               Message("assistant", None, (ToolCall("get_weather", '{"city": "Paris", '
                                                    '"unit": "celsius"}', "c1"),)),
               Message("tool", "18 C", tool_call_id="c1")]
    text = renderer.render(history, tools=TOOLS).text
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    assert renderer.render(history[:2]).text == renderer.render(history[:2], tools=()).text


def test_run_calls_first_then_answers_and_says_why_it_stopped() -> None:
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city.

        Args:
            city: the city
            unit: celsius or fahrenheit
        """
        return f"18 degrees {unit} in {city}"

    with _pipe("hermes") as pipe:
        run = pipe.run(ASK, tools=[get_weather], tool_choice=["required", "none"],
                       max_tokens=64, seed=3)
        assert [r.completion.tool_calls != () for r in run.rounds] == [True, False]
        assert run.calls[0].status == "executed" and run.stopped == "answered"
        cut = pipe.run(ASK, tools=[get_weather], tool_choice="none", max_tokens=2, seed=3)
        assert cut.stopped == "length"
