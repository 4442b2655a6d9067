"""Numeric edges and invalid text, in-process: every value either works by a stated rule or is
refused with the library's own error naming the field; nothing reaches the engine as a float
accident.

Oracles: greedy decoding (the rule says tiny ``top_p`` and tiny temperatures select the most
likely token), the analytic meaning of each parameter, and Python's own UTF-8 codec."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import pytest

from pipeline.errors import InvalidValueError, RequestFailed, ValidationError
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_logits, peaked
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import GenerationConfig, Message, Request, RuntimeLimits, ToolSpec

V = ByteTokenizer.VOCAB
EDGES = [5e-324, 1e-320, 1e-300, 1e-30, 1e-6, 1e-5, 0.0, -0.0, -1e-320, 0.5, 1.0, 2.0, 100.0,
         1e300, 1.7976931348623157e308, -1e308, math.inf, -math.inf, math.nan]
FLOAT_FIELDS = [a.name for a in attrs.fields(GenerationConfig) if a.type in ("float", float)]
LIMIT_FIELDS = ["deadline_s", "queue_timeout_s"]


@pytest.fixture(scope="module")
def pipe():  # type: ignore[no-untyped-def]
    with build_scripted(ScriptedBackend(V, hashed_logits(V, scale=4.0))) as p:
        yield p


def test_every_float_field_is_covered() -> None:
    assert set(FLOAT_FIELDS) == {"temperature", "top_p", "min_p", "typical_p",
                                 "repetition_penalty", "presence_penalty", "frequency_penalty",
                                 "dry_multiplier", "dry_base"}


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", EDGES)
def test_float_edges_work_or_are_refused_by_name(pipe, field: str, value: float) -> None:  # type: ignore[no-untyped-def]
    try:
        handle = pipe.submit("edge", max_tokens=4, seed=7, **{field: value})
    except InvalidValueError as exc:
        assert exc.field == field
        return
    done = handle.result(timeout=20)  # raises RequestFailed if the engine could not cope
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)
    assert all(0 <= t < V for t in done.token_ids)
    assert pipe.engine.alive


@pytest.mark.parametrize("field", LIMIT_FIELDS)
@pytest.mark.parametrize("value", EDGES)
def test_limit_edges_work_or_are_refused_by_name(pipe, field: str, value: float) -> None:  # type: ignore[no-untyped-def]
    try:
        handle = pipe.submit("edge", max_tokens=4, limits={field: value})
    except InvalidValueError as exc:
        assert exc.field == field
        return
    try:
        done = handle.result(timeout=20)
    except RequestFailed as failed:  # a queue limit shorter than admission takes: its rule
        assert field == "queue_timeout_s" and "queue timeout" in failed.cause
        return
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.DEADLINE)


@pytest.mark.parametrize("params", [{"top_p": 1e-320}, {"top_p": 5e-324},
                                    {"temperature": 1e-320}, {"temperature": 5e-324},
                                    {"temperature": 9.9e-6},
                                    {"top_p": 1e-320, "temperature": 0.7},
                                    {"top_k": 1, "temperature": 1.3}])
def test_vanishing_parameters_mean_the_most_likely_token(pipe, params: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
    greedy = pipe.generate("pick", max_tokens=12, temperature=0).token_ids
    for seed in range(3):
        assert pipe.generate("pick", max_tokens=12, seed=seed, **params).token_ids == greedy


def test_tiny_typical_p_keeps_the_most_typical_token() -> None:
    # Two tokens: p(a) = 0.9, p(b) = 0.1; entropy H = 0.325 nats; |-log p - H| is 0.22 for a
    # and 1.98 for b, so the most typical token is a and a vanishing typical_p keeps only it.
    a, b = ord("a"), ord("b")

    def logits(tokens: Sequence[int]) -> object:
        import torch
        out = torch.full((V,), -math.inf)
        out[a], out[b] = math.log(0.9), math.log(0.1)
        return out

    with build_scripted(ScriptedBackend(V, logits)) as p:  # type: ignore[arg-type]
        for seed in range(20):
            assert p.generate("t", max_tokens=3, seed=seed, typical_p=1e-320).text == "aaa"


@pytest.mark.parametrize("value", [10**12, 2**31, 1 << 30 | 1])
def test_counts_beyond_two_to_the_thirty_are_refused(pipe, value: int) -> None:  # type: ignore[no-untyped-def]
    for field in ("max_tokens", "top_k", "min_tokens"):
        params = {field: value}
        if field == "min_tokens":
            params["max_tokens"] = value
        with pytest.raises(InvalidValueError) as err:
            pipe.submit("x", **params)
        assert err.value.field in (field, "max_tokens")
    # the bound itself is fine (generation stops at the window, not at max_tokens)
    assert pipe.generate("x", max_tokens=1 << 30, temperature=0,
                         limits={"max_context_tokens": 40}).finish_reason is FinishReason.LENGTH


def test_a_plain_string_stop_is_one_stop_string() -> None:
    text = b"one, two abc three"

    def choose(tokens: Sequence[int]) -> int:
        i = len(tokens) - prompt_len[0]
        return text[i] if i < len(text) else 256

    prompt_len = [0]
    with build_scripted(ScriptedBackend(V, peaked(V, choose))) as p:
        prompt_len[0] = len(p.tokenize("s"))
        done = p.generate("s", max_tokens=40, temperature=0, stop="abc")
        assert done.text == "one, two " and done.finish_reason is FinishReason.STOP_STRING
        assert GenerationConfig(stop="abc").stop == ("abc",)  # not ("a", "b", "c")


LONE = "\ud800"
BAD_TEXT = [
    ("content", lambda p: p.submit(f"hi {LONE}")),
    ("content", lambda p: p.submit([{"role": "system", "content": LONE},
                                    {"role": "user", "content": "x"}])),
    ("name", lambda p: p.submit([Message("user", "x", name=LONE + "n")])),
    ("stop", lambda p: p.submit("x", stop=["ok", "\udfff"])),
    ("prompt", lambda p: p.submit(Request(prompt=LONE))),
    ("description", lambda p: p.submit("x", tools=[{"name": "t", "description": LONE}])),
    ("parameters.properties", lambda p: p.submit("x", tools=[ToolSpec(
        "t", parameters={"type": "object", "properties": {LONE: {"type": "string"}}})])),
    ("request_id", lambda p: p.submit("x", request_id=LONE)),
]


@pytest.mark.parametrize("field, call", BAD_TEXT, ids=[f for f, _ in BAD_TEXT])
def test_invalid_unicode_is_the_librarys_own_error(pipe, field: str, call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidValueError) as err:
        call(pipe)
    assert isinstance(err.value, ValidationError)
    assert err.value.field.startswith(field) and "lone surrogate" in str(err.value)
    str(err.value).encode("utf-8")  # the message itself is valid text


def test_valid_non_ascii_text_passes(pipe) -> None:  # type: ignore[no-untyped-def]
    done = pipe.generate("naïve 😀 \U0010ffff ✓", max_tokens=2, stop=["é"])
    assert done.finish_reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_STRING)


def test_error_messages_echo_bounded_input() -> None:
    with pytest.raises(InvalidValueError) as err:
        RuntimeLimits(deadline_s="x" * 1_000_000)  # type: ignore[arg-type]
    assert len(str(err.value)) < 300


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "1" * 40, "-1", "1.0"])
def test_logit_bias_keys_must_be_ascii_token_ids(key: str) -> None:
    with pytest.raises(InvalidValueError) as err:
        GenerationConfig(logit_bias={key: 1.0})
    assert err.value.field == "logit_bias"


def test_server_limits_cannot_promise_more_stops_than_the_library_takes() -> None:
    from transports.http.server.limits import Limits

    assert Limits(max_stop=16).max_stop == 16
    with pytest.raises(InvalidValueError, match="library's own cap"):
        Limits(max_stop=17)
