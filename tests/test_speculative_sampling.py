"""Speculative sampling against analytic distributions.

A scripted target over six tokens (its logits a fixed table row per previous token) is
verified against three kinds of drafts: a draft model equal to the target, a draft model
that prefers what the target dislikes, and n-gram point masses (a likely and an unlikely
draft). Each configuration runs 20,000 sequences, one seed each, through the real
:class:`SpeculativeStrategy` (``update`` over batches of 1,000 rows; the draft model is a
:class:`ScriptedBackend`): the first token is forced, then one block of two drafts is
verified. The first speculative token must follow p(. | y1) and the second, where the first
draft was accepted, p(. | y1, y2) (chi-square, p > 1e-3, against distributions computed here
in float64 numpy); the acceptance rate at the first position must be the analytic
``sum_x min(p(x), q(x))``. A control shows the test has the power to see a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from scipy import stats

from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Row
from pipeline.testing import ScriptedBackend
from pipeline.contracts.request import GenerationConfig
from stages.process import ProcessorChain
from stages.select import SamplingSelector
from stages.strategies.draft import DraftModelProposer
from stages.strategies.proposers import NgramProposer, Proposer
from stages.strategies.speculative import SpeculativeStrategy

pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
DRAWS, CHUNK = 20_000, 1_000
Y1 = 5
ALPHA = 1e-3
CONFIG = GenerationConfig(temperature=1.0, max_tokens=64)
# Row a: the target's logits after token a. After Y1 = 5 the target likes 1 (p ~ 0.33) and
# dislikes 4 (p ~ 0.06); every probability is at least ~0.03, so each cell expects hundreds.
TARGET = np.array([
    [0.2, 1.0, -0.4, 0.6, -0.8, 0.0],
    [0.9, -0.5, 0.3, 1.2, -0.2, 0.1],
    [-0.6, 0.4, 0.8, -0.3, 1.1, 0.2],
    [0.5, 0.0, -0.7, 0.3, 0.9, -0.2],
    [1.0, 0.2, 0.4, -0.9, 0.1, 0.6],
    [0.3, 1.3, 0.5, -0.4, -0.9, 0.6],
])
# A draft that puts its mass where the target puts little.
FAR = -2.5 * TARGET


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    out: np.ndarray = e / e.sum()
    return out


def table(logits: np.ndarray) -> Callable[[Sequence[int]], torch.Tensor]:
    """A scripted model: the logits row of the previous token."""
    rows = torch.tensor(logits, dtype=torch.float32)
    return lambda tokens: rows[tokens[-1]]


def run(proposer: Proposer, prompt: tuple[int, ...]) -> dict[str, np.ndarray]:
    """Force y1, let the proposer draft two tokens, verify them; per sequence: the drafts,
    the first speculative token and the second (-1 where the first draft was rejected)."""
    strategy = SpeculativeStrategy(ProcessorChain([]), SamplingSelector(), proposer, 2)
    target = torch.tensor(TARGET, dtype=torch.float32)
    d1, d2, y2, y3 = [], [], [], []
    for base in range(0, DRAWS, CHUNK):
        rows = [Row(f"r{s}", CONFIG, prompt, (), 1, s, frozenset()) for s in
                range(base, base + CHUNK)]
        states = [strategy.start(row, Forcing(prefix=(Y1,))) for row in rows]
        first = strategy.update(states, rows, [target[prompt[-1]][None]] * CHUNK)
        assert all(u.taken[0].token_id == Y1 for u in first)
        plans = [strategy.plan(u.state) for u in first]
        assert all(len(p.token_ids) == 3 for p in plans)
        fed = torch.tensor([p.token_ids for p in plans])                        # [B, 3]
        rows2 = [Row(r.request_id, CONFIG, prompt, (Y1,), 2, r.seed, frozenset()) for r in rows]
        second = strategy.update([u.state for u in first], rows2, list(target[fed]))
        for plan, update in zip(plans, second):
            d1.append(plan.token_ids[1])
            d2.append(plan.token_ids[2])
            y2.append(update.taken[0].token_id)
            y3.append(update.taken[1].token_id if len(update.taken) > 1 else -1)
            strategy.finish(update.state)
    return {k: np.array(v) for k, v in (("d1", d1), ("d2", d2), ("y2", y2), ("y3", y3))}


def chi2_p(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=V)
    return float(stats.chisquare(counts, probs * len(samples)).pvalue)


def second_position_p(out: dict[str, np.ndarray]) -> float:
    """One chi-square over every first token a with enough accepted blocks: the second token
    there against p(. | a) (the statistics add up, and so do the degrees of freedom)."""
    stat, dof = 0.0, 0
    for a in range(V):
        mask = (out["y2"] == a) & (out["d1"] == a)
        if mask.sum() < 300:
            continue
        counts = np.bincount(out["y3"][mask], minlength=V)
        expected = softmax(TARGET[a]) * mask.sum()
        stat += float(((counts - expected) ** 2 / expected).sum())
        dof += V - 1
    assert dof > 0, "no first token was accepted often enough to test the second"
    return float(stats.chi2.sf(stat, dof))


def acceptance(p: np.ndarray, q: np.ndarray) -> float:
    """Leviathan et al.'s acceptance probability of one position: sum_x min(p(x), q(x))."""
    return float(np.minimum(p, q).sum())


def check(out: dict[str, np.ndarray], q1: np.ndarray) -> None:
    p1 = softmax(TARGET[Y1])
    assert chi2_p(out["y2"], p1) > ALPHA
    assert second_position_p(out) > ALPHA
    accepted = float((out["y2"] == out["d1"]).mean())
    expected = acceptance(p1, q1)
    spread = np.sqrt(expected * (1 - expected) / DRAWS) + 1e-9
    assert abs(accepted - expected) < 4.5 * spread, (accepted, expected)


def draft_model(logits: np.ndarray) -> Proposer:
    backend = ScriptedBackend(V, table(logits), num_slots=CHUNK)
    return DraftModelProposer(backend, ProcessorChain([]), V)


def test_a_draft_equal_to_the_target() -> None:
    out = run(draft_model(TARGET), (3, 0, 2))
    assert chi2_p(out["d1"], softmax(TARGET[Y1])) > ALPHA  # the draft samples q = p
    check(out, softmax(TARGET[Y1]))
    assert (out["y2"] == out["d1"]).mean() > 0.99


def test_a_draft_far_from_the_target() -> None:
    out = run(draft_model(FAR), (3, 0, 2))
    q1 = softmax(FAR[Y1])
    assert chi2_p(out["d1"], q1) > ALPHA
    check(out, q1)
    # The power to see a wrong answer: committing the drafts would fail the same test.
    assert chi2_p(out["d1"], softmax(TARGET[Y1])) < 1e-12


@pytest.mark.parametrize("prompt, draft", [((Y1, 1, 2, 0), 1), ((Y1, 4, 0, 2), 4)],
                         ids=["likely", "unlikely"])
def test_ngram_point_masses(prompt: tuple[int, ...], draft: int) -> None:
    out = run(NgramProposer(max_n=1, min_n=1), prompt)
    assert (out["d1"] == draft).all() and (out["d2"] == prompt[2]).all()
    point = np.zeros(V)
    point[draft] = 1.0
    check(out, point)  # acceptance is p(draft)
