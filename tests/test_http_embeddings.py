"""``POST /v1/embeddings`` through the official ``openai`` SDK and raw HTTP, on 127.0.0.1
(one server for the module: the tiny model, and a scripted one without hidden states).

Oracle: transformers' own forward of the tiny model's checkpoint (``output_hidden_states``:
its last entry is the final norm's output), mean-pooled and L2-normalized, on the ids
transformers' tokenizer gives; and the float answer for the base64 one.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from pipeline.builder import build
from pipeline.errors import EngineClosed
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.pipe import Pipeline
from pipeline.contracts.request import GenerationConfig
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig

KEY = "sk-test-key"
TEXTS = ["The cat sat on the mat.", "A list holds items in order.", "hello"]
WINDOW = 256


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "scripted":
        return endless_model()[0]
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("embeddings"), api_keys={KEY}, max_context=WINDOW,
                 models={"default": None, "scripted": Path("scripted")})
    with running(Gateway(cfg, builder)) as url:
        yield url


@pytest.fixture
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def _post(base_url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/embeddings", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"})


def _floats(base_url: str, inputs: Any, **fields: Any) -> list[list[float]]:
    answer = _post(base_url, {"model": "default", "input": inputs, **fields})
    assert answer.status_code == 200, answer.text
    return [d["embedding"] for d in answer.json()["data"]]


def test_the_vectors_are_transformers_pooled_final_hidden_states(base_url: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    body = _post(base_url, {"model": "default", "input": TEXTS}).json()
    assert body["object"] == "list" and body["model"] == "default"
    counted = 0
    for i, text in enumerate(TEXTS):
        ids = tokenizer(text)["input_ids"]
        counted += len(ids)
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        expected = torch.nn.functional.normalize(states[0].float().mean(0), dim=0)
        got = torch.tensor(body["data"][i]["embedding"])
        assert body["data"][i]["object"] == "embedding" and body["data"][i]["index"] == i
        assert got.shape == expected.shape == (model.config.hidden_size,)
        assert (got - expected).abs().max().item() <= 1e-2
        assert abs(got.norm().item() - 1.0) <= 1e-5
    assert body["usage"] == {"prompt_tokens": counted, "total_tokens": counted}


def test_base64_batches_ids_and_the_sdk_agree_with_floats(base_url: str,
                                                          oai: openai.OpenAI) -> None:
    floats = _floats(base_url, TEXTS)
    answer = _post(base_url, {"model": "default", "input": TEXTS, "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist()
               for d in answer.json()["data"]]
    assert decoded == floats  # the same float32 values, bit for bit
    assert [_floats(base_url, t)[0] for t in TEXTS] == floats  # a batch is each one alone
    ids = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)(TEXTS[0])["input_ids"]
    assert _floats(base_url, ids) == floats[:1] == _floats(base_url, [ids])
    sdk = oai.embeddings.create(model="default", input=TEXTS)  # base64 on the wire
    assert [d.embedding for d in sdk.data] == floats
    assert oai.embeddings.create(model="default", input=TEXTS[0], encoding_format="float",
                                 dimensions=len(floats[0])).data[0].embedding == floats[0]


def test_embeddings_beside_a_stream_change_neither(base_url: str, oai: openai.OpenAI) -> None:
    alone = _floats(base_url, TEXTS)
    streamed: list[str] = []

    def stream() -> None:
        for chunk in oai.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Count to ten."}],
                max_tokens=48, temperature=0, stream=True):
            streamed.append(chunk.choices[0].delta.content or "" if chunk.choices else "")

    thread = threading.Thread(target=stream)
    thread.start()
    during = [_floats(base_url, TEXTS) for _ in range(3)]
    thread.join(60)
    assert all(d == alone for d in during)
    plain = oai.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=48, temperature=0)
    assert "".join(streamed) == plain.choices[0].message.content


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "default"}, "input"),
    ({"model": "default", "input": []}, "input"),
    ({"model": "default", "input": [3, "a"]}, "input[0]"),
    ({"model": "default", "input": [[]]}, "input[0]"),
    ({"model": "default", "input": [-1]}, "input[0]"),
    ({"model": "default", "input": [10 ** 9]}, "input[0]"),
    ({"model": "default", "input": ""}, "input"),
    ({"model": "default", "input": [1] * (WINDOW + 1)}, "input"),
    ({"model": "default", "input": "hi", "dimensions": 7}, "dimensions"),
    ({"model": "default", "input": "hi", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "default", "input": "hi", "colour": "blue"}, "colour"),
    ({"model": "scripted", "input": "hi"}, "model"),
])
def test_bad_bodies_are_400s_naming_the_field(oai: openai.OpenAI, body: dict[str, Any],
                                              param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        oai.post("/embeddings", body=body, cast_to=httpx.Response)
    assert err.value.body["param"] == param  # type: ignore[index]


def test_an_unknown_model_is_a_404_naming_the_served_ones(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        oai.embeddings.create(model="nope", input="hi")
    assert err.value.body["served_models"] == ["default", "scripted"]  # type: ignore[index]


def test_engine_calls_run_on_the_engine_thread_and_stop_with_it() -> None:
    pipe = endless_model()[0]
    engine = pipe.engine
    assert engine is not None
    handle = pipe.submit("Hi", GenerationConfig(max_tokens=40))
    names = [engine.call(lambda: threading.current_thread().name).result(10)
             for _ in range(3)]
    assert names == ["pipeline-engine"] * 3  # between steps of a running request
    assert len(handle.result(timeout=30).text) > 0
    failed = engine.call(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(10)  # the caller's error, the engine goes on
    assert engine.call(lambda: 7).result(10) == 7
    pipe.close()
    with pytest.raises(EngineClosed):
        engine.call(lambda: 7)


def test_a_call_is_not_timed_as_a_step_and_waiting_calls_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.engine import api as engine_module
    from pipeline.errors import CapacityError

    pipe = build("tiny")
    engine = pipe.engine
    assert engine is not None
    inside, release = threading.Event(), threading.Event()
    running_call = engine.call(lambda: (inside.set(), release.wait(30)))
    assert inside.wait(30)
    assert engine.stall() is None  # the watchdog never abandons the engine for a call
    monkeypatch.setattr(engine_module, "MAX_CALLS", 2)
    waiting = [engine.call(lambda: 1), engine.call(lambda: 2)]
    with pytest.raises(CapacityError):
        engine.call(lambda: 3)
    release.set()
    assert [f.result(30) for f in waiting] == [1, 2] and running_call.result(30)[1]
    pipe.close()


def test_a_long_input_is_attended_in_query_tiles_with_the_same_states(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.torch import model as model_module

    with build("tiny", dtype="float32") as pipe:
        backend = pipe.engine.backend  # type: ignore[union-attr]
        ids = [(7 * i) % 1000 + 3 for i in range(600)]
        tiled = backend.hidden_states(ids)  # three tiles of 256 queries
        monkeypatch.setattr(model_module, "HIDDEN_TILE", 4096)
        whole = backend.hidden_states(ids)
    assert tiled.shape == whole.shape == (600, tiled.shape[1])
    assert torch.allclose(tiled, whole, atol=1e-5, rtol=1e-4)
