"""Per-request processor state: the penalties' counts advance with each committed token.

Oracles: transformers' ``RepetitionPenaltyLogitsProcessor`` on the same logits and ids, and
OpenAI's definition of presence and frequency written out with ``collections.Counter``; the
state path (dense counts kept per request) must give exactly what the ids path (sparse
tables rebuilt every step) gives, for dense and sparse scores, for rows whose ids run past
the state (a verified draft position), beside rows with no state; and greedy decoding with
penalties through the engine (which keeps states) equals transformers' ``generate`` on the
same weights.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from pipeline import build
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.protocols import Batch, Row, Scores
from pipeline.types import GenerationConfig
from stages.process.chain import ProcessorChain
from stages.process.penalties import (
    FrequencyPenalty, PresencePenalty, RepetitionPenalty, TokenCounts,
)
from stages.process.truncation import TopK

V = 512


def rows_for(seed: int, config: GenerationConfig, draft_tails: bool
             ) -> tuple[list[Row], list[Row], ProcessorChain]:
    """Three rows with states advanced token by token as a strategy would, and the same
    rows without states; with ``draft_tails`` each stateful row's ids run two tokens past
    what its state has seen."""
    rng = random.Random(seed)
    chain = ProcessorChain([RepetitionPenalty(), PresencePenalty(), FrequencyPenalty()])
    with_state, plain = [], []
    for b in range(3):
        prompt = [rng.randrange(V + 20) for _ in range(rng.randrange(1, 30))]  # some > V
        base = Row(f"r{b}", config, prompt, [], 1, 0, frozenset({0}))
        states = chain.start(base)
        outputs: list[int] = []
        for _ in range(rng.randrange(0, 60)):
            token = rng.randrange(V)
            if rng.random() < 0.3 and outputs:
                token = rng.choice(outputs)  # repeats, so counts exceed one
            outputs.append(token)
            chain.advance(states, token)
        seen = list(outputs)
        if draft_tails:
            seen += [rng.randrange(V), outputs[0] if outputs else 3]
        row = Row(f"r{b}", config, prompt, seen, len(seen) + 1, 0, frozenset({0}))
        plain.append(row)
        with_state.append(row if b == 2 else row.with_states(states))  # row 2: none
    return with_state, plain, chain


CONFIG = GenerationConfig(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("draft_tails", [False, True])
def test_the_state_path_equals_the_ids_path(seed: int, draft_tails: bool) -> None:
    stateful, plain, chain = rows_for(seed, CONFIG, draft_tails)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 4
    got = chain(Scores(logits.clone()), Batch(tuple(stateful), V)).values
    want = chain(Scores(logits.clone()), Batch(tuple(plain), V)).values
    assert torch.equal(got, want)
    # sparse scores (the penalties after a truncation): the same columns, the same values
    topk = TopK()
    cfg = GenerationConfig(top_k=40, repetition_penalty=1.3, presence_penalty=0.7,
                           frequency_penalty=0.4)
    s_rows = [r.with_states(r.states) for r in stateful]
    s_rows = [Row(r.request_id, cfg, r.prompt_ids, r.output_ids, r.step, r.seed,
                  r.eos_token_ids, r.stream, r.states) for r in s_rows]
    p_rows = [Row(r.request_id, cfg, r.prompt_ids, r.output_ids, r.step, r.seed,
                  r.eos_token_ids) for r in plain]
    sparse_got = chain(topk(Scores(logits.clone()), Batch(tuple(s_rows), V)),
                       Batch(tuple(s_rows), V))
    sparse_want = chain(topk(Scores(logits.clone()), Batch(tuple(p_rows), V)),
                        Batch(tuple(p_rows), V))
    assert sparse_got.indices is not None and sparse_want.indices is not None
    assert torch.equal(sparse_got.indices, sparse_want.indices)
    assert torch.equal(sparse_got.values, sparse_want.values)


def test_the_state_path_matches_the_definitions() -> None:
    stateful, plain, _ = rows_for(11, CONFIG, draft_tails=True)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)) * 4
    for processor in (RepetitionPenalty(), PresencePenalty(), FrequencyPenalty()):
        got = processor(Scores(logits.clone()), Batch(tuple(stateful), V)).values
        for b, row in enumerate(plain):
            z = logits[b:b + 1].clone()
            if isinstance(processor, RepetitionPenalty):
                ids = [t for t in (*row.prompt_ids, *row.output_ids) if t < V]
                want = RepetitionPenaltyLogitsProcessor(1.3)(
                    cast(torch.LongTensor, torch.tensor([ids])), z)
            else:
                counts = Counter(row.output_ids)
                want = z.clone()
                for token, n in counts.items():
                    amount = 0.7 if isinstance(processor, PresencePenalty) else 0.4 * n
                    want[0, token] = z[0, token] - torch.tensor(amount, dtype=torch.float32)
            assert torch.allclose(got[b:b + 1], want, rtol=0, atol=1e-6), processor.name


def test_a_state_is_made_once_and_advanced_per_token() -> None:
    counts = TokenCounts([3, 3, 7, 99])  # 99: outside the vocabulary, ignored
    ids, first = counts.tensor(16, torch.device("cpu"))
    assert sorted(ids.tolist()) == [3, 7]
    for token in [7, 15] + list(range(16)) * 5:  # past the distinct-id buffer's first size
        counts.add(token)
    ids, again = counts.tensor(16, torch.device("cpu"))
    assert again is first  # advanced in place, not rebuilt
    assert sorted(ids.tolist()) == list(range(16))
    want = Counter([3, 3, 7, 7, 15] + list(range(16)) * 5)
    assert again.tolist() == [float(want[t]) for t in range(16)]
    assert counts.outputs == 2 + 80


def test_greedy_decoding_with_penalties_equals_transformers() -> None:
    prompt = "The cat sat on the mat. The cat"
    with build(TINY_MODEL_DIR, options={"dtype": "float32"}) as pipe:
        ids = list(pipe.tokenize(prompt).input_ids)
        got = pipe.generate(prompt, max_tokens=24, temperature=0, repetition_penalty=1.5,
                            ignore_eos=True)
    model: Any = AutoModelForCausalLM.from_pretrained(str(TINY_MODEL_DIR),
                                                      torch_dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                         repetition_penalty=1.5, min_new_tokens=24)
    assert list(got.token_ids) == out[0, len(ids):].tolist()
