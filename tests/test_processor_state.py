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
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.request import GenerationConfig
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


def test_the_counts_come_from_the_state_when_a_row_has_one() -> None:
    # a state that saw token 5 three times, on a row whose ids say token 7: the penalties
    # must fall on 5 (the state), and on 7 only for the row without a state
    config = GenerationConfig(presence_penalty=0.7, frequency_penalty=0.4)
    chain = ProcessorChain([PresencePenalty(), FrequencyPenalty()])
    base = Row("r", config, [1], [], 1, 0, frozenset({0}))
    states = chain.start(base)
    for _ in range(3):
        chain.advance(states, 5)
    row = Row("r", config, [1], [7, 7, 7], 4, 0, frozenset({0}))
    logits = torch.zeros(2, V)
    got = chain(Scores(logits.clone()),
                Batch((row.with_states(states), row), V)).values
    penalty = 0.7 + 3 * 0.4
    assert got[0, 5].item() == pytest.approx(-penalty) and got[0, 7].item() == 0.0
    assert got[1, 7].item() == pytest.approx(-penalty) and got[1, 5].item() == 0.0


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


def test_the_grammar_stream_equals_the_ids_path_through_drafts_and_rejections() -> None:
    # a request's matcher kept as its state (told each committed token) masks exactly as a
    # processor that brings a matcher to each row's whole ids, over verified positions whose
    # drafts are partly accepted and partly rejected (rollbacks), step after step
    from pipeline.grammar import Grammar
    from stages.structured.processor import GrammarProcessor
    from stages.tokenize import HFTokenizer

    tok = HFTokenizer.from_dir(TINY_MODEL_DIR)
    text = '{"name": "Ada", "tags": ["x", "yz"], "n": 12}'
    target = tok.encode_text(text)
    vocab = tok.vocab_size
    config = GenerationConfig(grammar=Grammar.json_object(), max_tokens=64)
    stateful, plain = GrammarProcessor(tok), GrammarProcessor(tok)
    chain = ProcessorChain([stateful])
    state = chain.start(Row("g", config, [1, 2], [], 1, 0, frozenset({0})))
    rng = random.Random(3)
    committed: list[int] = []
    while len(committed) < len(target):
        k = rng.randrange(0, 4)
        truth = target[len(committed):len(committed) + k]
        drafts = [t if rng.random() < 0.6 else rng.randrange(vocab) for t in truth]
        rows_s, rows_p = [], []
        for j in range(len(drafts) + 1):
            ids = committed + drafts[:j]
            row = Row("g", config, [1, 2], ids, len(ids) + 1, 0, frozenset({0}))
            rows_s.append(row.with_states(state))
            rows_p.append(Row("h", config, [1, 2], ids, len(ids) + 1, 0, frozenset({0})))
        logits = torch.randn(len(rows_s), vocab, generator=torch.Generator().manual_seed(
            len(committed)))
        got = chain(Scores(logits.clone()), Batch(tuple(rows_s), vocab)).values
        want = plain(Scores(logits.clone()), Batch(tuple(rows_p), vocab)).values
        assert torch.equal(torch.isinf(got), torch.isinf(want)), len(committed)
        accepted = 0  # the drafts that agree with the text, then the next true token
        while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
            accepted += 1
        for token in target[len(committed):len(committed) + accepted + 1]:
            committed.append(token)
            chain.advance(state, token)
    stream = state["grammar"]
    assert stream.committed == len(target) and stream.track is not None
    assert not plain._tracks or all(k[0] == "h" for k in plain._tracks)  # the state's
    assert not stateful._tracks  # matcher never went through the per-stream cache
