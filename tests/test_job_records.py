"""A request's records in the engine: the spec's exact round trip (JSON and pickle) for
requests with every kind of field set, a spec read back running the same generation, and the
text state's release rule against an independent stop-string oracle."""

from __future__ import annotations

import json
import math
import pickle
import random
import time
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from pipeline import build
from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.events import Tracer, digest_ids
from pipeline.grammar import Grammar
from pipeline.engine.handle import RequestHandle
from pipeline.engine.job import Job
from pipeline.engine.job_spec import JobSpec
from pipeline.contracts.text import StopContext
from pipeline.testing import ByteDetokenizer, ByteTokenizer
from pipeline.engine.text_state import TextState
from pipeline.contracts.output import FinishReason, TokenLogprob
from pipeline.contracts.request import (
    GenerationConfig, Message, Recording, Request, RuntimeLimits, ToolCall, ToolChoice, ToolSpec,
)
from pipeline.contracts.text import TokenizedPrompt
from stages.stop import EosStopper, MaxTokensStopper, StopStringStopper

FULL_CONFIG = GenerationConfig(
    max_tokens=40, temperature=0.1 + 0.2, top_k=7, top_p=0.9, min_p=0.05, typical_p=0.95,
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.25, dry_multiplier=0.5,
    dry_base=2.0, dry_allowed_length=3,
    logit_bias={5: 2.5, 17: -100.0}, stop=("\n\n", "END"), stop_token_ids=(3, 4),
    min_tokens=2, ignore_eos=True, seed=2**62 + 1, logprobs=True, top_logprobs=3,
    banned_token_ids=(9,), allowed_token_ids=(5, 6, 7, 8), processor_order=("temperature",),
    reasoning_budget_tokens=12, forced_prefix=(6, 7))
LIMITS = RuntimeLimits(deadline_s=12.5, queue_timeout_s=1e-3, max_context_tokens=4096)
MESSAGES = (
    Message("system", "be brief", name="rules"),
    Message("user", "héllo 🌍"),
    Message("assistant", None, tool_calls=(ToolCall("add", '{"a": 1}', id="call-1"),),
            reasoning_content="think first"),
    Message("tool", "2", tool_call_id="call-1"),
)
TOOL = ToolSpec("add", "adds", {"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]})


def specimens() -> list[JobSpec]:
    """Specs whose requests between them set every field (the three prompt forms exclude
    one another), with digests filled as the pipeline fills them."""
    chat = Request(messages=MESSAGES, request_id="req-chat", generation_config=FULL_CONFIG,
                   runtime_limits=LIMITS, tool_catalog=(TOOL,),
                   tool_choice=ToolChoice("tool", TOOL.name, parallel=False, strict=True),
                   template_kwargs={"enable_thinking": False, "extra": [1, {"k": None}]},
                   client_metadata={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
                   model_snapshot="sha256:m", template_version="sha256:t",
                   tokenizer_version="sha256:k", recording=Recording.FULL)
    text = Request(prompt="once upon", request_id="req-text",
                   generation_config=GenerationConfig(
                       temperature=0, stop="x", grammar=Grammar.json_schema(
                           {"type": "object", "properties": {"a": {"type": "integer"}}})))
    ids = Request(prompt_ids=(1, 2, 3), request_id="req-ids",
                  runtime_limits=RuntimeLimits(deadline_s=1.0), recording=Recording.TAPS,
                  tap_tensors="2:0-3")
    prompt = TokenizedPrompt((11, 12, 13, 14), "sha256:tok", "sha256:text", (0, 1, 5, 6))
    return [
        JobSpec(chat, prompt, 2**63 - 1, frozenset({2, 0, 99}), time.monotonic_ns(), 7, (40, 41),
                True),
        JobSpec(text, TokenizedPrompt((1,), "a", "b"), 0, frozenset(), 1),
        JobSpec(ids, TokenizedPrompt((1, 2, 3), "a", "b"), 5, frozenset({2}), 2**40, None, None),
    ]


def non_default(record: Any, name: str) -> bool:
    field = attrs.fields_dict(type(record))[name]
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = (default.factory(record) if default.takes_self  # type: ignore[call-arg]
                   else default.factory())  # type: ignore[call-arg]
    value = getattr(record, name)
    if default is attrs.NOTHING:
        return True
    return bool(value != default) and not (isinstance(value, float) and math.isnan(value))


def test_the_specimens_set_every_field_of_every_record_they_hold() -> None:
    """If a record gains a field, this test asks for a specimen that sets it."""
    specs = specimens()
    requests = [s.request for s in specs]
    records: list[tuple[type, list[Any]]] = [
        (JobSpec, specs), (Request, requests), (TokenizedPrompt, [s.prompt for s in specs]),
        (GenerationConfig, [r.generation_config for r in requests]),
        (RuntimeLimits, [r.runtime_limits for r in requests]),
        (Message, [m for r in requests for m in r.messages]),
        (ToolCall, [c for r in requests for m in r.messages for c in m.tool_calls]),
        (ToolSpec, [t for r in requests for t in r.tool_catalog]),
        (ToolChoice, [r.tool_choice for r in requests]),
    ]
    for cls, values in records:
        for field in attrs.fields(cls):
            if field.name == "schema_version":
                continue  # a constant: the round trip below still carries it
            assert any(non_default(v, field.name) for v in values), \
                f"no specimen sets {cls.__name__}.{field.name}"


def assert_same(a: JobSpec, b: JobSpec) -> None:
    """Equal field by field, the fields attrs leaves out of ``==`` (mappings) included, with
    the same types (token-id keys stay ints, floats bit for bit)."""
    assert a == b
    for x, y in zip(a.request.messages, b.request.messages):
        assert x == y
    ca, cb = a.request.generation_config, b.request.generation_config
    assert dict(ca.logit_bias) == dict(cb.logit_bias)
    assert all(type(k) is int for k in cb.logit_bias)
    assert (type(ca.temperature), float(ca.temperature).hex()) == (
        type(cb.temperature), float(cb.temperature).hex())
    assert dict(a.request.template_kwargs) == dict(b.request.template_kwargs)
    assert dict(a.request.client_metadata) == dict(b.request.client_metadata)
    for ta, tb in zip(a.request.tool_catalog, b.request.tool_catalog):
        assert (ta, dict(ta.parameters)) == (tb, dict(tb.parameters))
    assert type(b.eos_token_ids) is frozenset and type(b.prompt.input_ids) is tuple


@pytest.mark.parametrize("spec", specimens(), ids=lambda s: s.request.request_id)
def test_a_spec_round_trips_exactly_through_json(spec: JobSpec) -> None:
    data = spec.to_dict()
    text = json.dumps(data, allow_nan=False)
    assert json.loads(text) == data  # JSON-shaped: nothing JSON would change
    back = JobSpec.from_dict(json.loads(text))
    assert_same(spec, back)
    assert json.dumps(back.to_dict(), allow_nan=False) == text


@pytest.mark.parametrize("spec", specimens(), ids=lambda s: s.request.request_id)
def test_a_spec_round_trips_exactly_through_pickle(spec: JobSpec) -> None:
    assert_same(spec, pickle.loads(pickle.dumps(spec)))


def test_a_spec_holds_plain_data_only() -> None:
    data = specimens()[0].to_dict()
    stack: list[Any] = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            assert all(type(k) is str for k in item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        else:
            assert item is None or type(item) in (str, int, float, bool), repr(item)
    assert set(data) == {"request", "prompt", "seed", "eos_token_ids", "accepted_ns",
                         "last_event", "think_markers", "thinking"}


def test_reading_a_spec_refuses_bad_data_naming_the_problem() -> None:
    data = specimens()[1].to_dict()
    with pytest.raises(UnknownFieldError, match="detokenizer"):
        JobSpec.from_dict({**data, "detokenizer": "bytes"})
    with pytest.raises(InvalidValueError, match="missing field 'seed'"):
        JobSpec.from_dict({k: v for k, v in data.items() if k != "seed"})
    with pytest.raises(InvalidValueError, match="eos_token_ids"):
        JobSpec.from_dict({**data, "eos_token_ids": [1, -2]})
    with pytest.raises(InvalidValueError, match="think_markers"):
        JobSpec.from_dict({**data, "think_markers": [1]})
    with pytest.raises(InvalidValueError, match="request"):
        JobSpec.from_dict({**data, "request": "hi"})
    with pytest.raises(UnknownFieldError, match="temprature"):
        JobSpec.from_dict({**data, "request": {**data["request"], "generation_config": {
            "temprature": 1.0}}})
    with pytest.raises(InvalidValueError, match="seed"):
        JobSpec.from_dict({**data, "seed": True})


def run_spec(pipe: Any, spec: JobSpec) -> Any:
    """Run ``spec`` on ``pipe``'s engine, with text stages made here (as an engine in
    another process would make its own)."""
    engine, stages = pipe.engine, pipe.stages
    text = TextState(spec, stages.detokenizer, stages.stoppers, stages.tokenizer.token_bytes)
    handle = RequestHandle(spec.request.request_id, engine.wake)
    engine.submit(Job(spec, text, Tracer(spec.request.request_id), handle))
    return handle.result()


def test_a_spec_read_back_generates_what_the_pipeline_generates() -> None:
    """A sampled request (seeded, with stop strings, a bias and logprobs) run through the
    pipeline, and its spec written to JSON, pickled and read back, give the same tokens,
    text and logprobs."""
    with build("tiny") as pipe:
        tokenizer = pipe.stages.tokenizer
        ids = tuple(tokenizer.encode_text("Once upon a time"))
        config = GenerationConfig(max_tokens=24, temperature=0.9, seed=1234, logprobs=True,
                                  top_logprobs=2, stop=("\n\n",), logit_bias={ids[0]: 1.5})
        request = Request(prompt_ids=ids, request_id="req-spec", generation_config=config,
                          runtime_limits=RuntimeLimits(deadline_s=600.0))
        expected = pipe.generate(request)
        prompt = TokenizedPrompt(ids, tokenizer.digest, digest_ids(ids))
        spec = JobSpec(request, prompt, 1234, tokenizer.eos_token_ids, time.monotonic_ns())
        back = pickle.loads(pickle.dumps(JobSpec.from_dict(json.loads(json.dumps(
            spec.to_dict())))))
        done = run_spec(pipe, back)
    assert len(expected.token_ids) > 1
    assert done.token_ids == expected.token_ids
    assert done.text == expected.text and done.finish_reason is expected.finish_reason
    assert done.logprobs == expected.logprobs


# --- text state --------------------------------------------------------------------------


def first_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """Oracle: the text before the stop string that ends first (and whether one did)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[:end - max(len(s) for s in ending)], True
    return text, False


def text_state(stops: Sequence[str], max_tokens: int = 1000) -> TextState:
    request = Request(prompt="x", generation_config=GenerationConfig(
        stop=tuple(stops), max_tokens=max_tokens, logprobs=True))
    spec = JobSpec(request, TokenizedPrompt((120,), "t", "r"), 0, frozenset({256}), 0)
    return TextState(spec, ByteDetokenizer(), (EosStopper(), MaxTokensStopper(),
                                               StopStringStopper()),
                     ByteTokenizer().token_bytes)


def feed(state: TextState, tokens: Sequence[int]) -> tuple[list[Any], FinishReason | None]:
    deltas = []
    for step, token in enumerate(tokens, 1):
        verdict = state.check_token(token, step)
        released, verdict = state.commit(token, TokenLogprob(token, -1.0), verdict)
        if released or verdict is not None:
            deltas.append(state.delta(released, verdict.reason if verdict else None))
        if verdict is not None:
            return deltas, verdict.reason
    return deltas, None


@pytest.mark.parametrize("seed", range(40))
def test_text_state_releases_what_the_stop_oracle_says(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("abé🌍 ") for _ in range(rng.randrange(1, 30)))
    stops = ["".join(rng.choice("abé ") for _ in range(rng.randrange(1, 4)))
             for _ in range(rng.randrange(1, 3))]
    state = text_state(stops)
    deltas, reason = feed(state, list(text.encode()))
    before, stopped = first_stop(text, stops)
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert state.emitted == "".join(d.text for d in deltas)
    if stopped:
        assert reason is FinishReason.STOP_STRING and state.emitted == before
    else:  # nothing ended it: what is out is a prefix, the rest a possible stop's start
        assert reason is None and text.startswith(state.emitted)
        held = text[len(state.emitted):]
        assert not held or any(s.startswith(held[-k:]) for s in stops
                               for k in range(1, len(held) + 1))
    sent = [t for d in deltas for t in d.token_ids] + state.unsent_ids
    assert bytes(sent) == text.encode()[:len(sent)]
    assert [lp.token_bytes for d in deltas for lp in d.logprobs] == [bytes([t]) for d in deltas
                                                                    for t in d.token_ids]


def test_text_state_drops_the_eos_text_and_keeps_the_last_token_at_max_tokens() -> None:
    state = text_state([])
    deltas, reason = feed(state, [*b"hi", 256])
    assert reason is FinishReason.EOS and state.emitted == "hi"
    assert deltas[-1].token_ids == (256,) and deltas[-1].final
    state = text_state([], max_tokens=3)
    deltas, reason = feed(state, list("hé".encode()))  # 3 bytes: the 3rd ends it
    assert reason is FinishReason.LENGTH and state.emitted == "hé"


def test_text_state_starts_its_stages_from_the_spec() -> None:
    """The stoppers see the spec's request and ids (an EOS from the spec stops)."""
    request = Request(prompt="x")
    spec = JobSpec(request, TokenizedPrompt((1,), "t", "r"), 0, frozenset({7}), 123)
    seen: list[StopContext] = []

    class Recorder(EosStopper):
        def start(self, request: Request, context: StopContext) -> Any:
            seen.append(context)
            return super().start(request, context)

    state = TextState(spec, ByteDetokenizer(), (Recorder(),))
    assert seen == [StopContext(frozenset({7}), 123)]
    assert state.check_token(7, 1) is not None and state.check_token(8, 1) is None
