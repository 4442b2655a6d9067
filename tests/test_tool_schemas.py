"""A tool's ``parameters`` are checked as a JSON schema whatever the tool choice.

A schema that is not one (``{"type": "nope"}``) or does not describe an object is refused at
the door — by :class:`~pipeline.contracts.request.Request` in the library, with a 400 in each HTTP
dialect — for ``tool_choice`` auto, none and required alike, naming the tool. Oracles:
``jsonschema``'s own meta-schema check decides which schemas are valid; the official SDKs
parse the errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pipeline.errors import InvalidValueError
from pipeline.contracts.request import Request, ToolSpec
from tests.http_support import config, running
from transports.http import Gateway

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

BAD: list[dict[str, Any]] = [
    {"type": "nope"},
    {"type": "object", "properties": {"city": {"type": "nope"}}},
    {"type": "object", "properties": {"city": {"minLength": -1}}},
    {"type": "object", "required": "city"},
    {"type": "string"},  # valid JSON schema, but a call's arguments are an object
]
GOOD: list[dict[str, Any]] = [
    {},
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"properties": {"n": {"type": "integer", "minimum": 0}}},
]
MESSAGES = [{"role": "user", "content": "The weather in Paris?"}]


def _valid(schema: dict[str, Any]) -> bool:
    """The oracle: an object schema that passes jsonschema's meta-schema."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError:
        return False
    return bool(schema.get("type", "object") == "object")


def test_the_oracle_agrees_with_the_cases() -> None:
    assert [_valid(s) for s in BAD] == [False] * len(BAD)
    assert [_valid(s) for s in GOOD] == [True] * len(GOOD)


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
@pytest.mark.parametrize("schema", BAD)
def test_a_request_refuses_a_bad_schema_whatever_the_choice(schema: dict[str, Any],
                                                            choice: str) -> None:
    with pytest.raises(InvalidValueError, match=r"tools\[get_weather\]\.parameters"):
        Request(messages=MESSAGES, tool_catalog=[ToolSpec("get_weather", "", schema)],
                tool_choice=choice)


@pytest.mark.parametrize("schema", GOOD)
def test_a_good_schema_is_accepted(schema: dict[str, Any]) -> None:
    request = Request(messages=MESSAGES, tool_catalog=[ToolSpec("get_weather", "", schema)],
                      tool_choice="required")
    assert request.tool_catalog[0].name == "get_weather"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running(Gateway(config(tmp_path_factory.mktemp("tools")))) as base:
        yield base


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_openai_gets_a_400_naming_the_tool(url: str, choice: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tools: Any = [{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": {"type": "nope"}}}]
    with pytest.raises(openai.BadRequestError, match=r"get_weather.*JSON schema"):
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                       tools=tools, tool_choice=choice)


@pytest.mark.parametrize("choice", [{"type": "auto"}, {"type": "any"}])
def test_anthropic_gets_a_400_naming_the_tool(url: str, choice: dict[str, str]) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "nope"}}]
    with pytest.raises(anthropic.BadRequestError, match=r"get_weather.*JSON schema"):
        client.messages.create(model="default", messages=MESSAGES,
                               max_tokens=4, tools=tools, tool_choice=choice)


def test_responses_gets_a_400_naming_the_tool(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": {"type": "nope"}}]
    with pytest.raises(openai.BadRequestError, match=r"get_weather.*JSON schema"):
        client.responses.create(model="default", input="The weather in Paris?", tools=tools,
                                max_output_tokens=4)


def test_a_good_schema_is_served(url: str, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    tools: Any = [{"type": "function", "function": {"name": "get_weather",
                                                     "parameters": GOOD[1]}}]
    done = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=4,
                                          tools=tools)
    assert done.choices[0].finish_reason in ("length", "stop", "tool_calls")
