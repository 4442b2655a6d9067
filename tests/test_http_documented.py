"""Every request field the installed SDKs document is honoured, ignored or refused as
unsupported; none is refused as unknown.

The oracle for "documented" is the SDKs themselves: the parameter names of
``openai``'s ``chat.completions.create`` and ``completions.create`` and ``anthropic``'s
``messages.create``, ``messages.count_tokens`` and ``beta.messages.create``, read by
introspection. Each name is sent alone (with what it needs beside it) with a valid value
through the SDK; the answer must be a 200, or, for the fields listed as refused, a 400 saying
"not supported". A name the installed SDK adds later fails the test until it is given a value
here and a handling on the server.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from tests.http_support import config, running
from transports.http import Gateway

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
SDK_ONLY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


class Answer(pydantic.BaseModel):
    """A structured-output type (``output_format`` turns it into a JSON schema)."""

    city: str


CHAT: dict[str, dict[str, Any]] = {
    "audio": {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"function_call": "auto",
                      "functions": [{"name": "get_weather", "parameters": WEATHER}]},
    "functions": {"functions": [{"name": "get_weather", "parameters": WEATHER}]},
    "logit_bias": {"logit_bias": {"5": 1.5}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 2},
    "metadata": {"metadata": {"team": "docs"}},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {"model": "omni-moderation-latest"}},
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False},
    "prediction": {"prediction": {"type": "content", "content": "Lists are mutable."}},
    "presence_penalty": {"presence_penalty": -0.5},
    "prompt_cache_key": {"prompt_cache_key": "k-1"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "minimal"},
    "response_format": {"response_format": {"type": "text"}},
    "safety_identifier": {"safety_identifier": "hashed-user"},
    "seed": {"seed": -7},
    "service_tier": {"service_tier": "fast"},
    "stop": {"stop": "\n\n"},
    "store": {"store": True},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True,
                                                          "include_obfuscation": False}},
    "temperature": {"temperature": 1.3},
    "tool_choice": {"tool_choice": "none"},
    "tools": {"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER, "strict": True}}]},
    "top_logprobs": {"logprobs": True, "top_logprobs": 3},
    "top_p": {"top_p": 0.5},
    "user": {"user": "u-1"},
    "verbosity": {"verbosity": "high"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
CHAT_REFUSED = {"audio", "function_call", "functions", "moderation", "web_search_options"}

COMPLETIONS: dict[str, dict[str, Any]] = {
    "best_of": {"best_of": 2, "n": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": -3}},
    "logprobs": {"logprobs": 2},
    "max_tokens": {"max_tokens": 3},
    "n": {"n": 3},
    "presence_penalty": {"presence_penalty": 0.5},
    "seed": {"seed": 3},
    "stop": {"stop": ["\n", "."]},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "suffix": {"suffix": " and that is all."},
    "temperature": {"temperature": 0},
    "top_p": {"top_p": 0.2},
    "user": {"user": "u-1"},
}
COMPLETIONS_REFUSED = {"suffix"}

TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER,
        "cache_control": {"type": "ephemeral"}, "strict": True, "defer_loading": False,
        "eager_input_streaming": True, "input_examples": [{"city": "Paris"}],
        "allowed_callers": ["direct"]}
SHARED: dict[str, dict[str, Any]] = {  # messages.create and count_tokens alike
    "cache_control": {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
    "output_config": {"output_config": {"effort": "low"}},
    "speed": {"speed": "fast"},
    "system": {"system": [{"type": "text", "text": "Be brief.",
                           "cache_control": {"type": "ephemeral"}}]},
    "thinking": {"thinking": {"type": "enabled", "budget_tokens": 2, "display": "summarized"}},
    "tool_choice": {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                    "tools": [TOOL]},
    "tools": {"tools": [TOOL]},
    "user_profile_id": {"user_profile_id": "prof-1"},
    "workspace_id": {"workspace_id": "wrkspc-1"},
}
MESSAGES: dict[str, dict[str, Any]] = {
    **SHARED,
    "container": {"container": "container-1"},
    "diagnostics": {"diagnostics": {"previous_message_id": None}},
    "inference_geo": {"inference_geo": "us"},
    "max_tokens": {},
    "metadata": {"metadata": {"user_id": "u-1"}},
    "service_tier": {"service_tier": "standard_only"},
    "stop_sequences": {"stop_sequences": ["\n\n"]},
    "stream": {"stream": True},
}
COUNT: dict[str, dict[str, Any]] = {**SHARED, "output_format": {"output_format": Answer}}
COUNT_REFUSED: set[str] = set()  # output_format: the SDK sends it as output_config.format
BETA: dict[str, dict[str, Any]] = {
    "betas": {"betas": ["context-management-2025-06-27"]},
    "billing_policy": {"billing_policy": {"type": "billing_policy", "bill_to": "self"}},
    "compaction": {"compaction": {"type": "summarize"}},
    "context_management": {"context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}]}},
    "fallback_credit_token": {"fallback_credit_token": "tok-1"},
    "fallbacks": {"fallbacks": "default"},
    "mcp_servers": {"mcp_servers": [{"type": "url", "url": "https://mcp.invalid/sse",
                                     "name": "x"}]},
    "thread": {"thread": {"type": "create"}},
}
BETA_REFUSED = {"compaction", "context_management", "mcp_servers", "thread"}


def names(method: Callable[..., Any]) -> set[str]:
    """The parameters an SDK method documents."""
    return set(inspect.signature(method).parameters) - SDK_ONLY


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running(Gateway(config(tmp_path_factory.mktemp("usage")))) as url:
        yield url


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def outcome(call: Callable[[], Any]) -> str:
    """``ok``, ``refused`` (a 400 saying it is not supported) or the unexpected answer."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, pydantic.BaseModel):
            list(result)  # a stream: read to its end
        return "ok"
    except (openai.BadRequestError, anthropic.BadRequestError) as exc:
        body: Any = exc.body
        error = body.get("error", body) if isinstance(body, dict) else {}
        if "not supported here" in str(error.get("message")) and error.get("code") != (
                "unknown_field"):
            return "refused"
        return f"400: {error}"


def check_all(documented: set[str], samples: dict[str, dict[str, Any]], refused: set[str],
              send: Callable[[dict[str, Any]], Any]) -> None:
    missing = documented - set(samples)
    assert not missing, f"the SDK documents {sorted(missing)}: give each a value and a handling"
    results = {name: outcome(lambda: send(samples[name])) for name in sorted(documented)}
    expected = {name: "refused" if name in refused else "ok" for name in results}
    assert results == expected


def test_every_chat_completions_parameter(oai: openai.OpenAI) -> None:
    documented = names(oai.chat.completions.create) - {"model", "messages"}
    check_all(documented, CHAT, CHAT_REFUSED, lambda fields: oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}],
        **{"max_tokens": 2, **fields}))


def test_every_completions_parameter(oai: openai.OpenAI) -> None:
    documented = names(oai.completions.create) - {"model", "prompt"}
    check_all(documented, COMPLETIONS, COMPLETIONS_REFUSED, lambda fields: oai.completions.create(
        model="default", prompt="Lists are", **{"max_tokens": 2, **fields}))


def test_every_messages_parameter(claude: anthropic.Anthropic) -> None:
    documented = names(claude.messages.create) - {"model", "messages"}
    check_all(documented, MESSAGES, set(), lambda fields: claude.messages.create(
        model="default", messages=[{"role": "user", "content": "hi"}],
        **{"max_tokens": 2, **fields}))


def test_every_count_tokens_parameter(claude: anthropic.Anthropic) -> None:
    documented = names(claude.messages.count_tokens) - {"model", "messages"}
    check_all(documented, COUNT, COUNT_REFUSED, lambda fields: claude.messages.count_tokens(
        model="default", messages=[{"role": "user", "content": "hi"}], **fields))


def test_every_beta_messages_parameter(claude: anthropic.Anthropic) -> None:
    documented = names(claude.beta.messages.create) - names(claude.messages.create)
    check_all(documented, BETA, BETA_REFUSED, lambda fields: claude.beta.messages.create(
        model="default", max_tokens=2, messages=[{"role": "user", "content": "hi"}], **fields))


REFUSALS = [
    ("openai", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {}}}}},
     "response_format.json_schema.schema"),
    ("openai", {"modalities": ["text", "audio"]}, "modalities[1]"),
    ("anthropic", {"output_config": {"format": {"type": "json_schema",  # not: unimplemented
                                                "schema": {"not": {"pattern": "^a"}}}}},
     "output_config.format.schema"),
    ("anthropic", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
]


@pytest.mark.parametrize(("dialect", "fields", "param"), REFUSALS,
                         ids=[f"{d}:{p}" for d, _, p in REFUSALS])
def test_what_cannot_be_honoured_is_a_400_saying_so(oai: openai.OpenAI,
                                                      claude: anthropic.Anthropic,
                                                      dialect: str, fields: dict[str, Any],
                                                      param: str) -> None:
    if dialect == "openai":
        with pytest.raises(openai.BadRequestError, match="not supported here") as err:
            oai.chat.completions.create(model="default", max_tokens=2,  # type: ignore[call-overload]
                                        messages=[{"role": "user", "content": "hi"}], **fields)
        assert err.value.body["param"] == param  # type: ignore[index]
    else:
        with pytest.raises(anthropic.BadRequestError, match="not supported here") as caught:
            claude.messages.create(model="default", max_tokens=2,  # type: ignore[call-overload]
                                   messages=[{"role": "user", "content": "hi"}], **fields)
        assert caught.value.body["error"]["param"] == param  # type: ignore[index]


def test_an_undocumented_name_is_unknown_with_a_hint(oai: openai.OpenAI,
                                                      claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError, match="presence_penalty") as err:
        oai.chat.completions.create(model="default", max_tokens=2,  # type: ignore[call-overload]
                                    messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"presense_penalty": 1})
    assert err.value.body["code"] == "unknown_field"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        claude.messages.create(model="default", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}],
                               extra_body={"stop_sequence": ["x"]})
    with pytest.raises(anthropic.BadRequestError, match="display"):
        claude.messages.create(model="default", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 2,
                                         "display": "loud"})  # type: ignore[typeddict-item]
