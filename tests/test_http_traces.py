"""``GET /traces/{request_id}``: a finished request's traces as JSONL, for the key that made it.

Oracles: the invariant checker of :mod:`pipeline.trace` (a trace fetched over HTTP must pass
it), what the client itself received (the streamed text's digest and the usage the SDK
parsed must be what the trace recorded), and a library-side count of the prompt's tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from transports import cli
from pipeline.builder import build
from pipeline.errors import InvalidValueError
from transports.http.serving_errors import TraceNotFoundError
from pipeline.events import MINIMAL_TIMELINE, Event, JsonlSink, digest_text, read_jsonl
from pipeline.pipe import Pipeline
from pipeline.trace import Trace, check, load_all
from tests.http_support import config, endless_model, running
from transports.http import Gateway, ServerConfig
from transports.http.accounting.traces import TraceStore, encode, key_fingerprint

KEY_A, KEY_B = "sk-trace-a", "sk-trace-b"
QUESTION = [{"role": "user", "content": "What is a trace?"}]


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    if folder is not None and folder.name == "endless":
        return endless_model(delay_s=0.005)[0]
    return build("tiny", options={"num_slots": cfg.num_slots})


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    cfg = config(tmp_path_factory.mktemp("traces"), api_keys={KEY_A, KEY_B}, keep_traces=3,
                 models={"default": None, "endless": Path("endless")})
    with running(Gateway(cfg, builder)) as url:
        yield url


def events_of(body: str) -> list[Event]:
    lines = body.splitlines()
    assert lines and all(line.strip() for line in lines), "one JSON event per line"
    return [Event.from_json(json.loads(line)) for line in lines]


def fetch(base_url: str, request_id: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{base_url}/traces/{request_id}", headers=headers)


def test_a_streamed_answers_trace_is_what_the_client_received(base_url: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_A, max_retries=0)
    raw = oai.chat.completions.with_raw_response.create(
        model="default", messages=QUESTION, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    header_id = raw.headers["x-request-id"]
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and {c.id for c in chunks} == {header_id}

    answer = fetch(base_url, header_id, KEY_A)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/x-ndjson"
    events = events_of(answer.text)
    assert {e.trace_id for e in events} == {header_id}
    assert set(MINIMAL_TIMELINE) <= {e.event_type for e in events}
    assert check(events).ok
    payload = {e.event_type: e.payload for e in events}
    assert payload["generation.finished"]["completion_tokens"] == usage.completion_tokens
    assert payload["generation.finished"]["text_digest"] == digest_text(text)
    with build("tiny") as pipe:
        assert payload["input.tokenized"]["tokens"] == pipe.count_tokens(QUESTION)
        assert usage.prompt_tokens == pipe.count_tokens(QUESTION)


def test_only_a_key_that_made_the_request_reads_its_trace(base_url: str) -> None:
    made = httpx.post(f"{base_url}/v1/messages", headers={"x-api-key": KEY_A}, json={
        "model": "default", "max_tokens": 4, "messages": QUESTION})
    assert made.status_code == 200
    request_id = made.headers["x-request-id"]
    assert made.json()["id"] == request_id
    assert fetch(base_url, request_id, KEY_A).status_code == 200
    other = fetch(base_url, request_id, KEY_B)
    unknown = fetch(base_url, "chatcmpl-000000000000000000000000", KEY_A)
    for refused in (other, unknown):  # another key's trace looks exactly like no trace
        assert refused.status_code == 404
        assert refused.json()["error"]["code"] == "trace_not_found"
        assert refused.json()["error"]["param"] == "request_id"
    assert other.json()["error"]["message"].replace(request_id, "X") == \
        unknown.json()["error"]["message"].replace("chatcmpl-000000000000000000000000", "X")
    assert fetch(base_url, request_id, None).status_code == 401
    assert fetch(base_url, request_id, "sk-wrong").status_code == 401


def test_only_the_last_n_traces_are_kept(base_url: str) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_B, max_retries=0)
    ids = [oai.chat.completions.create(model="default", messages=QUESTION, max_tokens=2).id
           for _ in range(4)]  # keep_traces=3
    assert fetch(base_url, ids[0], KEY_B).status_code == 404
    assert [fetch(base_url, i, KEY_B).status_code for i in ids[1:]] == [200, 200, 200]


def test_a_cancelled_streams_trace_records_the_cancellation(base_url: str) -> None:
    body = {"model": "endless", "messages": QUESTION, "max_tokens": 5000, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY_A}"}) as response:
        request_id = response.headers["x-request-id"]
        next(response.iter_lines())
    deadline = time.monotonic() + 10
    while (answer := fetch(base_url, request_id, KEY_A)).status_code == 404:
        assert time.monotonic() < deadline, "the cancelled request's trace never appeared"
        time.sleep(0.05)
    finished = [e for e in events_of(answer.text) if e.event_type == "generation.finished"]
    assert [e.payload["reason"] for e in finished] == ["cancelled"]


def traces_of(body: bytes, tmp_path: Path) -> list[Trace]:
    """A fetched JSONL body as ``pipeline trace`` reads a file: its traces by trace id."""
    path = tmp_path / "fetched.jsonl"
    path.write_bytes(body)
    return load_all(path)


def test_every_choice_of_a_request_is_traced_under_its_id(
        base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_A, max_retries=0)
    raw = oai.chat.completions.with_raw_response.create(
        model="default", messages=QUESTION, max_tokens=6, temperature=0.9, seed=3, n=3)
    request_id = raw.headers["x-request-id"]
    answer = raw.parse()
    assert answer.id == request_id and answer.usage is not None
    whole = fetch(base_url, request_id, KEY_A)
    assert whole.status_code == 200
    traces = traces_of(whole.content, tmp_path)
    choice_ids = [f"{request_id}-{k}" for k in range(3)]
    assert [t.trace_id for t in traces] == choice_ids  # one after the other, in choice order
    for k, (trace, choice) in enumerate(zip(traces, answer.choices, strict=True)):
        assert check(trace).ok
        assert trace.payload("request.normalized")["seed"] == 3 + k  # the seed rule
        finished = trace.payload("generation.finished")
        assert finished["text_digest"] == digest_text(choice.message.content or "")
        alone = fetch(base_url, choice_ids[k], KEY_A)
        assert alone.status_code == 200 and events_of(alone.text) == list(trace.events)
    assert sum(t.payload("generation.finished")["completion_tokens"] for t in traces) == \
        answer.usage.completion_tokens
    for refused in (request_id, choice_ids[1]):
        assert fetch(base_url, refused, KEY_B).status_code == 404
    # the file as docs/serving.md says `pipeline trace` reads it
    path = str(tmp_path / "fetched.jsonl")
    assert cli.main(["trace", "check", path]) == 0
    capsys.readouterr()
    assert cli.main(["trace", "diff", path, path, "--json", "--trace-id-a", choice_ids[0],
                     "--trace-id-b", choice_ids[1]]) == 1  # seeds 3 and 4: they differ
    assert json.loads(capsys.readouterr().out)["divergence"] is not None


def test_text_completions_are_traced_for_their_key(base_url: str, tmp_path: Path) -> None:
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY_B, max_retries=0)
    single = oai.completions.with_raw_response.create(
        model="default", prompt="Once upon a time", max_tokens=5, temperature=0)
    request_id = single.headers["x-request-id"]
    body = single.parse()
    assert body.id == request_id
    events = events_of(fetch(base_url, request_id, KEY_B).text)
    assert {e.trace_id for e in events} == {request_id} and check(events).ok
    finished = next(e for e in events if e.event_type == "generation.finished")
    assert finished.payload["text_digest"] == digest_text(body.choices[0].text)
    assert fetch(base_url, request_id, KEY_A).status_code == 404

    prompts = ["Once upon a time", "The sky is"]
    raw = oai.completions.with_raw_response.create(
        model="default", prompt=prompts, n=2, max_tokens=5, temperature=0.8, seed=5,
        stream=True, stream_options={"include_usage": True})
    request_id = raw.headers["x-request-id"]
    texts = ["", "", "", ""]
    chunks = list(raw.parse())
    for chunk in chunks:
        assert chunk.id == request_id
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    usage = chunks[-1].usage
    assert usage is not None
    traces = traces_of(fetch(base_url, request_id, KEY_B).content, tmp_path)
    assert [t.trace_id for t in traces] == [f"{request_id}-{k}" for k in range(4)]
    for trace, text in zip(traces, texts, strict=True):
        assert check(trace).ok
        assert trace.payload("generation.finished")["text_digest"] == digest_text(text)
    assert sum(t.payload("generation.finished")["completion_tokens"] for t in traces) == \
        usage.completion_tokens
    with build("tiny") as pipe:  # each prompt counted once: the first choice of every two
        assert [traces[k].payload("input.tokenized")["tokens"] for k in (0, 2)] == [
            len(pipe.stages.tokenizer.encode_document(p))  # type: ignore[union-attr]
            for p in prompts]
    assert usage.prompt_tokens == sum(
        traces[k].payload("input.tokenized")["tokens"] for k in (0, 2))


def test_without_keys_anyone_reads_traces_and_keep_traces_0_keeps_none(tmp_path: Path) -> None:
    for keep, expected in ((5, 200), (0, 404)):
        cfg = config(tmp_path / str(keep), keep_traces=keep)
        with running(Gateway(cfg, builder)) as url:
            made = httpx.post(f"{url}/v1/chat/completions", json={
                "model": "default", "messages": QUESTION, "max_tokens": 2})
            answer = fetch(url, made.headers["x-request-id"], None)
            assert answer.status_code == expected
            if not keep:
                assert "keeps no traces" in answer.json()["error"]["message"]
    with pytest.raises(InvalidValueError, match="keep_traces"):
        config(tmp_path, keep_traces=-1)


def test_the_store_packs_traces_without_changing_them(tmp_path: Path) -> None:
    with build("tiny", sinks=[JsonlSink(tmp_path / "sink.jsonl")]) as pipe:
        done = [pipe.generate(QUESTION, max_tokens=n, temperature=0) for n in (3, 5, 7)]
    store = TraceStore(2)
    owner = frozenset({key_fingerprint(KEY_A)})
    fresh = []
    for completion in done:
        store.add(completion.request_id, owner, completion.trace)
        fresh.append(store.jsonl(completion.request_id, owner))  # readable at once
    store.close()  # the compactor has packed every pending trace
    assert len(store) == 2
    with pytest.raises(TraceNotFoundError):
        store.jsonl(done[0].request_id, owner)
    with pytest.raises(TraceNotFoundError):
        store.jsonl(done[2].request_id, frozenset({key_fingerprint(KEY_B)}))
    for completion, before in zip(done[1:], fresh[1:]):
        after = store.jsonl(completion.request_id, owner)
        assert after == before == encode(completion.trace)
        by_sink = [e for e in read_jsonl(tmp_path / "sink.jsonl")
                   if e.trace_id == completion.request_id]
        assert events_of(after.decode()) == by_sink


def test_the_store_keeps_a_requests_choices_as_one_request() -> None:
    with build("tiny") as pipe:
        done = [pipe.generate(QUESTION, max_tokens=n, temperature=0) for n in (2, 3, 4, 5, 6)]
    store = TraceStore(2)
    owner = frozenset({key_fingerprint(KEY_A)})
    choices = done[:3]
    store.add_choices("cmpl-x", owner, [(c.request_id, c.trace) for c in choices])
    store.add(done[3].request_id, owner, done[3].trace)  # two requests: both kept
    for _ in ("as events", "packed"):
        assert store.jsonl("cmpl-x", owner) == b"".join(encode(c.trace) for c in choices)
        for c in choices:
            assert store.jsonl(c.request_id, owner) == encode(c.trace)
            with pytest.raises(TraceNotFoundError):
                store.jsonl(c.request_id, frozenset({key_fingerprint(KEY_B)}))
        store.close()  # the compactor has packed every pending trace
    assert len(store) == 2
    store.add(done[4].request_id, owner, done[4].trace)  # the oldest request goes, whole
    assert len(store) == 2
    for gone in ("cmpl-x", *(c.request_id for c in choices)):
        with pytest.raises(TraceNotFoundError):
            store.jsonl(gone, owner)
    assert store.jsonl(done[4].request_id, owner) == encode(done[4].trace)


def test_pipeline_serve_takes_keep_traces(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import transports.http
    from transports import cli

    served: list[ServerConfig] = []
    monkeypatch.setattr(transports.http, "serve", lambda c, *args: served.append(c))
    # serve's logging would stay installed on this test's captured (soon closed) stderr
    monkeypatch.setattr("transports.http.accounting.logs.configure", lambda *args, **kwargs: None)
    assert cli.main(["serve", "--model", "tiny", "--keep-traces", "7"]) == 0
    assert [c.keep_traces for c in served] == [7]
    assert cli.main(["serve", "--model", "tiny", "--keep-traces", "-1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("pipeline serve: ") and "keep_traces" in error[-1]
