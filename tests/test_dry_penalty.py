"""The DRY sequence penalty (stages/process/dry.py) against a brute-force reading of its rule,
and the loops it ends.

The oracle walks every earlier position by hand: for each candidate token, the longest run of
the output that ends just before an earlier occurrence of the token and equals the output's
own ending; the penalty is ``m * base ** (L - allowed)`` for ``L >= allowed``."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
from stages.process.dry import MAX_MATCH, DryPenalty, repeat_penalties


def brute(output: Sequence[int], m: float, base: float, allowed: int) -> dict[int, float]:
    """Token → penalty, by the rule's definition."""
    n = len(output)
    best: dict[int, int] = {}
    for i in range(n - 1):                       # an earlier end; output[i + 1] follows it
        length = 0
        while (length < MAX_MATCH and i - length >= 0
               and output[i - length] == output[n - 1 - length]):
            length += 1
        if length >= allowed:
            token = output[i + 1]
            best[token] = max(best.get(token, 0), length)
    return {t: m * base ** (length - allowed) for t, length in best.items()}


def row(output: Sequence[int], **config: float) -> Row:
    return Row("r", GenerationConfig(**config), (1, 2), tuple(output), len(output) + 1, 0,
               frozenset({0}))


@pytest.mark.parametrize("seed", range(30))
def test_penalties_match_the_rule_by_brute_force(seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = rnd.randint(2, 6)                 # small alphabets repeat a lot
    output = [rnd.randrange(alphabet) for _ in range(rnd.randint(0, 80))]
    if seed % 3 == 0:                            # and a real loop at the end
        output += output[-7:] * 3 if len(output) >= 7 else []
    m, base, allowed = rnd.choice([0.8, 1.0, 2.0]), rnd.choice([1.0, 1.75, 2.0]), \
        rnd.randint(1, 4)
    tokens, penalty = repeat_penalties(np.asarray(output, dtype=np.int64), m, base, allowed)
    got = dict(zip(tokens.tolist(), penalty.tolist()))
    want = brute(output, m, base, allowed)
    assert got.keys() == want.keys()
    for t in want:
        assert got[t] == pytest.approx(want[t], rel=1e-12)


def test_the_processor_subtracts_on_dense_and_sparse_scores() -> None:
    output = [5, 6, 7, 8, 1, 5, 6, 7]            # "5 6 7" again: 8 would extend it (L = 3)
    r = row(output, dry_multiplier=0.8)
    logits = torch.zeros(1, 10)
    dense = DryPenalty()(Scores(logits.clone()), Batch((r,), 10)).to_dense(10)
    expected = torch.zeros(1, 10)
    for t, p in brute(output, 0.8, 1.75, 2).items():
        expected[0, t] -= p
    assert torch.allclose(dense, expected)
    assert dense[0, 8].item() == pytest.approx(-0.8 * 1.75)
    indices = torch.tensor([[8, 3, 6]])
    sparse = DryPenalty()(Scores(torch.zeros(1, 3), indices), Batch((r,), 10))
    assert torch.allclose(sparse.values, expected[0, [8, 3, 6]].unsqueeze(0))


def test_off_and_short_outputs_are_untouched() -> None:
    assert not DryPenalty().active(row([1, 1, 1, 1]))                   # multiplier 0
    assert not DryPenalty().active(row([1, 1], dry_multiplier=0.8))     # too short to repeat
    assert DryPenalty().active(row([1, 1, 1], dry_multiplier=0.8))


def longest_repeat(ids: Sequence[int]) -> int:
    """The longest run that occurs twice in ``ids`` (brute force, overlaps allowed)."""
    best = 0
    for i in range(len(ids)):
        for j in range(i + 1, len(ids)):
            k = 0
            while j + k < len(ids) and ids[i + k] == ids[j + k]:
                k += 1
            best = max(best, k)
    return best


def test_greedy_decoding_that_would_loop_forever_leaves_the_loop() -> None:
    """A model whose favourite next byte always continues the cycle "abcd" (3 logits) with
    "z" one logit behind (every other byte 3 behind): greedy decoding repeats the cycle to
    the limit. With the penalty, a run of L repeated tokens is extended only while
    0.8 * 1.75 ** (L - 2) is below the largest gap (3 logits), i.e. L <= 4: no run longer
    than 5 tokens ever repeats, and the first repeat of "abc" is left for "z" (1.4 > 1)."""
    from pipeline.testing import ScriptedBackend, build_scripted

    cycle = [ord(c) for c in "abcd"]

    def logits(tokens: Sequence[int]) -> torch.Tensor:
        out = torch.zeros(300)
        last = tokens[-1] if tokens else -1
        out[cycle[(cycle.index(last) + 1) % 4] if last in cycle else cycle[0]] = 3.0
        out[ord("z")] = 2.0
        return out

    with build_scripted(ScriptedBackend(300, logits)) as pipe:
        plain = pipe.generate("go", max_tokens=48, temperature=0, ignore_eos=True,
                              dry_multiplier=0.0)   # the pipeline default has the guard on
        guarded = pipe.generate("go", max_tokens=48, temperature=0, ignore_eos=True,
                                dry_multiplier=0.8)
    assert plain.text == "abcd" * 12
    assert guarded.text.startswith("abcdabcz"), guarded.text
    assert longest_repeat(guarded.token_ids) <= 5, guarded.text
