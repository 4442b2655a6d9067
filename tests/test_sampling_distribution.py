"""Sampling against analytic distributions.

For fixed logits over a small vocabulary, each processor alone and in combination is applied
by the real chain and ``sample`` selector in 20,000 seeded draws (2,000 rows x 10 steps, one
seed per row). The histogram must match the processed distribution computed independently
here in float64 numpy (chi-square, p > 1e-3), and tokens of zero expected probability must
never be drawn. Also: a row's draws do not depend on the batch it runs in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
from stages.process import DEFAULT_ORDER, ProcessorChain, make_processor
from stages.select import SamplingSelector

VOCAB = 12
LOGITS = np.array([0.9, -0.3, 2.0, 0.1, 1.4, -1.2, 0.6, 1.7, -0.8, 0.3, 1.1, -1.5])
ROWS, STEPS = 2000, 10
PROMPT, OUTPUT = (2, 5, 9), (3, 3, 7, 1, 3)
EOS = 11
MARGIN = 1e-4  # reference cut-offs must be this far from a tie, so float32 agrees
# Logits on which each stage of temperature 0.7 + top_k 6 + top_p 0.9 + min_p 0.05 removes
# something: after temperature the ranked probabilities are 0.55, 0.235 (kept), 0.026
# (inside the nucleus, below 0.05 x 0.55: min_p's), 0.025, 0.023, 0.021 (top_p's), and six
# of 0.02 (top_k's), spread over the ids in a scrambled order.
_RANKED = np.array([0.55, 0.235, 0.026, 0.025, 0.023, 0.021] + [0.02] * 6)
BITING = np.empty(VOCAB)
BITING[[4, 9, 0, 7, 2, 11, 1, 3, 5, 6, 8, 10]] = 0.7 * np.log(_RANKED) + 0.002 * np.arange(
    VOCAB)[::-1] * (_RANKED == 0.02)  # top_k's six differ a little, so none ties another

Reference = Callable[[np.ndarray], np.ndarray]


# --- the analytic distributions (float64 numpy, written from the definitions) ------------


def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities of ``logits`` (``-inf`` -> 0)."""
    finite = np.isfinite(logits)
    e = np.where(finite, np.exp(logits - logits[finite].max()), 0.0)
    probs: np.ndarray = e / e.sum()
    return probs


def keep_only(logits: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``logits`` with every token outside the boolean ``keep`` removed."""
    return np.where(keep, logits, -np.inf)


def temperature(t: float) -> Reference:
    return lambda z: z / t


def top_k(k: int) -> Reference:
    return lambda z: keep_only(z, z >= np.sort(z)[-k])


def top_p(p: float) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        probs = softmax(z)
        order = np.argsort(-probs, kind="stable")
        above = np.cumsum(probs[order]) - probs[order]  # mass ranked above each token
        assert np.abs(above - p).min() > MARGIN
        keep = np.zeros(len(z), dtype=bool)
        keep[order[above < p]] = True
        return keep_only(z, keep)
    return ref


def min_p(m: float) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        probs = softmax(z)
        assert np.abs(probs - m * probs.max())[probs > 0].min() > MARGIN * 1e-2
        return keep_only(z, probs >= m * probs.max())
    return ref


def typical_p(mass: float) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        probs = softmax(z)
        live = probs > 0
        logp = np.where(live, np.log(np.where(live, probs, 1.0)), -np.inf)
        entropy = -(probs[live] * logp[live]).sum()
        distance = np.where(live, np.abs(-logp - entropy), np.inf)
        order = np.argsort(distance, kind="stable")
        reached = np.cumsum(probs[order])
        assert np.abs(reached - mass).min() > MARGIN
        last = min(int((reached < mass).sum()), len(z) - 1)
        return keep_only(z, distance <= distance[order][last])
    return ref


def penalties(repetition: float, presence: float, frequency: float) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        z = z.copy()
        for token in set(PROMPT) | set(OUTPUT):
            z[token] = z[token] / repetition if z[token] > 0 else z[token] * repetition
        for token in set(OUTPUT):
            z[token] -= presence + frequency * OUTPUT.count(token)
        return z
    return ref


def masks(bias: dict[int, float], banned: Sequence[int]) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        z = z.copy()
        for token, b in bias.items():
            z[token] += b
        z[list(banned)] = -np.inf
        z[EOS] = -np.inf  # min_tokens is not reached yet
        return z
    return ref


def compose(*refs: Reference) -> Reference:
    def ref(z: np.ndarray) -> np.ndarray:
        for r in refs:
            z = r(z)
        return z
    return ref


COMBINED = {"temperature": 0.7, "top_k": 6, "top_p": 0.9, "min_p": 0.05}
CASES: dict[str, tuple[dict[str, Any], Reference]] = {
    "plain": ({}, compose()),
    "temperature": ({"temperature": 0.7}, temperature(0.7)),
    "hot": ({"temperature": 1.8}, temperature(1.8)),
    "top_k": ({"top_k": 5}, top_k(5)),
    "top_p": ({"top_p": 0.8}, top_p(0.8)),
    "min_p": ({"min_p": 0.15}, min_p(0.15)),
    "typical_p": ({"typical_p": 0.6}, typical_p(0.6)),
    "combined": (COMBINED, compose(temperature(0.7), top_k(6), top_p(0.9), min_p(0.05))),
    "penalties": ({"repetition_penalty": 1.3, "presence_penalty": 0.4,
                   "frequency_penalty": 0.3, "temperature": 0.9, "top_k": 8},
                  compose(penalties(1.3, 0.4, 0.3), temperature(0.9), top_k(8))),
    "masks": ({"logit_bias": {5: 2.5, 2: -1.0}, "banned_token_ids": [7], "min_tokens": 8},
              masks({5: 2.5, 2: -1.0}, [7])),
}


# --- drawing with the real chain and selector ----------------------------------------------


def rows_for(config: dict[str, Any], seed_base: int, step: int, n: int) -> tuple[Row, ...]:
    cfg = GenerationConfig(**config)
    return tuple(Row(f"r{i}", cfg, PROMPT, OUTPUT, step, seed_base + i, frozenset({EOS}))
                 for i in range(n))


def draw(config: dict[str, Any], seed_base: int, base: np.ndarray = LOGITS) -> np.ndarray:
    """Token counts ``[V]`` of ``ROWS * STEPS`` draws, one seed per row, steps 1..STEPS."""
    chain = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])
    selector = SamplingSelector()
    logits = torch.tensor(base, dtype=torch.float32).expand(ROWS, -1)
    counts = np.zeros(VOCAB, dtype=np.int64)
    for step in range(1, STEPS + 1):
        batch = Batch(rows_for(config, seed_base, step, ROWS), VOCAB)
        tokens = selector(chain(Scores(logits.clone()), batch), batch).token_ids
        counts += np.bincount(tokens, minlength=VOCAB)
    return counts


def check_histogram(counts: np.ndarray, expected: np.ndarray) -> None:
    """Nothing drawn outside the support; chi-square agreement on it."""
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew removed tokens {np.nonzero(counts * ~support)}"
    assert support.sum() >= 2
    total = counts.sum()
    result = stats.chisquare(counts[support], expected[support] * total)
    assert result.pvalue > 1e-3, (counts, np.round(expected * total))


@pytest.mark.parametrize("case", list(CASES))
def test_histogram_matches_the_analytic_distribution(case: str) -> None:
    config, reference = CASES[case]
    counts = draw(config, seed_base=1_000_003 * (list(CASES).index(case) + 1))
    check_histogram(counts, softmax(reference(LOGITS.copy())))


def test_combination_where_every_stage_removes_tokens() -> None:
    stages = [temperature(0.7), top_k(6), top_p(0.9), min_p(0.05)]
    support = [int((softmax(compose(*stages[:i])(BITING.copy())) > 0).sum()) for i in range(5)]
    assert support == [12, 12, 6, 3, 2]  # guards the design of BITING
    check_histogram(draw(COMBINED, seed_base=77, base=BITING),
                    softmax(compose(*stages)(BITING.copy())))


def test_the_cases_truncate_something() -> None:
    # guards the test design: each truncating case must remove tokens
    for case in ("top_k", "top_p", "min_p", "typical_p", "combined", "masks"):
        assert (softmax(CASES[case][1](LOGITS.copy())) == 0).any(), case


def test_draws_do_not_depend_on_the_batch() -> None:
    vocab = 1000
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(8, vocab, generator=gen) * 2
    config = GenerationConfig(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.1)
    others = [GenerationConfig(temperature=t, top_k=k, top_p=p)
              for t, k, p in ((1.0, 0, 1.0), (0.0, 0, 1.0), (0.5, 10, 0.95), (1.2, 200, 0.7),
                              (0.9, 0, 0.5), (0.7, 3, 1.0), (1.0, 1000, 0.99))]
    chain = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])
    selector = SamplingSelector()
    for step in range(1, 40):
        ours = Row("me", config, (1, 2, 3), (4, 5), step, 424242, frozenset({0}))
        rows = [Row(f"o{i}", c, (7,), (8,), step + i, 17 * i, frozenset({0}))
                for i, c in enumerate(others)]
        crowd = Batch((*rows[:3], ours, *rows[3:]), vocab)
        alone = Batch((ours,), vocab)
        mixed = logits.clone()
        mixed[3] = logits[0]
        in_crowd = selector(chain(Scores(mixed), crowd), crowd).token_ids[3]
        by_itself = selector(chain(Scores(logits[:1].clone()), alone), alone).token_ids[0]
        assert in_crowd == by_itself
