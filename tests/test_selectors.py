"""Selectors and the autoregressive strategy: greedy ties, logprobs against
``torch.log_softmax``, inverse-CDF draws against a numpy recomputation, the counter-based
uniform, and the Strategy contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Batch, Row, Scores, Selector
from pipeline.contracts.strategy import Plan, Strategy
from pipeline.contracts.request import GenerationConfig
from stages.process import DEFAULT_ORDER, ProcessorChain, make_processor
from stages.select import (
    SELECTORS, GreedySelector, SamplingSelector, uniform,
)
from stages.select.rng import BELOW_ONE
from stages.strategies import AutoregressiveStrategy


def row(config: dict[str, Any], seed: int = 0, step: int = 1, stream: int = 0) -> Row:
    """A row with ``config`` and the given RNG cursor."""
    return Row("r", GenerationConfig(**config), (1, 2), (), step, seed, frozenset({0}), stream)


def batch_of(*rows: Row, vocab: int) -> Batch:
    """A batch of ``rows``."""
    return Batch(tuple(rows), vocab)


def test_greedy_ties_go_to_the_lowest_token_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    batch = batch_of(row({}), row({}), vocab=4)
    assert GreedySelector()(Scores(logits), batch).token_ids == (1, 0)
    # sparse: equal values at token ids 9, 4, 7 -> 4, whatever the column order
    sparse = Scores(torch.tensor([[1.0, 5.0, 5.0, 5.0]]), torch.tensor([[2, 9, 4, 7]]))
    assert GreedySelector()(sparse, batch_of(row({}), vocab=10)).token_ids == (4,)


def test_greedy_on_a_full_vocabulary_row() -> None:
    vocab = 151_936
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, [40_000, 90_000]] = 100.0
    batch = batch_of(row({}), row({}), row({}), vocab=vocab)
    choice = GreedySelector()(Scores(logits), batch)
    assert choice.token_ids == tuple(torch.argmax(logits, dim=1).tolist())
    assert choice.token_ids[1] == 40_000


@pytest.mark.parametrize("sparse", [False, True])
def test_logprobs_match_log_softmax(sparse: bool) -> None:
    vocab = 50
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    logits[0, 7] = float("-inf")
    rows = (row({"logprobs": True, "top_logprobs": 5, "temperature": 0.0}),
            row({"temperature": 0.0}),
            row({"logprobs": True, "temperature": 0.0}))
    scores = Scores(logits.clone())
    if sparse:  # the same candidates in shuffled columns
        order = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))
        scores = Scores(logits[:, order].contiguous(), order.expand(3, -1).contiguous())
    choice = SamplingSelector()(scores, batch_of(*rows, vocab=vocab))
    expected = torch.log_softmax(logits, dim=1)
    first, absent, third = choice.logprobs
    assert absent is None and first is not None and third is not None
    assert first.token_id == choice.token_ids[0] == int(logits[0].argmax())
    assert first.logprob == pytest.approx(float(expected[0, first.token_id]), abs=1e-6)
    top = torch.topk(expected[0], 5)
    assert [a.token_id for a in first.top] == top.indices.tolist()
    assert [a.logprob for a in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert third.top == () and third.logprob == pytest.approx(
        float(expected[2, choice.token_ids[2]]), abs=1e-6)


def test_removed_tokens_never_appear_among_top_logprobs() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]])
    choice = GreedySelector()(Scores(logits), batch_of(
        row({"logprobs": True, "top_logprobs": 4}), vocab=4))
    record = choice.logprobs[0]
    assert record is not None and [a.token_id for a in record.top] == [2, 0]


def test_sampling_follows_the_inverse_cdf_of_the_uniform() -> None:
    vocab = 9
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    probs = np.exp(logits[0].double().numpy())
    cdf = np.cumsum(probs / probs.sum())
    for step in range(1, 200):
        r = row({}, seed=11, step=step)
        token = SamplingSelector()(Scores(logits.clone()), batch_of(r, vocab=vocab)).token_ids[0]
        u = uniform(11, 0, step) * BELOW_ONE
        assert token == int(np.searchsorted(cdf, u, side="right"))


def test_sampling_mixes_greedy_and_sampled_rows() -> None:
    vocab = 20
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4))
    rows = [row({"temperature": t}, seed=i, step=3) for i, t in enumerate((0.0, 1.0, 0.0, 1.0))]
    mixed = SamplingSelector()(Scores(logits.clone()), batch_of(*rows, vocab=vocab))
    for i, r in enumerate(rows):
        alone = SamplingSelector()(Scores(logits[i:i + 1].clone()), batch_of(r, vocab=vocab))
        assert alone.token_ids[0] == mixed.token_ids[i]
    assert mixed.token_ids[0] == int(logits[0].argmax())
    assert mixed.token_ids[2] == int(logits[2].argmax())


def test_zero_probability_candidates_are_never_drawn() -> None:
    values = torch.tensor([[float("-inf"), 0.0, float("-inf"), -30.0, float("-inf")]])
    scores = Scores(values.expand(500, -1).contiguous(), torch.arange(10, 15).expand(500, -1))
    rows = [row({}, seed=s) for s in range(500)]
    drawn = set(SamplingSelector()(scores, batch_of(*rows, vocab=15)).token_ids)
    assert drawn <= {11, 13}


def test_uniform_is_a_pure_function_in_the_unit_interval() -> None:
    assert uniform(1, 2, 3) == uniform(1, 2, 3)
    assert len({uniform(1, 2, 3), uniform(2, 2, 3), uniform(1, 3, 3), uniform(1, 2, 4)}) == 4
    draws = np.array([uniform(seed, 0, step) for seed in range(40) for step in range(500)])
    assert draws.min() >= 0.0 and draws.max() < 1.0
    assert stats.kstest(draws, "uniform").pvalue > 1e-3
    assert uniform(2**63 - 1, 2**40, 10**9) < 1.0


def test_selectors_table_and_protocols() -> None:
    for name, cls in SELECTORS.items():
        selector = cls()
        assert selector.name == name and isinstance(selector, Selector)


def test_autoregressive_strategy_is_chain_then_selector() -> None:
    processors = [make_processor(n) for n in DEFAULT_ORDER]
    strategy = AutoregressiveStrategy(processors, SamplingSelector())
    assert isinstance(strategy, Strategy)
    assert strategy.name == "autoregressive"
    r = row({"temperature": 0.8, "top_k": 5}, seed=3, step=2)
    assert strategy.order(r) == ("temperature", "top_k")
    vocab = 100
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(5))
    batch = batch_of(r, vocab=vocab)
    chain = ProcessorChain(processors)
    expected = SamplingSelector()(chain(Scores(logits.clone()), batch), batch)
    state = strategy.start(r, Forcing.none())
    with pytest.raises(ValueError, match="nothing to feed"):
        strategy.plan(state)
    update = strategy.update([state], [r], [logits.clone()])[0]
    (taken,) = update.taken
    assert (taken.token_id, taken.logprob, taken.draw) == (
        expected.token_ids[0], expected.logprobs[0], expected.draws[0])
    assert taken.forced is None and update.rollback == 0
    assert expected.token_ids[0] in torch.topk(logits[0], 5).indices.tolist()
    assert strategy.plan(update.state) == Plan((taken.token_id,), (0,))
    assert update.processed is not None and update.processed.shape == (1, vocab)


def test_autoregressive_strategy_consults_its_forced_token_source() -> None:
    """A forced prefix overrides the selection (logprob 0, an event only when it differs);
    a spent reasoning budget forces the end-of-thinking marker."""
    strategy = AutoregressiveStrategy([], GreedySelector())
    vocab = 10
    logits = torch.zeros(1, vocab)
    logits[0, 4] = 5.0                                              # argmax is 4
    forcing = Forcing(prefix=(4, 7))
    state = strategy.start(row({}, step=1), forcing)
    first = strategy.update([state], [row({"logprobs": True}, step=1)], [logits.clone()])[0]
    assert first.taken[0].token_id == 4 and first.taken[0].forced is None
    second = strategy.update([first.state], [row({"logprobs": True}, step=2)],
                             [logits.clone()])[0]
    assert second.taken[0].token_id == 7
    assert second.taken[0].logprob is not None and second.taken[0].logprob.logprob == 0.0
    assert second.taken[0].forced == ("token.forced", {
        "step": 2, "selected": 4, "forced": 7, "why": "prefix"})
    think = Forcing.for_request((), 2, (8, 9), prompt_ids=[1, 8])  # the prompt opened <think>
    state = strategy.start(row({}, step=1), think)
    taken = []
    for step in range(1, 5):
        update = strategy.update([state], [row({}, step=step)], [logits.clone()])[0]
        state = update.state
        taken.append((update.taken[0].token_id, update.taken[0].forced is not None))
    assert taken == [(4, False), (4, False), (9, True), (4, False)]


