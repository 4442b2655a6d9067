"""Logit processors against transformers' processors and warpers (the oracle) on the same
logits, hand-computed expectations for the token-id processors, layout equivalence (dense
vs sparse input), the block top-k kernels against torch, and the chain's contract."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)

from pipeline.errors import InvalidValueError, UnknownNameError
from pipeline.contracts.decode import Batch, LogitProcessor, Row, Scores
from pipeline.contracts.request import GenerationConfig
from stages.process import (
    DEFAULT_ORDER, PROCESSORS, AllowedTokens, BannedTokens, FrequencyPenalty, LogitBias, MinP,
    MinTokens, PresencePenalty, ProcessorChain, RepetitionPenalty, Temperature, TopK, TopP,
    TypicalP, make_processor,
)
from stages.process.topk import block_topk, first_argmax

INF = float("inf")
EOS = 0


def make_batch(configs: Sequence[dict[str, Any]], vocab: int,
               prompts: Sequence[Sequence[int]] | None = None,
               outputs: Sequence[Sequence[int]] | None = None) -> Batch:
    """A batch with one row per config mapping."""
    rows = []
    for i, cfg in enumerate(configs):
        prompt = prompts[i] if prompts else (1, 2, 3)
        output = outputs[i] if outputs else ()
        rows.append(Row(f"r{i}", GenerationConfig(**cfg), tuple(prompt), tuple(output),
                        len(output) + 1, seed=i, eos_token_ids=frozenset({EOS})))
    return Batch(tuple(rows), vocab)


def logits_for(rows: int, vocab: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    """Random float32 logits ``[rows, vocab]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def run(processor: LogitProcessor, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The processor's output as dense ``[B, V]`` logits (input left untouched)."""
    return processor(Scores(logits.clone()), batch).to_dense(batch.vocab_size)


def assert_same(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Same removed set, and the kept logits equal up to float32 rounding."""
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-6, atol=1e-6)


def oracle(logits: torch.Tensor, params: Sequence[Any],
           make: Callable[[Any], Any], input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' processor built by ``make(param)`` applied row by row; ``None``: as is."""
    out = logits.clone()
    for b, param in enumerate(params):
        if param is not None:
            ids = input_ids[b:b + 1] if input_ids is not None else torch.zeros(1, 1).long()
            out[b:b + 1] = make(param)(ids, logits[b:b + 1].clone())
    return out


# --- against transformers -----------------------------------------------------------------


def test_temperature_matches_transformers_per_row() -> None:
    temps = [0.5, 1.0, 0.0, 1.7]
    batch = make_batch([{"temperature": t} for t in temps], 50)
    logits = logits_for(4, 50)
    expected = oracle(logits, [t if t not in (0, 1) else None for t in temps],
                      TemperatureLogitsWarper)
    assert_same(run(Temperature(), logits, batch), expected)


@pytest.mark.parametrize("ks", [[5, 0, 50, 3], [5, 17, 50, 3], [1, 1, 1, 1]])
def test_top_k_matches_transformers(ks: list[int]) -> None:
    batch = make_batch([{"top_k": k} for k in ks], 400)
    logits = logits_for(4, 400, seed=1)
    expected = oracle(logits, [k or None for k in ks], TopKLogitsWarper)
    assert_same(run(TopK(), logits, batch), expected)


def test_top_k_sparse_output_when_all_rows_active() -> None:
    batch = make_batch([{"top_k": 7}, {"top_k": 3}], 5000)
    out = TopK()(Scores(logits_for(2, 5000)), batch)
    assert out.indices is not None and out.values.shape == (2, 7)
    assert int(torch.isfinite(out.values[1]).sum()) == 3


@pytest.mark.parametrize("vocab,scale", [(300, 1.0), (20_000, 6.0), (20_000, 3.0), (20_000, 0.5)])
@pytest.mark.parametrize("ps", [[0.5, 1.0, 0.9, 0.95], [0.3, 0.9, 0.99, 0.5]])
def test_top_p_matches_transformers(vocab: int, scale: float, ps: list[float]) -> None:
    # at V=20000 the nucleus fits the first bounded prefix (scale 6), the second (scale 3),
    # or neither, which forces the full sort (scale 0.5)
    batch = make_batch([{"top_p": p} for p in ps], vocab)
    logits = logits_for(4, vocab, scale=scale, seed=2)
    expected = oracle(logits, [p if p < 1 else None for p in ps], TopPLogitsWarper)
    assert_same(run(TopP(), logits, batch), expected)


@pytest.mark.parametrize("mins", [[0.05, 0.0, 0.2, 1.0], [0.1, 0.1, 0.1, 0.1]])
def test_min_p_matches_transformers(mins: list[float]) -> None:
    batch = make_batch([{"min_p": m} for m in mins], 300)
    logits = logits_for(4, 300, seed=3)
    expected = oracle(logits, [m or None for m in mins], MinPLogitsWarper)
    assert_same(run(MinP(), logits, batch), expected)


def test_typical_p_matches_transformers() -> None:
    masses = [0.9, 1.0, 0.5, 0.2]
    batch = make_batch([{"typical_p": m} for m in masses], 300)
    logits = logits_for(4, 300, seed=4)
    expected = oracle(logits, [m if m < 1 else None for m in masses], TypicalLogitsWarper)
    assert_same(run(TypicalP(), logits, batch), expected)


def test_repetition_penalty_matches_transformers() -> None:
    penalties = [1.3, 1.0, 0.7, 2.0]
    prompts = [(1, 2, 3, 3), (4, 5, 6, 7), (8, 9, 9, 10), (11, 12, 13, 1)]
    outputs = [(5, 5, 1, 7), (1, 2, 3, 4), (0, 20, 21, 8), (30, 30, 30, 2)]
    batch = make_batch([{"repetition_penalty": p} for p in penalties], 40, prompts, outputs)
    logits = logits_for(4, 40, seed=5)
    ids = torch.tensor([list(p) + list(o) for p, o in zip(prompts, outputs)])
    expected = oracle(logits, [p if p != 1 else None for p in penalties],
                      RepetitionPenaltyLogitsProcessor, ids)
    assert_same(run(RepetitionPenalty(), logits, batch), expected)


def test_greedy_rows_are_left_to_argmax() -> None:
    batch = make_batch([{"temperature": 0.0, "top_k": 2, "top_p": 0.5, "min_p": 0.5,
                         "typical_p": 0.5}], 30)
    logits = logits_for(1, 30)
    for proc in (Temperature(), TopK(), TopP(), MinP(), TypicalP()):
        assert not proc.active(batch.rows[0])
        assert torch.equal(run(proc, logits, batch), logits)


# --- hand-computed -------------------------------------------------------------------------


def test_presence_and_frequency_penalties() -> None:
    batch = make_batch([{"presence_penalty": 0.5, "frequency_penalty": 0.25},
                        {"presence_penalty": 0.0, "frequency_penalty": -1.0}], 10,
                       prompts=[(4, 4), (4,)], outputs=[(3, 3, 5), (3, 3, 5)])
    logits = torch.zeros(2, 10)
    presence = run(PresencePenalty(), logits, batch)
    expected = torch.zeros(2, 10)
    expected[0, 3] = expected[0, 5] = -0.5
    assert torch.equal(presence, expected)
    frequency = run(FrequencyPenalty(), logits, batch)
    expected = torch.zeros(2, 10)
    expected[0, 3], expected[0, 5] = -0.5, -0.25
    expected[1, 3], expected[1, 5] = 2.0, 1.0
    assert torch.equal(frequency, expected)


def test_logit_bias_adds_to_listed_tokens_only() -> None:
    batch = make_batch([{"logit_bias": {2: 5.0, 7: -100.0}}, {}, {"logit_bias": {"9": 1.5}}],
                       10)
    logits = logits_for(3, 10)
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 100.0
    expected[2, 9] += 1.5
    assert torch.equal(run(LogitBias(), logits, batch), expected)


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    configs = [{"min_tokens": 3, "stop_token_ids": [9]},
               {"min_tokens": 3, "stop_token_ids": [9]},
               {"min_tokens": 3, "stop_token_ids": [9], "ignore_eos": True},
               {"min_tokens": 0, "stop_token_ids": [9]}]
    outputs = [(1, 2), (1, 2, 3), (1,), ()]
    batch = make_batch(configs, 12, outputs=outputs)
    assert [MinTokens().active(r) for r in batch.rows] == [True, False, True, False]
    logits = logits_for(4, 12)
    expected = logits.clone()
    expected[0, EOS] = expected[0, 9] = expected[2, 9] = -INF
    assert torch.equal(run(MinTokens(), logits, batch), expected)


def test_allowed_and_banned_tokens() -> None:
    batch = make_batch([{"allowed_token_ids": [1, 4, 6], "banned_token_ids": [4]},
                        {"banned_token_ids": [0, 2]}], 8)
    logits = logits_for(2, 8)
    allowed = run(AllowedTokens(), logits, batch)
    assert torch.isfinite(allowed[0]).nonzero().flatten().tolist() == [1, 4, 6]
    assert torch.equal(allowed[1], logits[1])
    banned = run(BannedTokens(), logits, batch)
    assert torch.isinf(banned).nonzero().tolist() == [[0, 4], [1, 0], [1, 2]]


def test_ids_outside_the_vocabulary_are_ignored() -> None:
    batch = make_batch([{"repetition_penalty": 2.0, "banned_token_ids": [3, 99]}], 8,
                       prompts=[(1, 50)], outputs=[(7,)])
    logits = torch.ones(1, 8)
    assert run(BannedTokens(), logits, batch)[0].tolist() == [1, 1, 1, -INF, 1, 1, 1, 1]
    assert run(RepetitionPenalty(), logits, batch)[0].tolist() == [1, .5, 1, 1, 1, 1, 1, .5]


# --- layouts ---------------------------------------------------------------------------------

LAYOUT_CASES: list[tuple[LogitProcessor, dict[str, Any]]] = [
    (AllowedTokens(), {"allowed_token_ids": [1, 5, 9, 30, 31, 60]}),
    (BannedTokens(), {"banned_token_ids": [1, 5, 9, 30, 61]}),
    (LogitBias(), {"logit_bias": {1: 2.0, 5: -3.0, 33: 1.0, 62: 4.0}}),
    (MinTokens(), {"min_tokens": 5, "stop_token_ids": [5, 40]}),
    (RepetitionPenalty(), {"repetition_penalty": 1.5}),
    (PresencePenalty(), {"presence_penalty": 0.7}),
    (FrequencyPenalty(), {"frequency_penalty": 0.4}),
    (Temperature(), {"temperature": 0.6}),
    (TopK(), {"top_k": 9}),
    (TopP(), {"top_p": 0.7}),
    (MinP(), {"min_p": 0.1}),
    (TypicalP(), {"typical_p": 0.6}),
]


@pytest.mark.parametrize("all_active", [False, True])
@pytest.mark.parametrize("processor,config", LAYOUT_CASES, ids=lambda c: getattr(c, "name", ""))
def test_sparse_and_dense_inputs_give_the_same_distribution(
        processor: LogitProcessor, config: dict[str, Any], all_active: bool) -> None:
    vocab, keep = 64, 40
    gen = torch.Generator().manual_seed(6)
    rows = 3
    indices = torch.stack([torch.randperm(vocab, generator=gen)[:keep] for _ in range(rows)])
    values = torch.randn(rows, keep, generator=gen) * 2
    sparse = Scores(values, indices)
    dense = sparse.to_dense(vocab)
    # unless all_active, row 1 has the processor off, so the mixed-activity paths run
    middle = config if all_active else {}
    batch = make_batch([config, middle, config], vocab, prompts=[(0, 1, 5, 9)] * rows,
                       outputs=[(5, 5, 30, 31, 33, 50)] * rows)
    from_dense = processor(Scores(dense.clone()), batch).to_dense(vocab)
    from_sparse = processor(Scores(values.clone(), indices.clone()), batch).to_dense(vocab)
    assert_same(from_sparse, from_dense)
    if not all_active:
        assert torch.equal(from_dense[1], dense[1])


# --- kernels ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(width=st.integers(1, 6000), k=st.integers(1, 300), rows=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_block_topk_matches_torch_topk(width: int, k: int, rows: int, seed: int) -> None:
    k = min(k, width)
    values = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    top, columns = block_topk(values, k)
    expected = torch.topk(values, k, dim=1)
    assert torch.equal(top, expected.values)
    assert torch.equal(values.gather(1, columns), top)


def test_first_argmax_breaks_ties_to_the_lowest_column() -> None:
    width = 151_936
    values = torch.zeros(4, width)
    values[0, [7, 3000, 151_935]] = 5.0  # in several blocks
    values[1, [151_935, 151_934]] = 5.0  # tail only
    values[2, 128 * 9 + 5] = 1.0
    expected = [7, 151_934, 128 * 9 + 5, 0]
    assert first_argmax(values).tolist() == expected
    assert first_argmax(values).tolist() == torch.argmax(values, dim=1).tolist()
    odd = torch.randn(3, 151_937)
    assert torch.equal(first_argmax(odd), torch.argmax(odd, dim=1))


# --- the chain -------------------------------------------------------------------------------


class Recorder:
    """A processor that records the batches it saw."""

    def __init__(self, name: str, argmax_invariant: bool) -> None:
        self.name = name
        self.argmax_invariant = argmax_invariant
        self.calls: list[int] = []

    def active(self, row: Row) -> bool:
        return True

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        self.calls.append(len(batch))
        return scores


def test_chain_skips_argmax_invariant_processors_when_every_row_is_greedy() -> None:
    shaper, masker = Recorder("shape", True), Recorder("mask", False)
    chain = ProcessorChain([masker, shaper])
    greedy = make_batch([{"temperature": 0.0}] * 2, 10)
    chain(Scores(torch.zeros(2, 10)), greedy)
    assert (masker.calls, shaper.calls) == ([2], [])
    mixed = make_batch([{"temperature": 0.0}, {"temperature": 0.8}], 10)
    chain(Scores(torch.zeros(2, 10)), mixed)
    assert (masker.calls, shaper.calls) == ([2, 2], [2])
    assert chain.order_for(mixed.rows[0]) == ("mask",)
    assert chain.order_for(mixed.rows[1]) == ("mask", "shape")


def test_chain_names_and_order_for() -> None:
    chain = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])
    assert chain.names == DEFAULT_ORDER
    batch = make_batch([{"temperature": 0.7, "top_p": 0.9, "logit_bias": {1: 1.0}},
                        {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.2}], 10)
    assert chain.order_for(batch.rows[0]) == ("logit_bias", "temperature", "top_p")
    assert chain.order_for(batch.rows[1]) == ("repetition_penalty",)


def test_chain_applies_in_declared_order() -> None:
    batch = make_batch([{"temperature": 0.5, "logit_bias": {0: 1.0}}], 3)
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    bias_first = ProcessorChain([LogitBias(), Temperature()])(Scores(logits.clone()), batch)
    temp_first = ProcessorChain([Temperature(), LogitBias()])(Scores(logits.clone()), batch)
    assert bias_first.values.tolist() == [[4.0, 4.0, 6.0]]
    assert temp_first.values.tolist() == [[3.0, 4.0, 6.0]]


def test_registry_tables() -> None:
    assert tuple(PROCESSORS) == DEFAULT_ORDER
    for name in DEFAULT_ORDER:
        processor = make_processor(name)
        assert processor.name == name and isinstance(processor, LogitProcessor)
    assert [n for n in DEFAULT_ORDER if PROCESSORS[n].argmax_invariant] == [
        "temperature", "top_k", "top_p", "min_p", "typical_p"]
    with pytest.raises(UnknownNameError, match="top_q"):
        make_processor("top_q")
    with pytest.raises(InvalidValueError):
        ProcessorChain([TopK(), TopK()])


def test_full_chain_on_mixed_rows_matches_step_by_step_oracle() -> None:
    vocab = 1000
    configs: list[dict[str, Any]] = [
        {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 0.0, "top_k": 5},
        {"temperature": 0.9, "top_k": 200, "repetition_penalty": 1.2},
    ]
    batch = make_batch(configs, vocab, prompts=[(1, 2, 3)] * 4, outputs=[(4, 5, 5)] * 4)
    logits = logits_for(4, vocab, seed=8)
    ours = ProcessorChain([make_processor(n) for n in DEFAULT_ORDER])(
        Scores(logits.clone()), batch).to_dense(vocab)
    ids = cast(torch.LongTensor, torch.tensor([[1, 2, 3, 4, 5, 5]]))
    for b, cfg in enumerate(configs):
        row = logits[b:b + 1].clone()
        if cfg.get("temperature") == 0.0:
            assert torch.equal(ours[b:b + 1], row)
            continue
        if "repetition_penalty" in cfg:
            row = RepetitionPenaltyLogitsProcessor(cfg["repetition_penalty"])(ids, row)
        row = TemperatureLogitsWarper(cfg["temperature"])(ids, row)
        for key, warper in (("top_k", TopKLogitsWarper), ("top_p", TopPLogitsWarper),
                            ("min_p", MinPLogitsWarper)):
            if key in cfg:
                row = warper(cfg[key])(ids, row)
        assert_same(ours[b:b + 1], row)
        assert math.isfinite(float(ours[b].max()))
