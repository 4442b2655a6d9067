"""build(processors=..., stoppers=...): yours join the default chains; replacing them is explicit.

Oracles are analytic: the scripted model's logits are known, so the processed distribution a
request must sample from (a boost, then temperature, then truncation) is computed here by
hand and compared with the logprobs the pipeline reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pipeline import Batch, Row, Scores
from pipeline.builder import DEFAULT_PROCESSORS, DEFAULT_STOPPERS
from pipeline.errors import InvalidValueError
from pipeline.testing import (
    ByteTokenizer, ScriptedBackend, TokenCountStopper, build_scripted,
)

V = ByteTokenizer.VOCAB
A, B = 65, 66
BOOST = 20.0


def logits(tokens: Sequence[int]) -> torch.Tensor:
    """The model: 'A' at 10, 'B' at 5, every other token at 0."""
    out = torch.zeros(V)
    out[A], out[B] = 10.0, 5.0
    return out


class Boost:
    """Adds ``BOOST`` to token 'B' in every row (a user's own processor)."""

    name = "boost_b"
    argmax_invariant = False

    def active(self, row: Row) -> bool:
        return True

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        values = scores.to_dense(batch.vocab_size)
        values[:, B] += BOOST
        return Scores(values)


def pipe(**stages: object):
    return build_scripted(ScriptedBackend(V, logits), **stages)


def log_softmax_at(values: dict[int, float], token: int) -> float:
    """log p(token) for logits ``values`` on the named ids and 0 on the other ``V`` ids."""
    rest = V - len(values)
    total = math.log(sum(math.exp(v) for v in values.values()) + rest * math.exp(0.0))
    return values[token] - total


def test_an_added_processor_runs_before_temperature_and_temperature_still_applies() -> None:
    with pipe(processors=[Boost()]) as p:
        done = p.generate("x", max_tokens=2, temperature=2.0, top_p=1.0, seed=3,
                          logprobs=True, top_logprobs=2)
    # boost first (B: 5 + 20 = 25), then divide by T = 2: B 12.5, A 5, the rest 0
    expected = log_softmax_at({A: 10 / 2, B: (5 + BOOST) / 2}, B)
    top = done.logprobs[0].top
    assert top[0].token_id == B and top[0].logprob == pytest.approx(expected, abs=1e-4)
    assert top[1].token_id == A
    assert top[1].logprob == pytest.approx(log_softmax_at({A: 5.0, B: 12.5}, A), abs=1e-4)
    # had temperature run first, B would be 5/2 + 20 = 22.5: a different number
    assert expected != pytest.approx(log_softmax_at({A: 5.0, B: 22.5}, B), abs=1e-4)


def test_top_k_one_keeps_the_token_an_added_processor_boosted() -> None:
    with pipe(processors=[Boost()]) as p:
        for seed in range(5):
            done = p.generate("x", max_tokens=4, temperature=5.0, top_k=1, seed=seed,
                              logprobs=True)
            assert done.text == "BBBB"  # the model alone prefers 'A'
            assert {lp.logprob for lp in done.logprobs} == {0.0}  # one token left
    with pipe() as p:  # the oracle's other half: without the boost, top_k=1 keeps 'A'
        assert p.generate("x", max_tokens=4, temperature=5.0, top_k=1, seed=0).text == "AAAA"


def test_the_chain_is_recorded_with_the_added_processor_in_its_place() -> None:
    with pipe(processors=[Boost()]) as p:
        done = p.generate("x", max_tokens=1, temperature=0.7, top_p=0.9, seed=1)
    normalized = next(e for e in done.trace if e.event_type == "request.normalized")
    at = DEFAULT_PROCESSORS.index("temperature")
    assert normalized.payload["processor_chain"] == [
        *DEFAULT_PROCESSORS[:at], "boost_b", *DEFAULT_PROCESSORS[at:]]
    configured = next(e for e in done.trace if e.event_type == "selection.configured")
    assert configured.payload["processors"] == ["boost_b", "temperature", "top_p"]


def test_replacing_the_chain_is_explicit_and_then_temperature_is_gone() -> None:
    with pipe(processors=[Boost()], replace_processors=True) as p:
        done = p.generate("x", max_tokens=1, temperature=2.0, seed=3, logprobs=True)
        assert p.stages.processor_names == ("boost_b",)
    # no temperature: the distribution is the boosted logits themselves
    assert done.logprobs[0].token_id == B
    assert done.logprobs[0].logprob == pytest.approx(
        log_softmax_at({A: 10.0, B: 5 + BOOST}, B), abs=1e-4)
    with pipe(processors=["temperature", Boost()], replace_processors=True) as p:
        assert p.stages.processor_names == ("temperature", "boost_b")
    with pipe(processors=[], replace_processors=True) as p:
        assert p.stages.processor_names == ()


def test_a_name_the_default_chain_has_is_an_error_that_says_how_to_replace() -> None:
    with pytest.raises(InvalidValueError, match="replace_processors=True"):
        pipe(processors=["top_k"])
    with pytest.raises(InvalidValueError, match="each name may appear once"):
        pipe(processors=[Boost(), Boost()], replace_processors=True)
    with pytest.raises(InvalidValueError, match="needs processors="):
        pipe(replace_processors=True)
    with pytest.raises(InvalidValueError, match="must be a list"):
        pipe(processors="top_k")


def test_an_added_stopper_joins_the_default_ones() -> None:
    with pipe(stoppers=[TokenCountStopper(5)]) as p:
        assert [s.name for s in p.stages.stoppers] == [*DEFAULT_STOPPERS, "token_count"]
        assert p.generate("x", max_tokens=3, temperature=0).text == "AAA"  # max_tokens holds
        done = p.generate("x", max_tokens=10, temperature=0)
        assert done.text == "AAAAA" and done.finish_reason.value == "length"
        assert p.generate("x", max_tokens=10, temperature=0, stop=["AA"]).text == ""


def test_replacing_the_stoppers_is_explicit() -> None:
    with pipe(stoppers=[TokenCountStopper(5)], replace_stoppers=True) as p:
        assert [s.name for s in p.stages.stoppers] == ["token_count"]
        # only the count stops it now: max_tokens is not checked any more
        assert p.generate("x", max_tokens=3, temperature=0).text == "AAAAA"
    with pytest.raises(InvalidValueError, match="replace_stoppers=True"):
        pipe(stoppers=["eos"])
