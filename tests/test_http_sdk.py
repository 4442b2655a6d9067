"""The HTTP server through the official ``openai`` and ``anthropic`` SDKs, on 127.0.0.1.

Oracles: the SDKs themselves (they parse our responses and SSE streams into their own types and
raise their own error classes), non-streamed answers for streamed ones, transformers' chat
template for token counts, and the scripted tool model's known script.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from tests.http_support import (
    ANSWER_TEXT, POLITE_TEXT, config, polite_model, running, thinker_model, tool_model,
)
from transports.http import Gateway, ServerConfig

KEY = "sk-test-key"
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is a Python list?"}]


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "tools":
        return tool_model()[0]
    if folder is not None and folder.name == "thinker":
        return thinker_model()
    if folder is not None and folder.name == "polite":
        return polite_model()
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("usage"), api_keys={KEY},
                 models={"default": None, "tools": Path("tools"), "thinker": Path("thinker"),
                         "polite": Path("polite")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0)


def test_openai_stream_equals_non_stream_with_the_same_seed(oai: openai.OpenAI) -> None:
    args = dict(model="default", messages=QUESTION, max_tokens=24, temperature=0.8, seed=1234)
    whole = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(oai.chat.completions.create(**args, stream=True,  # type: ignore[call-overload]
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(text) > 10
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_anthropic_stream_equals_non_stream_with_the_same_seed(
        claude: anthropic.Anthropic) -> None:
    # sampling parameters and the seed (an extension of this server) go in the body
    args = dict(model="default", messages=QUESTION, max_tokens=24, system="Answer briefly.",
                extra_body={"temperature": 0.8, "seed": 99})
    whole = claude.messages.create(**args)  # type: ignore[call-overload]
    with claude.messages.stream(**args) as stream:  # type: ignore[call-overload]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and len(text) > 10
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 24
    # the same prompt: the stream, second, reads its blocks from the prefix cache, and
    # Anthropic's input_tokens count only what was not read from it
    assert final.usage.cache_read_input_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0))


def test_openai_tool_call_round_trip_streamed_and_not(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = oai.chat.completions.create(model="tools", messages=ask, tools=tools,  # type: ignore[arg-type]
                                        max_tokens=64, temperature=0)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"}
    names, args, ids, fragments = {}, {}, {}, 0
    for chunk in oai.chat.completions.create(model="tools", messages=ask, tools=tools,  # type: ignore[call-overload]
                                             max_tokens=64, temperature=0, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            ids[tc.index] = tc.id or ids.get(tc.index)
            names[tc.index] = (tc.function.name or names.get(tc.index, ""))
            args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
            fragments += bool(tc.function.arguments)
    assert names == {0: "get_weather"} and json.loads(args[0]) == {"city": "Paris"}
    # the arguments stream as the model writes them (deltas the engine makes faster than the
    # event loop wakes are merged, so how many fragments arrive depends on timing)
    assert fragments >= 1 and args[0] == call.function.arguments and ids[0]
    follow = ask + [first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    answer = oai.chat.completions.create(model="tools", messages=follow, tools=tools,  # type: ignore[arg-type]
                                         max_tokens=64, temperature=0)
    assert answer.choices[0].message.content == ANSWER_TEXT
    assert answer.choices[0].finish_reason == "stop"


def test_anthropic_tool_use_round_trip_streamed(claude: anthropic.Anthropic) -> None:
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"],
              "input_schema": WEATHER["parameters"]}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    partials = []
    with claude.messages.stream(model="tools", messages=ask, tools=tools,  # type: ignore[arg-type]
                                max_tokens=64) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partials.append(event.delta.partial_json)
        message = stream.get_final_message()
    use = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(use) == 1
    assert use[0].name == "get_weather" and use[0].input == {"city": "Paris"}
    assert partials and json.loads("".join(partials)) == use[0].input
    follow = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                  "content": "18 degrees"}]}]
    answer = claude.messages.create(model="tools", messages=follow, tools=tools,  # type: ignore[arg-type]
                                    max_tokens=64)
    assert answer.content[0].type == "text" and answer.content[0].text == ANSWER_TEXT
    assert answer.stop_reason == "end_turn"


def test_count_tokens_matches_transformers_chat_template(claude: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Count me: naïve café, 12345 ✓"},
                {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "Again"}]
    counted = claude.messages.count_tokens(model="default", messages=messages,  # type: ignore[arg-type]
                                           system="Be terse.")
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    ids = hf.apply_chat_template([{"role": "system", "content": "Be terse."}, *messages],
                                 tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert counted.input_tokens == len(ids)


def test_sdk_error_types(oai: openai.OpenAI, claude: anthropic.Anthropic, base_url: str) -> None:
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="default", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model="default", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    missing_key = httpx.post(f"{base_url}/v1/messages", json={})
    assert missing_key.status_code == 401 and "missing API key" in missing_key.text
    with pytest.raises(openai.BadRequestError) as bad_request:
        oai.chat.completions.create(model="default", messages=QUESTION, temperature=7)  # type: ignore[arg-type]
    assert bad_request.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="max_n") as too_many:
        oai.chat.completions.create(model="default", messages=QUESTION, n=17)  # type: ignore[arg-type]
    assert too_many.value.body["limit"] == "max_n" and too_many.value.body["maximum"] == 16  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        claude.messages.create(model="default", messages=QUESTION, max_tokens=2,  # type: ignore[arg-type]
                               extra_body={"top_k": -1})  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError, match="served models: default, polite, thinker, tools"):
        oai.chat.completions.create(model="gpt-9", messages=QUESTION)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="gpt-9", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
    assert missing.value.body["error"]["served_models"] == ["default", "polite", "thinker", "tools"]  # type: ignore[index]


def test_logprobs_are_a_distribution_led_by_the_greedy_choice(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(model="default", messages=QUESTION, max_tokens=5,  # type: ignore[arg-type]
                                      temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert len(content) == 5 and "".join(c.token for c in content) == out.choices[0].message.content
    for item in content:
        top = item.top_logprobs
        assert len(top) == 3 and top[0].token == item.token
        assert top[0].logprob == pytest.approx(item.logprob, abs=1e-5)
        assert sum(2.718281828 ** t.logprob for t in top) <= 1 + 1e-5


def test_logit_bias_and_stop_strings_reach_the_engine(oai: openai.OpenAI) -> None:
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    (word,) = hf.encode(" list", add_special_tokens=False)
    out = oai.chat.completions.create(model="default", messages=QUESTION, max_tokens=6,  # type: ignore[arg-type]
                                      temperature=0, logit_bias={str(word): 100})
    assert out.choices[0].message.content == " list" * 6
    stopped = oai.chat.completions.create(model="default", messages=QUESTION, max_tokens=6,  # type: ignore[arg-type]
                                          temperature=0, logit_bias={str(word): 100}, stop=["t l"])
    text = " list" * 6
    assert stopped.choices[0].message.content == text[:text.index("t l")]
    assert stopped.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("budget", [0, 5])
def test_reasoning_budget_over_both_dialects(oai: openai.OpenAI, claude: anthropic.Anthropic,
                                             budget: int) -> None:
    """The thinker would think until max_tokens; the budget cuts its thinking after exactly
    ``budget`` tokens and an answer follows, as thinking blocks / reasoning_content."""
    ask = [{"role": "user", "content": "Think, then answer."}]
    with claude.messages.stream(model="thinker", messages=ask, max_tokens=40,  # type: ignore[arg-type]
                                thinking={"type": "enabled", "budget_tokens": budget}) as stream:
        message = stream.get_final_message()
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
              for b in message.content]
    assert blocks == ([("thinking", "a" * budget)] if budget else []) + [("text", "Done.")]
    assert message.stop_reason == "end_turn"
    out = oai.chat.completions.create(model="thinker", messages=ask, max_tokens=40,  # type: ignore[arg-type]
                                      extra_body={"reasoning_budget_tokens": budget})
    message_oa = out.choices[0].message
    assert message_oa.content == "Done." and out.choices[0].finish_reason == "stop"
    assert (message_oa.model_extra or {}).get("reasoning_content") == ("a" * budget or None)
    # thinking asked for with no budget: the thinker thinks to the end of max_tokens
    unbudgeted = oai.chat.completions.create(model="thinker", messages=ask, max_tokens=12,  # type: ignore[arg-type]
                                             reasoning_effort="high")
    assert unbudgeted.choices[0].finish_reason == "length"
    assert unbudgeted.choices[0].message.content is None or "Done" not in unbudgeted.choices[0].message.content
    # no preference stated: the thinking guard keeps room for the answer (12 - 12 // 3 - 2)
    guarded = oai.chat.completions.create(model="thinker", messages=ask, max_tokens=12)  # type: ignore[arg-type]
    assert guarded.choices[0].message.content == "Done."
    assert (guarded.choices[0].message.model_extra or {}).get("reasoning_content") == "a" * 6


def test_a_required_or_named_tool_choice_makes_the_answer_a_tool_call(
        oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """The polite model never starts a tool call by itself; a required (or named) choice
    forces the opening of one, and it completes the call."""
    tools = [{"type": "function", "function": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    free = oai.chat.completions.create(model="polite", messages=ask, tools=tools,  # type: ignore[arg-type]
                                       max_tokens=64)
    assert free.choices[0].message.content == POLITE_TEXT
    for choice in ("required", named):
        out = oai.chat.completions.create(model="polite", messages=ask, tools=tools,  # type: ignore[arg-type]
                                          tool_choice=choice, max_tokens=64)  # type: ignore[arg-type]
        (call,) = out.choices[0].message.tool_calls  # type: ignore[misc]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert out.choices[0].finish_reason == "tool_calls"
    claude_tools = [{"name": "get_weather", "input_schema": WEATHER["parameters"]}]
    for claude_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = claude.messages.create(model="polite", messages=ask, tools=claude_tools,  # type: ignore[arg-type]
                                         tool_choice=claude_choice, max_tokens=64)  # type: ignore[arg-type]
        assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
            ("tool_use", {"city": "Paris"})]
        assert message.stop_reason == "tool_use"


def test_documented_fields_without_meaning_here_are_accepted_through_the_sdks(
        oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    chat = oai.chat.completions.create(
        model="default", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
        service_tier="auto", store=False, metadata={"team": "docs"}, user="u1",
        extra_body={"prompt_cache_key": "k", "safety_identifier": "s"})
    assert chat.choices[0].message.content is not None
    message = claude.messages.create(
        model="default", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
        service_tier="auto", metadata={"user_id": "u1"},
        extra_body={"cache_control": {"type": "ephemeral"}})
    assert message.content
    with pytest.raises(openai.BadRequestError, match="service_tier"):
        oai.chat.completions.create(model="default", max_tokens=3, service_tier="gold",  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="cache_control.type"):
        claude.messages.create(model="default", max_tokens=3,
                               messages=[{"role": "user", "content": "hi"}],
                               extra_body={"cache_control": {"type": "forever"}})


def test_a_repeated_prompt_reports_its_cached_tokens_in_both_dialects(
        oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    """The prefix cache's hit, as each SDK parses it: the second identical prompt finds every
    full block of 16 but the one holding its last token."""
    messages = [{"role": "user", "content": "Name three rivers of Europe, one per line, "
                                            "with the sea each one flows into, and no more."}]
    first = oai.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                        max_tokens=2, temperature=0)
    again = oai.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                        max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None
    n = first.usage.prompt_tokens
    assert n > 17 and again.usage.prompt_tokens == n
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    reply = claude.messages.create(model="default", messages=messages,  # type: ignore[arg-type]
                                   max_tokens=2)
    # Anthropic's input_tokens are those not read from the cache: the three parts add up
    assert reply.usage.cache_read_input_tokens == (n - 1) // 16 * 16
    assert reply.usage.cache_creation_input_tokens == 0
    assert reply.usage.input_tokens == n - (n - 1) // 16 * 16
