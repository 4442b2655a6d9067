"""`pipeline.trace.check`: real traces of the default model pass every invariant, and each
corruption a docs/design.md §8 invariant forbids is reported as exactly that invariant."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pipeline import EngineConfig, GenerationConfig, build
from pipeline.events import Event, digest_text
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_logits
from pipeline.errors import InvariantViolation
from pipeline.trace import CheckingSink, check
from trace_runs import QUESTION, append, edit, is_, set_text


@pytest.fixture(scope="module")
def pipe():
    # Small prefill chunks so the prompt is written in several pieces (invariant 2).
    # Neutral defaults: the tests name each processor they turn on (not the model's own).
    with build("tiny", engine=EngineConfig(max_prefill_chunk=8),
               defaults=GenerationConfig()) as p:
        yield p


@pytest.fixture(scope="module")
def decode(pipe):
    return lambda ids: pipe.stages.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def greedy(pipe) -> tuple[Event, ...]:
    return pipe.generate(QUESTION, max_tokens=10, temperature=0, ignore_eos=True,
                         recording="full").trace


@pytest.fixture(scope="module")
def sampled(pipe) -> tuple[Event, ...]:
    return pipe.generate(QUESTION, max_tokens=8, temperature=0.7, top_p=0.9, seed=5,
                         recording="full").trace


def violated(events: Sequence[Event], decode=None) -> set[int]:
    return set(check(list(events), detokenize=decode).violated)


def test_real_traces_hold_every_invariant(pipe, decode, greedy, sampled) -> None:
    for trace in (greedy, sampled):
        report = check(list(trace), detokenize=decode)
        assert report.ok, report.render()
    notes = dict(check(list(greedy)).notes)  # it says what the trace did not let it see
    assert 2 not in notes and "no tool calls" in notes[7]  # the torch backend reports layers
    layers = next(e for e in greedy if e.event_type == "decode.completed").payload["layers"]
    assert len(layers["k"]) == len(layers["v"]) > 1
    assert "no tokenizer" in notes[5]
    chunks = [e for e in greedy if e.event_type == "prefill.chunk"]
    assert len(chunks) >= 2  # the prompt really was prefilled in pieces
    stopped = pipe.generate(QUESTION, max_tokens=30, temperature=0, stop=["e"], recording="full")
    assert stopped.finish_reason.value == "stop_string"
    assert check(stopped, detokenize=decode).ok


def test_0_a_trace_without_its_release_is_malformed(greedy) -> None:
    events = [e for e in greedy if e.event_type != "resources.released"]
    assert violated(events) == {0}


def test_1_ids_from_another_tokenizer_are_reported(greedy) -> None:
    events = edit(greedy, is_("input.tokenized"),
                  lambda p: p.update(tokenizer_digest="sha256:" + "0" * 64))
    assert violated(events) == {1}


def test_1_ids_tokenized_from_other_bytes_are_reported(greedy) -> None:
    events = edit(greedy, is_("input.tokenized"),
                  lambda p: p.update(rendered_digest="sha256:" + "1" * 64))
    assert violated(events) == {1}


def test_2_a_gap_in_the_prefilled_positions_is_reported(greedy) -> None:
    events = edit(greedy, is_("prefill.chunk"), lambda p: p.update(start=p["start"] + 1))
    assert violated(events) == {2}


def test_2_layers_whose_values_lag_their_keys_are_reported() -> None:
    backend = ScriptedBackend(ByteTokenizer.VOCAB, hashed_logits(ByteTokenizer.VOCAB), layers=3)
    with build_scripted(backend) as scripted:
        trace = scripted.generate("abc", max_tokens=4, temperature=0).trace
    assert check(list(trace)).ok
    events = edit(trace, is_("decode.completed", 2),
                  lambda p: p["layers"]["v"].__setitem__(1, p["cache_len"] - 1))
    assert violated(events) == {2}


def test_2_a_real_layer_whose_values_lag_is_reported(greedy) -> None:
    events = edit(greedy, is_("decode.completed", 2),
                  lambda p: p["layers"]["v"].__setitem__(1, p["cache_len"] - 1))
    assert violated(events) == {2}


def test_3_a_cache_of_m_plus_1_after_prefill_is_reported(greedy) -> None:
    def one_more(p: dict) -> None:  # every layer too, as a backend that really wrote m+1 would
        p.update(cache_len=p["cache_len"] + 1,
                 layers={kv: [n + 1 for n in ns] for kv, ns in p["layers"].items()})

    events = edit(greedy, is_("prefill.completed"), one_more)
    report = check(events)
    assert report.violated == {3}
    assert "right after prefill" in report.render()


def test_3_a_decode_that_writes_another_token_is_reported(greedy) -> None:
    events = edit(greedy, is_("decode.completed", 3), lambda p: p.update(token_id=p["token_id"] + 1))
    assert violated(events) == {3}


def test_4_a_processor_order_other_than_declared_is_reported(sampled) -> None:
    configured = next(e for e in sampled if e.event_type == "selection.configured")
    assert configured.payload["processors"] == ["temperature", "top_p"]
    events = edit(sampled, is_("selection.configured"),
                  lambda p: p.update(processors=["top_p", "temperature"]))
    report = check(events)
    assert report.violated == {4}
    assert "['top_p', 'temperature']" in report.render()


def test_5_streamed_bytes_that_are_not_a_prefix_are_reported(greedy, decode) -> None:
    delta = next(e for e in greedy if e.event_type == "stream.delta" and e.payload["step"] == 3)
    changed = delta.payload["text"][:-1] + ("x" if delta.payload["text"][-1] != "x" else "y")
    events = edit(greedy, is_("stream.delta", 3), lambda p: set_text(p, changed))
    assert violated(events) == {5}  # the run's final text no longer matches what was streamed
    streamed = "".join(e.payload["text"] for e in events if e.event_type == "stream.delta")
    events = edit(events, is_("generation.finished"),
                  lambda p: p.update(text_digest=digest_text(streamed)))
    assert violated(events, decode) == {5}  # consistent with itself, not with the tokens
    assert violated(events) == set()  # without the tokenizer the bytes cannot be judged


def test_5_text_that_does_not_match_its_digest_is_reported(greedy) -> None:
    events = edit(greedy, is_("stream.delta", 2), lambda p: p.update(text=p["text"] + "!"))
    assert violated(events) == {5}


def test_6_a_delta_after_generation_finished_is_reported(greedy) -> None:
    late = next(e for e in greedy if e.event_type == "stream.delta")
    events = append(greedy, "stream.delta", {**late.payload, "seq": 99}, "transport")
    report = check(events)
    assert report.violated == {6}
    assert "stream.delta after the request finished" in report.render()


def _tool_call(events: Sequence[Event], steps: Sequence[str]) -> list[Event]:
    out = list(events)
    for step in steps:
        out = append(out, f"tool.{step}", {"call_id": "call-1", "name": "send_email"})
    return out


def test_7_a_tool_executed_before_authorization_is_reported(greedy) -> None:
    lifecycle = ["proposed", "parsed", "validated", "authorized", "committed", "executed"]
    assert check(_tool_call(greedy, lifecycle)).ok
    events = _tool_call(greedy, [s for s in lifecycle if s != "authorized"])
    report = check(events)
    assert report.violated == {7}
    assert "before it was authorized" in report.render()


def test_8_a_rollback_after_the_commit_boundary_is_reported(greedy) -> None:
    lifecycle = ["proposed", "parsed", "validated", "authorized", "committed", "executed",
                 "rolled_back"]
    report = check(_tool_call(greedy, lifecycle))
    assert report.violated == {8}
    missing = _tool_call(greedy, lifecycle[:5])  # committed, then no outcome recorded
    assert violated(missing) == {8}


def test_4_an_order_change_mid_run_is_recorded_and_checked(pipe, decode) -> None:
    done = pipe.generate(QUESTION, max_tokens=6, temperature=0.7, min_tokens=3, seed=2,
                         recording="full")
    configured = next(e for e in done.trace if e.event_type == "selection.configured")
    assert configured.payload["processors"] == ["min_tokens", "temperature"]
    changes = {e.payload["step"]: e.payload["processors"] for e in done.trace
               if e.event_type == "token.selected" and "processors" in e.payload}
    assert changes == {4: ["temperature"]}  # min_tokens stops applying once 3 tokens exist
    assert check(done, detokenize=decode).ok
    events = edit(done.trace, is_("token.selected", 4),
                  lambda p: p.update(processors=["temperature", "min_tokens"]))
    report = check(events)
    assert report.violated == {4} and "at step 4" in report.render()


class Shouting:
    """A faulty detokenizer stage: streams its inner detokenizer's text upper-cased."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def start(self, prompt_ids):
        return self.inner.start(prompt_ids)

    def step(self, state, token_id):
        state, text = self.inner.step(state, token_id)
        return state, text.upper()

    def finish(self, state):
        return self.inner.finish(state).upper()


def test_live_checking_raises_on_close_for_a_faulty_stage(pipe, decode) -> None:
    clean = CheckingSink(detokenize=decode)
    with build("tiny", sinks=[clean]) as ok:
        ok.generate(QUESTION, max_tokens=4, temperature=0, recording="full")
        ok.generate(QUESTION, max_tokens=4, temperature=0)
    assert clean.checked == 2 and not clean.failures
    live = CheckingSink(detokenize=decode)
    faulty = build("tiny", detokenizer=Shouting(pipe.stages.detokenizer), sinks=[live])
    done = faulty.generate(QUESTION, max_tokens=4, temperature=0, recording="full")
    assert done.text != decode(done.token_ids)  # the stage really misbehaved
    with pytest.raises(InvariantViolation) as raised:
        faulty.close()
    assert [r.violated for r in raised.value.reports] == [{5}]
