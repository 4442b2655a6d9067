"""``POST /v1/completions`` (OpenAI's legacy text completions) through the official ``openai``
SDK against the tiny model served on 127.0.0.1.

Oracles: transformers' tokenizer for the raw prompt's ids (``tokenizer(prompt)``: special
tokens parsed, its post-processor's BOS), and the library generating greedily from those ids
in this process (``Pipeline.generate`` on ``Request(prompt_ids=...)``), never the HTTP code's
own output; the library's logprobs for the legacy ``logprobs`` object; the SDK's own parsing
of bodies and streams.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.output import Completion
from pipeline.contracts.request import GenerationConfig, Request
from stages.tokenize import HFTokenizer
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig
from tests.bos_tokenizer import BOS, bos_tokenizer_file

PROMPTS = ["Once upon a time", "def fibonacci(n):\n    ", "Café naïve – 東京 ✓",
           "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("completions")


@pytest.fixture(scope="module")
def library() -> Iterator[Pipeline]:
    with build("tiny") as pipe:
        yield pipe


@pytest.fixture(scope="module")
def base_url(folder: Path) -> Iterator[str]:
    bos = HFTokenizer.from_files(bos_tokenizer_file(folder),
                                 config_file=TINY_MODEL_DIR / "tokenizer_config.json")

    def builder(model: Path | None, cfg: ServerConfig) -> Pipeline:
        # the library's answers below are a Request's own config (nothing laid under it): the
        # served models' defaults are that neutral config too, not the model's recommendation
        if model is not None and model.name == "bos":
            return build(TINY_MODEL_DIR, tokenizer=bos, options={"num_slots": cfg.num_slots},
                         defaults=GenerationConfig())
        if model is not None and model.name == "endless":
            return endless_model(delay_s=0.01)[0]
        return build("tiny", options={"num_slots": cfg.num_slots}, defaults=GenerationConfig())

    cfg = config(folder, models={"default": None, "bos": Path("bos"),
                                 "endless": Path("endless")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def hf_ids(prompt: str) -> list[int]:
    return list(AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))(prompt)["input_ids"])


def greedy(library: Pipeline, ids: list[int], max_tokens: int, **config: object) -> Completion:
    return library.generate(Request(prompt_ids=ids, generation_config={
        "max_tokens": max_tokens, "temperature": 0, **config}))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_equals_the_library_on_the_tokenizers_ids(
        oai: openai.OpenAI, library: Pipeline, prompt: str) -> None:
    ids = hf_ids(prompt)
    expected = greedy(library, ids, 12)
    out = oai.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    (choice,) = out.choices
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert choice.text == expected.text and choice.index == 0
    assert choice.finish_reason == ("length" if expected.finish_reason.value == "length"
                                    else "stop")
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == expected.usage.completion_tokens
    chunks = list(oai.completions.create(model="default", prompt=prompt, max_tokens=12,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (out.usage.prompt_tokens,
                                                              out.usage.completion_tokens)
    # the same prompt again: the prefix cache holds its full blocks of 16 but the last token
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompts_and_batches(oai: openai.OpenAI, library: Pipeline) -> None:
    first, second = hf_ids(PROMPTS[0]), hf_ids(PROMPTS[1])
    by_ids = oai.completions.create(model="default", prompt=first, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == greedy(library, first, 8).text
    batch = oai.completions.create(model="default", prompt=[PROMPTS[0], second], n=2,
                                   max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in batch.choices]
    assert texts == [greedy(library, first, 8).text] * 2 + [greedy(library, second, 8).text] * 2
    assert batch.usage is not None  # each prompt counted once, the four answers summed
    assert batch.usage.prompt_tokens == len(first) + len(second)
    assert batch.usage.completion_tokens == sum(
        greedy(library, p, 8).usage.completion_tokens * 2 for p in (first, second))


def test_echo_repeats_the_prompt_before_the_answer(oai: openai.OpenAI, library: Pipeline) -> None:
    prompt = PROMPTS[0]
    answer = greedy(library, hf_ids(prompt), 6).text
    out = oai.completions.create(model="default", prompt=prompt, max_tokens=6, temperature=0,
                                 echo=True)
    assert out.choices[0].text == prompt + answer
    ids = hf_ids(PROMPTS[3])
    by_ids = oai.completions.create(model="default", prompt=ids, max_tokens=6, temperature=0,
                                    echo=True)
    assert by_ids.choices[0].text.startswith(PROMPTS[3])  # ids decoded, specials kept
    chunks = list(oai.completions.create(model="default", prompt=prompt, max_tokens=6,
                                         temperature=0, echo=True, stream=True, n=2))
    for index in (0, 1):
        mine = [c.choices[0].text for c in chunks if c.choices[0].index == index]
        assert mine[0] == prompt and "".join(mine) == prompt + answer


def test_legacy_logprobs_follow_the_library(oai: openai.OpenAI, library: Pipeline) -> None:
    prompt = PROMPTS[2]
    ids = hf_ids(prompt)
    expected = greedy(library, ids, 10, logprobs=True, top_logprobs=3)
    out = oai.completions.create(model="default", prompt=prompt, max_tokens=10, temperature=0,
                                 logprobs=3)
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and expected.logprobs is not None
    decode = library.stages.tokenizer.decode  # type: ignore[union-attr]
    assert lp.tokens == [x.text for x in expected.logprobs]  # as chat's logprobs spell them
    assert lp.token_logprobs == pytest.approx([x.logprob for x in expected.logprobs], abs=1e-5)
    assert lp.top_logprobs is not None and lp.text_offset is not None
    for item, top, token in zip(expected.logprobs, lp.top_logprobs, lp.tokens, strict=True):
        assert len(top) <= 3 and list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == pytest.approx(item.logprob, abs=1e-5)  # greedy: the best one
    # each offset is where the token's text starts: the text before it has that length
    for k, offset in enumerate(lp.text_offset):
        before = decode([x.token_id for x in expected.logprobs[:k]])
        assert offset == len(before.rstrip("\ufffd")) and choice.text.startswith(before[:offset])
    streamed = list(oai.completions.create(model="default", prompt=prompt, max_tokens=10,
                                           temperature=0, logprobs=3, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens or ()] == lp.tokens
    assert [o for p in parts for o in p.text_offset or ()] == lp.text_offset


def test_defaults_stop_and_sampling_fields(oai: openai.OpenAI, library: Pipeline) -> None:
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    (word,) = hf.encode(" list", add_special_tokens=False)
    bias = {str(word): 100}
    out = oai.completions.create(model="default", prompt="x", logit_bias=bias)  # type: ignore[arg-type]
    assert out.choices[0].text == " list" * 16 and out.choices[0].finish_reason == "length"
    stopped = oai.completions.create(model="default", prompt="x", logit_bias=bias,  # type: ignore[arg-type]
                                     stop=["t l"], max_tokens=6)
    assert stopped.choices[0].text == " lis" and stopped.choices[0].finish_reason == "stop"
    ids = hf_ids("x")
    sampled = library.generate(Request(prompt_ids=ids, generation_config={
        "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 11,
        "presence_penalty": 0.5, "frequency_penalty": 0.3}))
    same = oai.completions.create(model="default", prompt="x", max_tokens=8, temperature=0.9,
                                  top_p=0.95, seed=11, presence_penalty=0.5,
                                  frequency_penalty=0.3, user="u-1", best_of=1, suffix="")
    assert same.choices[0].text == sampled.text


def test_a_tokenizer_that_adds_a_bos_gets_it_on_text_prompts(oai: openai.OpenAI,
                                                               folder: Path) -> None:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    with build(TINY_MODEL_DIR) as plain:
        for prompt in PROMPTS:
            ids = list(hf(prompt)["input_ids"])
            assert ids[0] == BOS
            expected = greedy(plain, ids, 6)
            out = oai.completions.create(model="bos", prompt=prompt, max_tokens=6, temperature=0)
            assert out.usage is not None and out.usage.prompt_tokens == len(ids)
            assert out.choices[0].text == expected.text
        given = hf_ids(PROMPTS[0])  # token ids are taken as they are: no BOS added
        by_ids = oai.completions.create(model="bos", prompt=given, max_tokens=6, temperature=0)
        assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(given)


BAD = [
    ({"suffix": "tail"}, "suffix", "fill-in-the-middle"),
    ({"best_of": 3}, "best_of", "best_of equal to n"),
    ({"echo": True, "logprobs": 1}, "logprobs", "prompt tokens' logprobs"),
    ({"prompt": []}, "prompt", "at least one prompt"),
    ({"prompt": [[]]}, "prompt[0]", "at least one id"),
    ({"prompt": [7, 10**9]}, "prompt[1]", "outside the vocabulary"),
    ({"prompt": ["ok", [3, -1]]}, "prompt[1][1]", "non-negative"),
    ({"prompt": ""}, "prompt", "encodes to no tokens"),
    ({"prompt": [True]}, "prompt[0]", "string or a list of token ids"),
    ({"logprobs": 21}, "logprobs", "must be in"),
    ({"max_tokens": 0}, "max_tokens", "must be in"),
    ({"n": 9, "prompt": ["a", "b"]}, "prompt", "max_n"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"prompt": "word " * 5000}, "prompt", "too long"),
]


@pytest.mark.parametrize(("extra", "param", "message"), BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_bad_requests_are_400s_naming_the_field(oai: openai.OpenAI, extra: dict[str, object],
                                                param: str, message: str) -> None:
    body = {"model": "default", "prompt": "hi", "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError, match=message) as err:
        oai.completions.create(**body)  # type: ignore[call-overload]
    assert err.value.body["param"] == param  # type: ignore[index]


def test_an_unknown_field_suggests_the_documented_one(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens") as err:
        oai.completions.create(model="default", prompt="hi",  # type: ignore[call-overload]
                               extra_body={"max_token": 3})
    assert err.value.body["code"] == "unknown_field"  # type: ignore[index]
    assert err.value.body["param"] == "max_token"  # type: ignore[index]


def test_gateway_duties_keys_usage_records_metrics_and_disconnect(
        base_url: str, folder: Path, tmp_path: Path) -> None:
    keyed = config(tmp_path, api_keys={"sk-1"})
    with running(Gateway(keyed)) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).\
                completions.create(model="default", prompt="hi", max_tokens=2)
        served = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-1", max_retries=0)
        out = served.completions.create(model="default", prompt="hi", max_tokens=3, n=2,
                                        temperature=0)
        metrics = httpx.get(f"{url}/metrics").text
    assert ('pipeline_requests_total{endpoint="completions",model="default",status="200"} 1.0'
            in metrics)
    with sqlite3.connect(str(tmp_path / "usage.sqlite3")) as db:
        rows = db.execute("SELECT endpoint, prompt_tokens, completion_tokens, finish_reason "
                          "FROM usage WHERE request_id = ?", (out.id,)).fetchall()
    assert out.usage is not None and len(rows) == 1  # one row for the request's two choices
    assert rows[0][:3] == ("completions", out.usage.prompt_tokens, out.usage.completion_tokens)
    assert rows[0][3].split(",") == [("length" if c.finish_reason == "length" else "eos")
                                     for c in out.choices]
    # a streaming client that leaves cancels every choice, and the record says so
    body = {"model": "endless", "prompt": "go", "max_tokens": 5000, "n": 2, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            got = [line for _, line in zip(range(12), lines) if line.startswith("data:")]
            request_id = json.loads(got[0][5:])["id"]
    deadline, row = time.monotonic() + 30, None
    while row is None and time.monotonic() < deadline:
        with sqlite3.connect(str(folder / "usage.sqlite3")) as db:
            row = db.execute("SELECT finish_reason, completion_tokens FROM usage WHERE "
                             "request_id = ?", (request_id,)).fetchone()
        time.sleep(0.01)
    assert row is not None and row[0] == "cancelled,cancelled" and 0 < row[1] < 10000
