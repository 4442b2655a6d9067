"""``POST /v1/responses`` through the official ``openai`` SDK, on 127.0.0.1 (one server for
the module: the tiny model and scripted ones).

Oracles: the SDK itself (it parses the response objects and the event stream into its own
types, accumulates the stream, and parses structured output into a pydantic model), the chat
endpoint's answer to the same conversation (the Responses request is that conversation),
``jsonschema`` for structured output, and the scripted tool model's known script (it answers
only once the tool's output is in its prompt).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from stages.tokenize import HFTokenizer
from tests.http_support import (
    ANSWER_TEXT, POLITE_TEXT, config, polite_model, running, thinker_model, tool_model,
)
from transports.http import Gateway, ServerConfig

KEY, OTHER_KEY = "sk-test-key", "sk-other-key"
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "label"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                        "label": {"type": "string", "maxLength": 10}}}


class Point(pydantic.BaseModel):
    """What the SDK parses a structured answer into."""

    model_config = pydantic.ConfigDict(extra="forbid")
    x: int = pydantic.Field(ge=0, le=999)
    label: str = pydantic.Field(max_length=10)


def failing_model() -> Pipeline:
    """A scripted model that writes "a" and fails on its fourth token."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    a, vocab = tok.encode_text("a")[0], tok.vocab_size
    backend = ScriptedBackend(vocab, peaked(vocab, lambda ids: a, 30.0),
                              fail=lambda ids: list(ids).count(a) >= 4)
    return build(TINY_MODEL_DIR, backend=backend)


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "failing":
        return failing_model()
    if folder is not None and folder.name == "tools":
        return tool_model()[0]
    if folder is not None and folder.name == "polite":
        return polite_model()
    if folder is not None and folder.name == "thinker":
        return thinker_model()
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("responses"), api_keys={KEY, OTHER_KEY},
                 models={"default": None, "tools": Path("tools"), "polite": Path("polite"),
                         "failing": Path("failing"), "thinker": Path("thinker")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def test_a_text_answer_is_the_chat_answer_to_the_same_conversation(oai: openai.OpenAI) -> None:
    done = oai.responses.create(model="default", instructions="Answer briefly.",
                                input="What is a Python list?", max_output_tokens=12,
                                temperature=0, metadata={"ticket": "7"})
    chat = oai.chat.completions.create(
        model="default", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What is a Python list?"}])
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.output_text == chat.choices[0].message.content
    assert chat.usage is not None and done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert done.status == "incomplete" and done.incomplete_details is not None
        assert done.incomplete_details.reason == "max_output_tokens"
    else:
        assert done.status == "completed"
    (message,) = done.output
    assert message.type == "message" and message.role == "assistant"
    assert done.metadata == {"ticket": "7"} and done.instructions == "Answer briefly."


def test_the_stream_is_the_sdk_event_sequence_and_equals_the_answer(oai: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="default", input="Name a colour.", max_output_tokens=10,
                                temperature=0)
    whole = oai.responses.create(**args)
    events = list(oai.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert deltas == done.text == last.response.output_text == whole.output_text
    # the SDK's own accumulator, on an answer that ends by itself
    with oai.responses.stream(model="polite", input="Hi") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == POLITE_TEXT


def test_a_forced_tool_call_round_trip_by_previous_response_id(oai: openai.OpenAI) -> None:
    # the polite model writes the call once its output begins one (as a forced choice does)
    first = oai.responses.create(model="polite", input="Weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=64, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    # streamed: the arguments' deltas join to the finished call's
    events = list(oai.responses.create(model="tools", input="Weather in Paris?",
                                       tools=[WEATHER], max_output_tokens=64, temperature=0,
                                       stream=True))
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    ended = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == ended.arguments == call.arguments
    assert events[-1].type == "response.completed"
    # the tool's output, continuing the kept conversation
    answer = oai.responses.create(
        model="tools", previous_response_id=first.id, tools=[WEATHER], temperature=0,
        max_output_tokens=64,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp_c": 18}'}])
    assert answer.output_text == ANSWER_TEXT and answer.status == "completed"
    assert answer.previous_response_id == first.id
    # the same turn with the whole conversation sent as items
    again = oai.responses.create(
        model="tools", tools=[WEATHER], temperature=0, max_output_tokens=64,
        input=[{"role": "user", "content": "Weather in Paris?"},
               call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temp_c": 18}'}])
    assert again.output_text == ANSWER_TEXT


def test_structured_output_by_text_format(oai: openai.OpenAI) -> None:
    for seed in range(2):
        parsed = oai.responses.parse(model="default", input="Where is the point?",
                                     text_format=Point, max_output_tokens=40,
                                     extra_body={"seed": seed})
        assert isinstance(parsed.output_parsed, Point)
    done = oai.responses.create(
        model="default", input="Where is the point?", max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "point", "schema": POINT,
                         "strict": True}})
    jsonschema.validate(json.loads(done.output_text), POINT)
    assert done.text is not None and done.text.format is not None
    assert done.text.format.type == "json_schema"
    done = oai.responses.create(model="default", input="A JSON object, please.",
                                max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_object"}})
    if done.status == "completed":
        assert isinstance(json.loads(done.output_text), dict)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p"}}},
     "text.format.schema"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "colour": "blue"}, "colour"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_bad_bodies_are_400s_naming_the_field(oai: openai.OpenAI, body: dict[str, Any],
                                              param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="default", extra_body=body)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_a_kept_response_is_the_maker_keys_and_store_false_keeps_none(
        oai: openai.OpenAI, base_url: str) -> None:
    kept = oai.responses.create(model="polite", input="Hi")
    other = openai.OpenAI(base_url=f"{base_url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        other.responses.create(model="polite", input="And?", previous_response_id=kept.id)
    follow = oai.responses.create(model="polite", input="And?", previous_response_id=kept.id)
    assert follow.usage is not None and kept.usage is not None
    assert follow.usage.input_tokens > kept.usage.input_tokens + kept.usage.output_tokens
    unkept = oai.responses.create(model="polite", input="Hi", store=False)
    assert unkept.store is False
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="polite", input="And?", previous_response_id=unkept.id)
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert unkept.id in err.value.body["message"]  # type: ignore[index]


def test_a_failure_mid_stream_ends_it_with_an_error_event(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="failing", input="Hi", max_output_tokens=16,
                                       stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type == "error" and events[-1].message == "internal server error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert not any(e.type in ("response.completed", "response.incomplete") for e in events)
    with pytest.raises(openai.InternalServerError):
        oai.responses.create(model="failing", input="Hi", max_output_tokens=16)


def test_a_think_block_is_a_reasoning_item_streamed_and_not(oai: openai.OpenAI) -> None:
    # thinking asked for, no budget: the thinker thinks to the end (the thinking guard acts
    # only when the client states no preference: tests/test_http_thinking_guard.py)
    done = oai.responses.create(model="thinker", input="Hi", max_output_tokens=8,
                                reasoning={"effort": "high"})
    (item,) = done.output
    assert item.type == "reasoning" and item.status == "incomplete"
    assert item.content is not None and item.content[0].text == "a" * 7
    assert done.status == "incomplete" and done.output_text == ""
    events = list(oai.responses.create(model="thinker", input="Hi", max_output_tokens=8,
                                       reasoning={"effort": "high"}, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == next(e.text for e in events if e.type == "response.reasoning_text.done")
    assert thought == item.content[0].text and events[-1].type == "response.incomplete"


def test_a_budget_that_does_not_fit_is_refused_by_the_name_the_client_sent(
        tmp_path: Path) -> None:
    # without clamping, an output budget beyond the room the prompt leaves is a 400 that names
    # the body's own field: max_output_tokens (Responses), max_completion_tokens or max_tokens
    cfg = config(tmp_path, api_keys={KEY}, clamp_max_tokens=False, max_context=256)
    with running(Gateway(cfg, builder)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model="default", input="hi", max_output_tokens=5000)
        body: Any = err.value.body
        assert body["param"] == "max_output_tokens"
        assert "max_output_tokens=5000 is too large" in body["message"]
        chat: Any = [{"role": "user", "content": "hi"}]
        for field in ("max_completion_tokens", "max_tokens"):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="default", messages=chat,
                                               extra_body={field: 5000})
            body = err.value.body
            assert body["param"] == field
