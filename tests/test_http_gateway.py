"""Gateway duties over real HTTP on 127.0.0.1: admission (429 / Anthropic 529), disconnect →
cancel within one engine step, window arithmetic, traceparent, loading (503), metrics,
tokenize/detokenize. Oracles: the SDKs' error classes, the scripted backend's call log,
transformers' tokenizer, and Prometheus' own text parser."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from pipeline.builder import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.errors import ContextWindowError
from transports.http.serving_errors import AuthenticationError
from pipeline.pipe import Pipeline
from pipeline.testing import ScriptedBackend, peaked
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import Request
from pipeline.contracts.text import Rendered, TokenizedPrompt
from stages.tokenize import HFTokenizer
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig, load_api_keys
from transports.http.gateway.fit import token_upper_bound
from transports.http.accounting.usage import read_records

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
_TOKENIZER = HFTokenizer.from_dir(TINY_MODEL_DIR)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def chat(max_tokens: int, stream: bool = False, **extra: object) -> dict[str, object]:
    return {"model": "default", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens, "stream": stream, **extra}


def test_overload_then_disconnect_frees_the_slot_within_one_step(tmp_path: Path) -> None:
    pipe, backend = endless_model(delay_s=0.01, num_slots=1)
    gateway = Gateway(config(tmp_path, num_slots=1, max_queue=0), lambda f, c: pipe)
    with running(gateway) as url:
        with httpx.Client(timeout=30) as client:
            body = chat(5000, stream=True)
            with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers={"traceparent": TRACE}) as response:
                lines = response.iter_lines()
                assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data:")) >= 3
                (flight,) = gateway.admission.flights.values()
                assert flight.request.client_metadata["traceparent"] == TRACE
                with pytest.raises(openai.RateLimitError, match="at capacity"):
                    openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0).chat.\
                        completions.create(**chat(2))  # type: ignore[call-overload]
                with pytest.raises(anthropic.OverloadedError) as over:
                    anthropic.Anthropic(base_url=url, api_key="-", max_retries=0).messages.\
                        create(**chat(2))  # type: ignore[call-overload]
                assert over.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        # the client is gone: the server cancels, and the engine frees the slot
        wait_for(lambda: flight.handle.cancel_requested)
        calls_when_cancelled = len(backend.calls)
        done = flight.handle.result(timeout=10)
        assert len(backend.calls) - calls_when_cancelled <= 1  # at most the step in progress
        assert done.finish_reason is FinishReason.CANCELLED and done.usage.completion_tokens < 5000
        assert pipe.engine is not None and pipe.engine.active_slots == 0
        assert backend.busy_slots == 0
        # no ghost generation keeps calling the model: the next request's forwards carry it
        # alone, and exactly what it feeds (its prompt past the cache, then its first token)
        settled = len(backend.calls)
        after = pipe.generate("next", max_tokens=2, temperature=0)
        forwards = backend.calls[settled:]
        assert all(len(sequences) == 1 for _, sequences in forwards), forwards
        fed = after.usage.prompt_tokens - after.usage.cached_tokens + 1
        assert sum(n for _, sequences in forwards for _, n in sequences) == fed, forwards
        wait_for(lambda: any(r.request_id == done.request_id
                             for r in read_records(tmp_path / "usage.sqlite3")))
        (record,) = [r for r in read_records(tmp_path / "usage.sqlite3")
                     if r.request_id == done.request_id]
        assert record.finish_reason == "cancelled"
        assert record.completion_tokens == done.usage.completion_tokens


class CountingTokenizer(HFTokenizer):
    """The embedded model's tokenizer, counting how often a prompt is encoded."""

    encodes = 0

    def encode(self, rendered: Rendered) -> TokenizedPrompt:
        CountingTokenizer.encodes += 1
        return super().encode(rendered)


def test_window_arithmetic_counts_exactly_only_near_the_limit(tmp_path: Path) -> None:
    tok = CountingTokenizer.from_dir(TINY_MODEL_DIR)
    pipe, _ = endless_model(tokenizer=tok)
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))

    def exact(text: str) -> int:
        return len(hf.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                          add_generation_prompt=True)["input_ids"])

    for clamp in (True, False):
        gateway = Gateway(config(tmp_path / str(clamp), max_context=4096, context_slack=96,
                                 clamp_max_tokens=clamp), lambda f, c: pipe)
        gateway.loader.load(wait=True)
        served = gateway.model("default")
        window = 4096 - 96
        before = CountingTokenizer.encodes
        small = gateway.window_fit.fit(served, Request.coerce("hello", generation_config={"max_tokens": 50}),
                            max_tokens_given=True).request
        assert CountingTokenizer.encodes == before  # the bound sufficed: no tokenization
        assert small.generation_config.max_tokens == 50
        text = "word " * 1500
        n = exact(text)
        asked = Request.coerce(text, generation_config={"max_tokens": 3000})
        if clamp:
            fitted = gateway.window_fit.fit(served, asked, max_tokens_given=True).request
            assert fitted.generation_config.max_tokens == window - n
            assert CountingTokenizer.encodes == before + 1
        else:
            with pytest.raises(ContextWindowError) as err:
                gateway.window_fit.fit(served, asked, max_tokens_given=True)
            assert (err.value.prompt_tokens, err.value.limit, err.value.requested) == (
                n, window - n, 3000)
        opened = Request(prompt="<|im_start|>assistant\n<think>\n")
        assert gateway.window_fit.fit(served, opened, max_tokens_given=False).thinking
        assert not gateway.window_fit.fit(served, Request(prompt="<think>x</think>"), max_tokens_given=False).thinking
        huge = "word " * 5000
        with pytest.raises(ContextWindowError,
                           match=f"prompt is too long: {exact(huge)} tokens > {window - 1} maximum"):
            gateway.window_fit.fit(served, Request.coerce(huge), max_tokens_given=False)
        gateway.close()


def test_a_request_is_rendered_once_and_tokenized_at_most_once(tmp_path: Path) -> None:
    # the gateway inspects the prepared request (its size, its think block, its exact count
    # near the window, the prompt size an Anthropic stream reports first) and submits that
    # same one: the template once, the tokenizer at most once (it rendered up to three
    # times and tokenized up to three times)
    tok = CountingTokenizer.from_dir(TINY_MODEL_DIR)
    pipe, _ = endless_model(tokenizer=tok)
    renderer = pipe.stages.renderer
    assert renderer is not None
    renders: list[int] = []
    render = renderer.render

    def counted(*args: object, **kwargs: object) -> Rendered:
        renders.append(1)
        return render(*args, **kwargs)  # type: ignore[arg-type]

    renderer.render = counted  # type: ignore[method-assign]
    gateway = Gateway(config(tmp_path, max_context=4096, context_slack=96), lambda f, c: pipe)
    long = "word " * 700  # its character bound and the budget overflow the window: counted
    with running(gateway) as url:
        oa = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        an = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
        for text, max_tokens in (("go", 3), (long, 600)):
            counted_now = max_tokens == 600
            for dialect, stream in (("openai", False), ("openai", True), ("anthropic", False),
                                    ("anthropic", True)):
                renders.clear()
                before = CountingTokenizer.encodes
                messages = [{"role": "user", "content": text}]
                if dialect == "openai":
                    got = oa.chat.completions.create(model="default", messages=messages,  # type: ignore[call-overload]
                                                     max_tokens=max_tokens, stream=stream)
                    if stream:
                        list(got)
                elif stream:
                    events = list(an.messages.create(model="default", messages=messages,  # type: ignore[call-overload]
                                                     max_tokens=max_tokens, stream=True))
                    start = events[0]
                    assert start.type == "message_start"
                    assert start.message.usage.input_tokens == len(pipe.tokenize(messages))
                    CountingTokenizer.encodes -= 1  # the oracle's own count
                else:
                    an.messages.create(model="default", messages=messages,  # type: ignore[call-overload]
                                       max_tokens=max_tokens)
                assert len(renders) == 1 + (dialect == "anthropic" and stream), \
                    (dialect, stream, len(renders))  # (+1: the oracle's tokenize above)
                assert CountingTokenizer.encodes - before == 1, (dialect, stream, counted_now)
    gateway.close()


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=200))
def test_the_character_class_bound_is_never_below_the_exact_count(text: str) -> None:
    assert len(_TOKENIZER.encode_text(text)) <= token_upper_bound(text)


def test_too_long_prompt_is_a_400_with_the_numbers_in_both_dialects(tmp_path: Path) -> None:
    pipe, _ = endless_model()
    gateway = Gateway(config(tmp_path, max_context=128), lambda f, c: pipe)
    long = "many words here " * 60
    with running(gateway) as url:
        oa = httpx.post(f"{url}/v1/chat/completions",
                        json={**chat(5), "messages": [{"role": "user", "content": long}]})
        an = httpx.post(f"{url}/v1/messages",
                        json={**chat(5), "messages": [{"role": "user", "content": long}]})
        bad_trace = httpx.post(f"{url}/v1/chat/completions", json=chat(2),
                               headers={"traceparent": "00-xyz-01"})
    n = pipe.count_tokens(long)
    assert oa.status_code == an.status_code == 400
    assert oa.json()["error"]["message"] == f"prompt is too long: {n} tokens > 127 maximum"
    assert oa.json()["error"]["prompt_tokens"] == n and oa.json()["error"]["limit"] == 127
    assert an.json()["type"] == "error" and an.json()["error"]["prompt_tokens"] == n
    assert bad_trace.status_code == 400 and bad_trace.json()["error"]["param"] == "traceparent"


def test_loading_is_a_503_and_health_follows(tmp_path: Path) -> None:
    release = threading.Event()
    pipe, _ = endless_model()

    def slow_builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
        release.wait(10)
        return pipe

    gateway = Gateway(config(tmp_path), slow_builder)
    with running(gateway, wait=False) as url:
        assert httpx.get(f"{url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0).chat.completions.\
                create(**chat(2))  # type: ignore[call-overload]
        assert err.value.status_code == 503 and "still loading" in str(err.value)
        release.set()
        wait_for(lambda: gateway.ready)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "models": {"default": "ready"}}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat(2)).status_code == 200


def test_metrics_tokenize_and_detokenize(tmp_path: Path) -> None:
    pipe, _ = endless_model()
    hf = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    with running(Gateway(config(tmp_path), lambda f, c: pipe)) as url:
        for _ in range(3):
            assert httpx.post(f"{url}/v1/chat/completions", json=chat(4)).status_code == 200
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat(6, True)) as r:
            pieces = sum(1 for line in r.iter_lines() if '"content": "a' in line)
        assert httpx.post(f"{url}/v1/chat/completions", json={"model": 3}).status_code == 400
        text = "Tokenize: naïve ✓ <|im_end|>"
        tokens = httpx.post(f"{url}/tokenize", json={"model": "default", "prompt": text}).json()
        assert tokens["tokens"] == hf.encode(text, add_special_tokens=False, split_special_tokens=True)
        back = httpx.post(f"{url}/detokenize", json={"model": "default", "tokens": tokens["tokens"]})
        assert back.json()["prompt"] == text
        convo = [{"role": "user", "content": "hi"}]
        for add in (True, False):
            got = httpx.post(f"{url}/tokenize", json={"model": "default", "messages": convo,
                                                      "add_generation_prompt": add}).json()
            want = hf.apply_chat_template(convo, tokenize=True, add_generation_prompt=add)
            assert got["tokens"] == list(want["input_ids"])
        bad = httpx.post(f"{url}/detokenize", json={"model": "default", "tokens": [1, 99999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
        scrape = httpx.get(f"{url}/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(scrape) for s in family.samples}
    ok = (("endpoint", "chat.completions"), ("model", "default"), ("status", "200"))
    assert samples[("pipeline_requests_total", ok)] == 4
    # a request that named no served model counts under "other" (labels are a bounded set)
    assert samples[("pipeline_requests_total", (("endpoint", "chat.completions"),
                                                ("model", "other"), ("status", "400")))] == 1
    assert samples[("pipeline_tokens_total", (("kind", "completion"), ("model", "default")))] == 18
    # one observation between consecutive streamed deltas (deltas may carry several tokens)
    assert samples[("pipeline_inter_token_seconds_count", (("model", "default"),))] == pieces - 1
    assert samples[("pipeline_time_to_first_token_seconds_count", (("model", "default"),))] == 4
    assert samples[("pipeline_active_slots", (("model", "default"),))] == 0


def test_a_non_stream_client_that_leaves_cancels_its_request(tmp_path: Path) -> None:
    pipe, backend = endless_model(delay_s=0.01, num_slots=2)
    gateway = Gateway(config(tmp_path), lambda f, c: pipe)
    with running(gateway) as url:
        with pytest.raises(httpx.ReadTimeout):
            # long enough that a slow engine start (a fresh 2-core CI run) still yields tokens
            httpx.post(f"{url}/v1/chat/completions", json=chat(5000), timeout=2.0)
        wait_for(lambda: not gateway.admission.flights)
        assert pipe.engine is not None and pipe.engine.active_slots == 0
        assert backend.busy_slots == 0
        wait_for(lambda: len(read_records(tmp_path / "usage.sqlite3")) == 1)
    (record,) = read_records(tmp_path / "usage.sqlite3")
    assert record.finish_reason == "cancelled" and 0 < record.completion_tokens < 5000


def test_api_keys_come_from_the_environment_and_a_file(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-file-1\n\n  sk-file-2  # rotated 2026\n")
    monkeypatch.setenv("TEST_KEYS", "sk-env-1, sk-env-2,")
    assert load_api_keys("TEST_KEYS", keys) == {"sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"}
    gateway = Gateway(config(tmp_path, api_keys=load_api_keys("TEST_KEYS")),
                      lambda f, c: endless_model()[0])
    gateway.keys.authenticate("Bearer sk-env-2", None)
    gateway.keys.authenticate(None, "sk-env-1")
    for authorization, key in (("Bearer sk-file-1", None), ("Basic sk-env-1", None),
                               (None, None), (None, "sk-env-1x")):
        with pytest.raises(AuthenticationError):
            gateway.keys.authenticate(authorization, key)
    gateway.close()


def test_a_failing_backend_is_a_500_in_the_dialect_shape(tmp_path: Path) -> None:
    vocab = _TOKENIZER.vocab_size
    backend = ScriptedBackend(vocab, peaked(vocab, lambda ids: 5), fail=lambda ids: True)
    pipe = build(TINY_MODEL_DIR, backend=backend)
    with running(Gateway(config(tmp_path), lambda f, c: pipe)) as url:
        with pytest.raises(openai.InternalServerError) as err:
            openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0).chat.completions.\
                create(**chat(3))  # type: ignore[call-overload]
        assert err.value.status_code == 500
        assert err.value.body["type"] == "server_error"  # type: ignore[index]
        with httpx.stream("POST", f"{url}/v1/messages", json=chat(3, True)) as r:
            lines = list(r.iter_lines())
        assert r.status_code == 200 and "event: error" in lines
        error = json.loads(lines[lines.index("event: error") + 1].removeprefix("data: "))
        assert error["type"] == "error" and error["error"]["type"] == "api_error"
        assert httpx.get(f"{url}/health").status_code == 200


def test_one_model_and_json_404_405_bodies_in_each_dialect(tmp_path: Path) -> None:
    pipe, _ = endless_model()
    with running(Gateway(config(tmp_path), lambda f, c: pipe)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        assert client.models.retrieve("default").id == "default"  # the SDK's own parser
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve("nope")
        assert missing.value.body["served_models"] == ["default"]  # type: ignore[index]
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405),
                                     ("POST", "/v1/messages/nope", 404),
                                     ("DELETE", "/v1/messages", 405)):
            r = httpx.request(method, f"{url}{path}")
            assert r.status_code == status and r.headers["content-type"] == "application/json"
            body = r.json()
            if path.startswith("/v1/messages"):
                assert body["type"] == "error" and body["error"]["message"]
            else:
                assert body["error"]["code"] in ("not_found", "method_not_allowed")
        r = httpx.request("PUT", f"{url}/v1/models")
        assert r.status_code == 405 and "GET" in r.headers.get("allow", "")
