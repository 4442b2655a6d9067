"""A multi-turn conversation over HTTP reuses its earlier turns from the prefix cache.

A real server serves the embedded model twice: ``default`` with a paged KV cache of small
blocks (4 positions), and ``cold`` with blocks of 1024, so that none of these prompts ever
holds a full block that a match could reuse (a server without prefix reuse). Through the real
``openai`` and ``anthropic`` SDKs each test asks turn 1, then turn 2: turn 1's messages, the
answer as the SDK returned it, and a new user message.

Oracles: transformers' chat template tokenizes both turns' prompts; the turn-1 tokens the
engine computed are that prompt and the generated ids but the last (which is never fed); so
turn 2 must report as cached the whole blocks of the longest common prefix of those and turn
2's prompt (never the whole prompt: one token is always left to compute). The cold server's
greedy answer to turn 2 is what the warm one must answer. Anthropic's usage must split the
prompt (input tokens not read from the cache, cache reads, cache writes) so that the parts add
up to transformers' count and to ``count_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.decode import Row
from pipeline.testing import ScriptedSelector
from stages.tokenize import HFTokenizer
from tests.http_support import ANSWER_TEXT, IM_END, TOOL_CALL_TEXT, TOOL_RESPONSE, config, running
from transports.http import Gateway, ServerConfig
from transports.http.accounting.usage import read_records

KEY = "sk-multiturn"
BLOCK = 4
SYSTEM = "You answer questions about Python's standard library."


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def agent(num_slots: int) -> Pipeline:
    """The embedded model (paged, blocks of 4) with a scripted selector: it calls
    ``get_weather`` as ``TOOL_CALL_TEXT`` writes it, and answers ``ANSWER_TEXT`` once the
    prompt holds a tool response."""
    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    call = tok.encode_text(TOOL_CALL_TEXT, special=True) + [IM_END]
    answer = tok.encode_text(ANSWER_TEXT) + [IM_END]

    def choose(row: Row) -> int:
        script = answer if TOOL_RESPONSE in row.prompt_ids else call
        return script[min(len(row.output_ids), len(script) - 1)]

    return build("tiny", selector=ScriptedSelector(choose),
                 options={"num_slots": num_slots, "block_size": BLOCK})


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "agent":
        return agent(cfg.num_slots)
    block = 1024 if folder is not None and folder.name == "cold" else BLOCK
    # float32: a warm answer equals the cold one there; in bfloat16 a chunk of another length
    # can round a near-tie the other way (the reproducibility levels' open question)
    return build("tiny", options={"num_slots": cfg.num_slots, "block_size": block,
                                  "dtype": "float32"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    data = tmp_path_factory.mktemp("multiturn")
    cfg = config(data, api_keys={KEY}, models={"default": None, "cold": Path("cold"),
                                                  "agent": Path("agent")})
    with running(Gateway(cfg, builder)) as url:
        yield url, data


@pytest.fixture
def oai(server: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(server: tuple[str, Path]) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf() -> Any:
    return AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))


def prompt_ids(hf: Any, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
    """The oracle: transformers' rendering and tokenization of a chat prompt."""
    ids = hf.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True,
                                 **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def generated_ids(url: str, request_id: str) -> list[int]:
    """The ids a request generated, from its trace's ``token.selected`` events."""
    trace = httpx.get(f"{url}/traces/{request_id}", headers={"x-api-key": KEY})
    assert trace.status_code == 200, trace.text
    events = [json.loads(line) for line in trace.text.splitlines()]
    return [e["payload"]["token_id"] for e in events if e["event_type"] == "token.selected"]


def reusable(turn1_prompt: Sequence[int], turn1_output: Sequence[int],
             turn2_prompt: Sequence[int]) -> int:
    """Positions of turn 2's prompt the prefix cache can hold after turn 1: the whole blocks
    of what turn 1 computed (its prompt, its output but the last token) that turn 2's prompt
    starts with, leaving at least one token of turn 2 to compute."""
    computed = [*turn1_prompt, *turn1_output[:-1]]
    same = 0
    while same < min(len(computed), len(turn2_prompt)) and computed[same] == turn2_prompt[same]:
        same += 1
    return min(same, len(turn2_prompt) - 1) // BLOCK * BLOCK


def turns(question: str) -> tuple[list[dict[str, str]], str]:
    """Turn 1's messages (a system prompt and ``question``) and turn 2's new question."""
    return ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "And how would you test that?")


@pytest.mark.parametrize("stream", [False, True])
def test_openai_turn_two_reuses_turn_one_s_prompt_and_answer(
        oai: openai.OpenAI, server: tuple[str, Path], hf: Any, stream: bool) -> None:
    mode = "streamed" if stream else "whole"
    first, follow_up = turns(f"How do I read a file line by line? ({mode})")
    one = oai.chat.completions.create(model="default", messages=first,  # type: ignore[arg-type]
                                      max_tokens=40, temperature=0)
    p1, out1 = prompt_ids(hf, first), generated_ids(server[0], one.id)
    assert one.usage is not None and one.usage.prompt_tokens == len(p1)
    assert one.usage.completion_tokens == len(out1)
    answer = one.choices[0].message.content
    assert answer
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": follow_up}]
    p2 = prompt_ids(hf, second)
    assert p2[:len(p1)] == p1  # the template renders turn 1 as its prompt was
    if stream:
        chunks = list(oai.chat.completions.create(
            model="default", messages=second, max_tokens=24, temperature=0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        two = oai.chat.completions.create(model="default", messages=second,  # type: ignore[arg-type]
                                          max_tokens=24, temperature=0)
        text, usage = two.choices[0].message.content or "", two.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    # prompt_tokens counts the whole prompt; the cached tokens are a part of it
    assert usage.prompt_tokens == len(p2)
    assert cached == reusable(p1, out1, p2)
    assert cached is not None and cached >= len(p1) // BLOCK * BLOCK
    # this greedy answer re-tokenizes as generated (transformers' turn 2 holds turn 1's
    # output), so every block turn 1 computed is reused, the answer's too
    assert p2[len(p1):len(p1) + len(out1) - 1] == out1[:-1]
    assert cached == (len(p1) + len(out1) - 1) // BLOCK * BLOCK > len(p1)
    cold = oai.chat.completions.create(model="cold", messages=second,  # type: ignore[arg-type]
                                       max_tokens=24, temperature=0)
    assert cold.usage is not None and cold.usage.prompt_tokens_details is not None
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert text == cold.choices[0].message.content and text


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_turn_two_reuses_turn_one_and_splits_its_usage(
        claude: anthropic.Anthropic, server: tuple[str, Path], hf: Any, stream: bool) -> None:
    mode = "streamed" if stream else "whole"
    first, follow_up = turns(f"What does itertools.chain do? ({mode})")
    user = first[1:]
    # this SDK has no temperature argument: it goes in the body
    one = claude.messages.create(model="default", system=SYSTEM, messages=user,  # type: ignore[arg-type]
                                 max_tokens=40, extra_body={"temperature": 0})
    p1, out1 = prompt_ids(hf, first), generated_ids(server[0], one.id)
    assert one.content and one.content[0].type == "text"
    answer = one.content[0].text
    second = [*user, {"role": "assistant", "content": answer},
              {"role": "user", "content": follow_up}]
    p2 = prompt_ids(hf, [first[0], *second])
    args: dict[str, Any] = dict(model="default", system=SYSTEM, messages=second, max_tokens=24,
                                extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**args) as events:
            starts = [e.message.usage for e in events if e.type == "message_start"]
            two = events.get_final_message()
        # the stream opens before the cache is looked up: message_start counts the whole
        # prompt as input, and message_delta's cumulative usage replaces it
        assert [u.input_tokens for u in starts] == [len(p2)]
        assert starts[0].cache_read_input_tokens is None
    else:
        two = claude.messages.create(**args)
    usage = two.usage
    expected = reusable(p1, out1, p2)
    assert p2[len(p1):len(p1) + len(out1) - 1] == out1[:-1]  # as generated: the answer too
    assert expected == (len(p1) + len(out1) - 1) // BLOCK * BLOCK > len(p1)
    assert usage.cache_read_input_tokens == expected
    assert usage.cache_creation_input_tokens == 0
    assert usage.input_tokens == len(p2) - expected
    counted = claude.messages.count_tokens(model="default", system=SYSTEM, messages=second)  # type: ignore[arg-type]
    assert counted.input_tokens == len(p2) == (
        usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens)
    cold = claude.messages.create(**{**args, "model": "cold"})
    assert cold.usage.cache_read_input_tokens == 0 and cold.usage.input_tokens == len(p2)
    assert [b.model_dump() for b in two.content] == [b.model_dump() for b in cold.content]


def test_an_agent_loop_reuses_the_tool_call_it_sends_back(
        oai: openai.OpenAI, server: tuple[str, Path], hf: Any) -> None:
    """The call comes back as the client got it (the arguments as the model wrote them), so
    the turn after the tool's result reuses the whole call from the cache."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    one = oai.chat.completions.create(model="agent", messages=ask, tools=[WEATHER],  # type: ignore[arg-type]
                                      max_tokens=64)
    calls = one.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.arguments == '{"city": "Paris"}'
    p1, out1 = prompt_ids(hf, ask, tools=[WEATHER]), generated_ids(server[0], one.id)
    follow = [*ask, one.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp_c": 18}'}]
    two = oai.chat.completions.create(model="agent", messages=follow, tools=[WEATHER],  # type: ignore[arg-type]
                                      max_tokens=64)
    assert two.choices[0].message.content == ANSWER_TEXT
    p2 = prompt_ids(hf, follow, tools=[WEATHER])
    assert two.usage is not None and two.usage.prompt_tokens == len(p2)
    assert two.usage.prompt_tokens_details is not None
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached == reusable(p1, out1, p2) == (len(p1) + len(out1) - 1) // BLOCK * BLOCK


def test_an_anthropic_agent_loop_reuses_the_tool_use_it_sends_back(
        claude: anthropic.Anthropic, server: tuple[str, Path], hf: Any) -> None:
    """A ``tool_use`` block's input is an object: re-encoded as the template's ``tojson``
    would write it, it renders as this model wrote it, and the call is reused too."""
    fn = WEATHER["function"]
    tools = [{"name": fn["name"], "description": fn["description"],
              "input_schema": fn["parameters"]}]
    ask = [{"role": "user", "content": "Weather in Paris, please?"}]
    one = claude.messages.create(model="agent", messages=ask, tools=tools,  # type: ignore[arg-type]
                                 max_tokens=64)
    (use,) = [b for b in one.content if b.type == "tool_use"]
    p1, out1 = prompt_ids(hf, ask, tools=[WEATHER]), generated_ids(server[0], one.id)
    follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                      for b in one.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": '{"temp_c": 18}'}]}]
    two = claude.messages.create(model="agent", messages=follow, tools=tools,  # type: ignore[arg-type]
                                 max_tokens=64)
    assert two.content[0].type == "text" and two.content[0].text == ANSWER_TEXT
    p2 = prompt_ids(hf, [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": use.input}}]},
        {"role": "tool", "content": '{"temp_c": 18}'}], tools=[WEATHER])
    usage = two.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(p2)
    assert usage.cache_read_input_tokens == reusable(p1, out1, p2) == (
        len(p1) + len(out1) - 1) // BLOCK * BLOCK
    # non-ASCII input is written as text, as transformers' tojson writes it, not escaped
    zurich = [*ask, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Zürich"}}]}]
    counted = claude.messages.count_tokens(model="agent", messages=zurich, tools=tools)  # type: ignore[arg-type]
    assert counted.input_tokens == len(prompt_ids(hf, [*ask, {
        "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Zürich"}}}]}], tools=[WEATHER]))


def test_usage_rows_and_metrics_count_cached_tokens(
        oai: openai.OpenAI, server: tuple[str, Path]) -> None:
    """Each usage row holds its request's cached tokens as the response reported them, and
    /metrics adds them up per model (and counts the generations that hit)."""
    url, data = server
    messages = [{"role": "user", "content": "List three modules for working with dates."}]
    replies = [oai.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=4, temperature=0)
               for model in ("default", "default", "cold", "cold")]
    reported = {}
    for reply in replies:
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        reported[reply.id] = reply.usage.prompt_tokens_details.cached_tokens
    assert reported[replies[0].id] == 0 and reported[replies[1].id] > 0
    rows = read_records(data / "usage.sqlite3")
    by_id = {row.request_id: row for row in rows}
    assert {rid: by_id[rid].cached_tokens for rid in reported} == reported
    scrape = httpx.get(f"{url}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scrape) for s in family.samples}
    for model in ("default", "cold"):
        mine = [row for row in rows if row.model == model]
        label = (("model", model),)
        assert samples[("pipeline_cached_prompt_tokens_total", label)] == sum(
            row.cached_tokens for row in mine)
        assert samples[("pipeline_prefix_cache_hits_total", label)] == sum(
            1 for row in mine if row.cached_tokens)
    assert samples[("pipeline_prefix_cache_hits_total", (("model", "cold"),))] == 0
    assert samples[("pipeline_prefix_cache_hits_total", (("model", "default"),))] >= 1
