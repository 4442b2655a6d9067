"""Structured output over HTTP with the tiny model, read by the official SDKs (fast; the
default model's many-seed run is ``test_structured_default_model.py``).

Oracles: the SDKs' own parsing (``chat.completions.parse`` into a pydantic model, tool calls
and ``tool_use`` blocks, streamed deltas reassembled by the SDK), ``jsonschema`` for every
schema, and the non-streamed answer for the streamed one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from tests.http_support import config, running
from transports.http import Gateway

KEY = "sk-test-key"
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "label"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                        "label": {"type": "string", "maxLength": 10}}}
TOOL = {"type": "function", "function": {"name": "locate", "description": "Find a place",
                                         "parameters": POINT}}
OTHER = {"type": "function", "function": {"name": "noop", "description": "Nothing",
                                          "parameters": {"type": "object", "properties": {},
                                                         "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Where is the point?"}]


class Point(pydantic.BaseModel):
    """What the SDK parses the answer into."""

    model_config = pydantic.ConfigDict(extra="forbid")
    x: int = pydantic.Field(ge=0, le=999)
    label: str = pydantic.Field(max_length=10)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running(Gateway(config(tmp_path_factory.mktemp("structured"), api_keys={KEY}))) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


def test_openai_parse_reads_a_json_schema_answer(oai: openai.OpenAI) -> None:
    for seed in range(4):
        done = oai.chat.completions.parse(model="default", messages=ASK, response_format=Point,
                                          max_tokens=40, seed=seed)
        assert isinstance(done.choices[0].message.parsed, Point)
        jsonschema.validate(json.loads(done.choices[0].message.content or ""), POINT)


def test_openai_json_object_and_a_schema_without_strict(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.create(model="default", messages=ASK, max_tokens=60, seed=1,
                                       response_format={"type": "json_object"})
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
    done = oai.chat.completions.create(
        model="default", messages=ASK, max_tokens=40, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}})
    jsonschema.validate(json.loads(done.choices[0].message.content or ""), POINT)


def test_openai_required_and_named_tool_choice_stream_and_not(oai: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "locate"}}):
        args: dict[str, Any] = dict(model="default", messages=ASK, tools=[OTHER, TOOL],
                                    tool_choice=choice, max_tokens=48, seed=7)
        done = oai.chat.completions.create(**args)
        assert done.choices[0].finish_reason == "tool_calls"
        (call,) = done.choices[0].message.tool_calls or []
        if choice != "required":
            assert call.function.name == "locate"
        if call.function.name == "locate":
            jsonschema.validate(json.loads(call.function.arguments), POINT)
        with oai.chat.completions.stream(**args) as stream:
            final = stream.get_final_completion()
        (streamed,) = final.choices[0].message.tool_calls or []
        assert (streamed.function.name, json.loads(streamed.function.arguments)) == (
            call.function.name, json.loads(call.function.arguments))


def test_anthropic_output_format_and_forced_tool(claude: anthropic.Anthropic) -> None:
    done = claude.messages.create(
        model="default", max_tokens=40, messages=ASK,  # type: ignore[arg-type]
        output_config={"format": {"type": "json_schema", "schema": POINT}})
    jsonschema.validate(json.loads("".join(b.text for b in done.content if b.type == "text")),
                        POINT)
    tools: Any = [{"name": "locate", "description": "Find a place", "input_schema": POINT}]
    done = claude.messages.create(
        model="default", max_tokens=48, messages=ASK,  # type: ignore[arg-type]
        tools=tools, tool_choice={"type": "tool", "name": "locate"})
    (use,) = [b for b in done.content if b.type == "tool_use"]
    assert done.stop_reason == "tool_use" and use.name == "locate"
    jsonschema.validate(use.input, POINT)


def test_bad_formats_are_400s_naming_the_field(oai: openai.OpenAI,
                                               claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError, match="json_schema") as err:
        bare: Any = {"type": "json_schema"}
        oai.chat.completions.create(model="default", messages=ASK, max_tokens=4,
                                    response_format=bare)
    assert err.value.body["param"] == "response_format.json_schema"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="not supported here") as err:
        oai.chat.completions.create(
            model="default", messages=ASK, max_tokens=4, tools=[{"type": "function", "function": {
                "name": "f", "parameters": {"type": "object", "if": {}}}}],
            tool_choice="required")
    assert err.value.body["param"] == "tools[f].parameters"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="schema"):
        claude.messages.create(
            model="default", max_tokens=4, messages=ASK,  # type: ignore[arg-type]
            output_config={"format": {"type": "json_schema"}})


def test_streamed_and_batched_formats_match_the_plain_answer(oai: openai.OpenAI,
                                                             claude: anthropic.Anthropic) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    args: dict[str, Any] = dict(model="default", messages=ASK, max_tokens=40, seed=11,
                                response_format=fmt)
    whole = oai.chat.completions.create(**args).choices[0].message.content
    chunks = oai.chat.completions.create(**args, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole or ""), POINT)
    several = oai.chat.completions.create(**{**args, "n": 3})
    for choice in several.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), POINT)
    output: Any = {"format": {"type": "json_schema", "schema": POINT}}
    with claude.messages.stream(
            model="default", max_tokens=40, messages=ASK,  # type: ignore[arg-type]
            output_config=output) as stream:
        text = stream.get_final_text()
    jsonschema.validate(json.loads(text), POINT)


def test_a_required_call_wins_over_a_response_format(oai: openai.OpenAI) -> None:
    done = oai.chat.completions.create(model="default", messages=ASK, max_tokens=48, seed=5,
                                       tools=[TOOL], tool_choice="required",
                                       response_format={"type": "json_object"})
    (call,) = done.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), POINT)


def test_with_tools_to_choose_from_the_answer_is_a_valid_call_or_the_format(
        oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}
    kinds = set()
    for seed in range(8):
        done = oai.chat.completions.create(model="default", messages=ASK, max_tokens=48,
                                           seed=seed, tools=[TOOL], response_format=fmt)
        message = done.choices[0].message
        if message.tool_calls:
            (call,) = message.tool_calls
            jsonschema.validate(json.loads(call.function.arguments), POINT)
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(message.content or ""), POINT)
            kinds.add("answer")
    assert kinds    # (this model, asked with a tool, calls it; the mask test in
    # test_structured_output.py shows both openings stay allowed)
    tools: Any = [{"name": "locate", "description": "Find a place", "input_schema": POINT}]
    output: Any = {"format": {"type": "json_schema", "schema": POINT}}
    done = claude.messages.create(model="default", max_tokens=48, messages=ASK, tools=tools,
                                  output_config=output)
    for block in done.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, POINT)
        else:
            assert block.type == "text"
            jsonschema.validate(json.loads(block.text), POINT)


def test_strict_tools_make_every_call_valid_and_leave_text_free(oai: openai.OpenAI) -> None:
    strict: Any = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    calls = texts = 0
    for seed in range(10):
        done = oai.chat.completions.create(model="default", messages=ASK, max_tokens=64,
                                           seed=seed, tools=[strict], temperature=1.0)
        message = done.choices[0].message
        for call in message.tool_calls or []:
            jsonschema.validate(json.loads(call.function.arguments), POINT)
            calls += 1
        texts += bool(message.content) and "<tool_call>" not in (message.content or "")
    assert calls and texts


def test_vllm_constraint_fields_over_both_openai_endpoints(oai: openai.OpenAI) -> None:
    import re

    chat = oai.chat.completions.create(model="default", messages=ASK, max_tokens=16, seed=1,
                                       extra_body={"structured_outputs": {
                                           "regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", chat.choices[0].message.content or "")
    assert chat.choices[0].finish_reason == "stop"
    picked = oai.chat.completions.create(model="default", messages=ASK, max_tokens=8, seed=2,
                                         extra_body={"guided_choice": ["north", "south"]})
    assert picked.choices[0].message.content in ("north", "south")
    text = oai.completions.create(model="default", prompt="Point:", max_tokens=48, seed=3,
                                  extra_body={"guided_json": POINT})
    jsonschema.validate(json.loads(text.choices[0].text), POINT)
    grammar = 'root ::= "<" [a-z]+ ">"'
    for stream in (False, True):
        if stream:
            pieces = oai.chat.completions.create(model="default", messages=ASK, max_tokens=16,
                                                 seed=4, stream=True, extra_body={
                                                     "structured_outputs": {"grammar": grammar}})
            out = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        else:
            out = oai.chat.completions.create(
                model="default", messages=ASK, max_tokens=16, seed=4,
                extra_body={"structured_outputs": {"grammar": grammar}}
            ).choices[0].message.content or ""
        assert re.fullmatch("<[a-z]+>", out), out


def test_constraint_and_budget_refusals_are_400s(oai: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str, int]] = [
        ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs.regex", 16),
        ({"guided_choice": "north"}, "guided_choice", 16),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", 16),
        ({"guided_json": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "string", "minLength": 200}}}}, "max_tokens", 8),
    ]
    for extra, field, budget in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="default", messages=ASK, max_tokens=budget,
                                        extra_body=extra)
        assert field in str(err.value), err.value


def test_parallel_tool_calls_false_allows_one_call(oai: openai.OpenAI,
                                                   claude: anthropic.Anthropic) -> None:
    for seed in range(6):
        done = oai.chat.completions.create(model="default", messages=ASK, tools=[TOOL, OTHER],
                                           tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=64, seed=seed)
        calls = done.choices[0].message.tool_calls or []
        assert len(calls) == 1 and done.choices[0].finish_reason == "tool_calls"
        message = claude.messages.create(
            model="default", max_tokens=64, messages=ASK,  # type: ignore[arg-type]
            tools=[{"name": "locate", "description": "Find a place", "input_schema": POINT}],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"seed": seed})
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) == 1 and message.stop_reason == "tool_use"
        jsonschema.validate(uses[0].input, POINT)


def test_a_tool_whose_parameters_are_not_an_object_is_a_400_when_forced(
        oai: openai.OpenAI) -> None:
    scalar = {"type": "function", "function": {"name": "echo", "description": "Echo",
                                               "parameters": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError, match="echo"):
        oai.chat.completions.create(model="default", messages=ASK, tools=[scalar],
                                    tool_choice="required", max_tokens=16)


def test_tokenize_counts_the_tools_the_prompt_shows(base_url: str) -> None:
    import httpx

    def count(**extra: Any) -> int:
        r = httpx.post(f"{base_url}/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "default", "messages": ASK, **extra})
        assert r.status_code == 200, r.text
        return int(r.json()["count"])

    plain, shown = count(), count(tools=[TOOL, OTHER])
    assert shown > plain + 20
    assert count(tools=[TOOL, OTHER], tool_choice="none") == plain
    assert plain < count(tools=[TOOL, OTHER], tool_choice={
        "type": "function", "function": {"name": "noop"}}) < shown
