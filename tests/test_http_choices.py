"""``n`` choices per request, for chat completions and completions, through the ``openai`` SDK.

Oracles: separate single requests with seeds ``seed + i`` (the documented rule), greedy
choices equal to each other, the non-stream answer for the streamed one, and the scripted
backend's own log of its batches (the choices run together, not one after another).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pipeline.builder import build
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig
from transports.http.server.limits import Limits

ASK = [{"role": "user", "content": "Tell me about Python lists."}]


@pytest.fixture(scope="module")
def scripted() -> tuple[Pipeline, ScriptedBackend]:
    return endless_model(delay_s=0.01)  # a step takes 10 ms: deltas come one by one


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory,
             scripted: tuple[Pipeline, ScriptedBackend]) -> Iterator[str]:
    def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        if folder is not None and folder.name == "endless":
            return scripted[0]
        return build("tiny", options={"num_slots": cfg.num_slots})

    cfg = config(tmp_path_factory.mktemp("usage"), models={"default": None,
                                                           "endless": Path("endless")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_chat_choices_equal_single_requests_seeded_seed_plus_index(oai: openai.OpenAI) -> None:
    args = dict(model="default", messages=ASK, max_tokens=10, temperature=1.0, top_p=0.95)
    out = oai.chat.completions.create(n=3, seed=41, **args)  # type: ignore[call-overload]
    singles = [oai.chat.completions.create(seed=41 + i, **args) for i in range(3)]  # type: ignore[call-overload]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.message.content for c in out.choices] == [
        s.choices[0].message.content for s in singles]
    assert [c.finish_reason for c in out.choices] == [s.choices[0].finish_reason
                                                      for s in singles]
    assert len({c.message.content for c in out.choices}) > 1  # the seeds differ, so do they
    assert out.usage is not None  # the prompt once, the completions summed
    assert out.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_choices_equal_single_requests_and_negative_seeds_wrap(
        oai: openai.OpenAI) -> None:
    args = dict(model="default", prompt="The list", max_tokens=8, temperature=1.0)
    out = oai.completions.create(n=2, seed=-1, **args)  # type: ignore[call-overload]
    # seed -1 is 2**63 - 1 (mod 2**63); choice 1 wraps to 0
    singles = [oai.completions.create(seed=s, **args) for s in (-1, 0)]  # type: ignore[call-overload]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]


def test_greedy_choices_are_identical(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model="default", messages=ASK, max_tokens=10,  # type: ignore[call-overload]
                                       temperature=0, n=2)
    first, second = (c.message.content for c in chat.choices)
    assert first == second and first
    text = oai.completions.create(model="default", prompt="The list", max_tokens=8,
                                  temperature=0, n=3)
    assert len({c.text for c in text.choices}) == 1


def test_without_a_seed_each_choice_draws_its_own(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(model="default", messages=ASK, max_tokens=16,  # type: ignore[call-overload]
                                      temperature=1.5, n=4)
    assert len({c.message.content for c in out.choices}) > 1


def test_streamed_choices_interleave_and_reassemble(oai: openai.OpenAI) -> None:
    args = dict(model="default", messages=ASK, max_tokens=12, temperature=0.9, seed=5, n=2)
    whole = oai.chat.completions.create(**args)  # type: ignore[call-overload]
    chunks = list(oai.chat.completions.create(stream=True,  # type: ignore[call-overload]
                                              stream_options={"include_usage": True}, **args))
    texts, finishes, roles = ["", ""], [[], []], [0, 0]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [[c.finish_reason] for c in whole.choices] and roles == [1, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    slow = oai.chat.completions.create(model="endless", messages=ASK, max_tokens=20, n=2,  # type: ignore[call-overload]
                                       stream=True)
    indices = [c.choices[0].index for c in slow][2:]  # after both role chunks
    assert indices != sorted(indices)  # interleaved as they came, not one after the other
    text_args = dict(model="default", prompt="The list", max_tokens=8, temperature=0.9,
                     seed=5, n=2)
    text_whole = oai.completions.create(**text_args)  # type: ignore[call-overload]
    pieces = ["", ""]
    for chunk in oai.completions.create(stream=True, **text_args):  # type: ignore[call-overload]
        pieces[chunk.choices[0].index] += chunk.choices[0].text
    assert pieces == [c.text for c in text_whole.choices]


def test_choices_run_in_the_same_batches(oai: openai.OpenAI,
                                         scripted: tuple[Pipeline, ScriptedBackend]) -> None:
    backend = scripted[1]
    before = len(backend.calls)
    out = oai.chat.completions.create(model="endless", messages=ASK, max_tokens=6, n=4)  # type: ignore[call-overload]
    assert [c.message.content for c in out.choices] == ["aaaaaa"] * 4
    # each forward's rows are (slot, tokens): a decode row feeds one token, a prompt chunk
    # (the templated question, many tokens) more
    decodes = [[slot for slot, tokens in rows if tokens == 1]
               for kind, rows in backend.calls[before:] if kind == "forward"]
    decodes = [slots for slots in decodes if slots]
    assert max(len(slots) for slots in decodes) == 4  # every choice in one decode step
    assert len(decodes) <= 5 + 3  # not four requests' worth of steps in a row


def test_max_n_bounds_choices(tmp_path: Path) -> None:
    with running(Gateway(config(tmp_path, limits=Limits(max_n=2)))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert len(client.chat.completions.create(model="default", messages=ASK,  # type: ignore[call-overload]
                                                  max_tokens=2, n=2).choices) == 2
        with pytest.raises(openai.BadRequestError, match="max_n") as err:
            client.chat.completions.create(model="default", messages=ASK, max_tokens=2, n=3)  # type: ignore[call-overload]
        assert err.value.body["param"] == "n" and err.value.body["maximum"] == 2  # type: ignore[index]
        with pytest.raises(openai.BadRequestError, match="max_n"):
            client.completions.create(model="default", prompt=["a", "b", "c"], max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="n"):
            client.completions.create(model="default", prompt="a", max_tokens=2, n=0)
