"""The shipped masked-diffusion model (``build("tiny-masked")``) through the whole pipeline.

Oracles: an independent forward of the same weights (the training script's plain-torch
Qwen3 with the block-causal training mask, and transformers' ``Qwen3ForCausalLM`` for the
causal part) for the exactness of the block-wise cache; ``generate`` for ``stream``; the
trace's own step events for when text streams; the block length for what a cancel leaves.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from pipeline import build
from pipeline.errors import InvalidValueError
from pipeline.model_paths import TINY_MASKED_MODEL_DIR, generation_marker
from pipeline.contracts.model import Attention, ModelCall
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import GenerationConfig

QUESTION = [{"role": "user", "content": "What is a list comprehension?"}]
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_masked_diffusion.py"


@pytest.fixture(scope="module")
def pipe():  # type: ignore[no-untyped-def]
    with build("tiny-masked") as p:
        yield p


def training_model():  # type: ignore[no-untyped-def]
    """The training script's model class, loaded with the shipped weights (float32)."""
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("train_masked_diffusion", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    from safetensors.torch import load_file

    model = module.Qwen3(module.TrainConfig(), 6145)
    weights = {k: v.float() for k, v in load_file(TINY_MASKED_MODEL_DIR / "model.safetensors")
               .items()}
    own = model.hf_state_dict().keys()
    assert set(own) == set(weights)
    with torch.no_grad():
        model.embed.weight.copy_(weights["model.embed_tokens.weight"])
        model.norm.copy_(weights["model.norm.weight"])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                                 ("v", "self_attn.v_proj"), ("o", "self_attn.o_proj"),
                                 ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
                                 ("down", "mlp.down_proj")):
                getattr(layer, ours).weight.copy_(weights[p + theirs + ".weight"])
            for ours, theirs in (("attn_norm", "input_layernorm"),
                                 ("mlp_norm", "post_attention_layernorm"),
                                 ("q_norm", "self_attn.q_norm"), ("k_norm", "self_attn.k_norm")):
                getattr(layer, ours).copy_(weights[p + theirs + ".weight"])
    return module, model.eval()


def test_the_marker_names_the_default_sampler(pipe) -> None:  # type: ignore[no-untyped-def]
    marker = generation_marker(TINY_MASKED_MODEL_DIR)
    assert marker is not None and marker["family"] == "masked_diffusion"
    done = pipe.generate(QUESTION, max_tokens=8, temperature=0)
    configured = [e for e in done.trace if e.event_type == "selection.configured"]
    assert len(configured) == 1  # once, though the first block takes several updates
    assert configured[0].payload["strategy"] == marker["strategy"] == "llada"
    step = next(e for e in done.trace if e.event_type == "step.configured")
    assert step.payload["block_length"] == marker["block_length"]


def test_the_block_wise_cache_is_exact() -> None:
    """Prompt prefilled causally, a finished block written causally, then a denoising pass
    with block attention over that cache: the same logits as one forward over the whole
    sequence with the block-causal training mask (a separate implementation)."""
    module, model = training_model()
    with build("tiny-masked", options={"dtype": "float32"}) as p:
        backend = p.engine.backend
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 6000, (11,), generator=gen)
        first = torch.randint(0, 6000, (8,), generator=gen)
        second = torch.randint(0, 6000, (8,), generator=gen)
        second[[0, 3, 4, 7]] = 6144
        slot = backend.allocate()
        backend.forward([ModelCall(slot, tuple(prompt.tolist()), 0, (10,))])
        written = backend.forward([ModelCall(slot, tuple(first.tolist()), 11, tuple(range(8)))])
        denoised = backend.forward([ModelCall(slot, tuple(second.tolist()), 19, tuple(range(8)),
                                              Attention.BLOCK, write=False)])
        assert backend.cache_length(slot) == 19
        backend.release(slot)
    clean = torch.cat([prompt, first, second])
    noisy = torch.cat([prompt, first, second])
    blocks = torch.tensor([0] * 19 + [1] * 8)
    with torch.no_grad():
        h = model.hidden(torch.cat([clean, noisy])[None], torch.arange(27).repeat(2),
                         module.attention_mask(blocks))
        reference = model.logits(h)[0]
    torch.testing.assert_close(denoised, reference[27 + 19:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(written, reference[11:19], atol=2e-4, rtol=1e-4)


def test_the_causal_path_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_MASKED_MODEL_DIR,
                                                           dtype=torch.float32).eval()
    ids = torch.randint(0, 6000, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits[0]
    with build("tiny-masked", options={"dtype": "float32"}) as p:
        backend = p.engine.backend
        slot = backend.allocate()
        got = backend.forward([ModelCall(slot, tuple(ids[0].tolist()), 0, tuple(range(17)))])
        backend.release(slot)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_stream_equals_generate_and_text_arrives_as_blocks_finish(pipe) -> None:  # type: ignore[no-untyped-def]
    config = GenerationConfig(max_tokens=24, temperature=0.8, seed=11, min_tokens=24)
    whole = pipe.generate(QUESTION, config, recording="full")
    deltas = list(pipe.stream(QUESTION, config))
    assert "".join(d.text for d in deltas) == whole.text
    assert len(whole.token_ids) == 24
    # In the trace every delta follows a finished block, never a pass in the middle of one.
    last_step = None
    for event in whole.trace:
        if event.event_type.startswith("step."):
            last_step = event.event_type
        elif event.event_type == "stream.delta" and not event.payload["final"]:
            assert last_step == "step.block_final"
    finals = [e.payload["tokens"] for e in whole.trace if e.event_type == "step.block_final"]
    assert finals == [8, 8, 8]


def test_max_tokens_shortens_the_last_block(pipe) -> None:  # type: ignore[no-untyped-def]
    done = pipe.generate(QUESTION, max_tokens=13, min_tokens=13, temperature=0)
    assert len(done.token_ids) == 13 and done.finish_reason is FinishReason.LENGTH
    finals = [e.payload["tokens"] for e in done.trace if e.event_type == "step.block_final"]
    assert finals == [8, 5]


def test_a_stop_string_acts_on_committed_text(pipe) -> None:  # type: ignore[no-untyped-def]
    free = pipe.generate(QUESTION, max_tokens=24, min_tokens=24, temperature=0)
    word = free.text.split()[2]
    stopped = pipe.generate(QUESTION, max_tokens=24, min_tokens=24, temperature=0,
                            stop=[word])
    assert stopped.finish_reason is FinishReason.STOP_STRING
    assert stopped.text == free.text[:free.text.index(word)]


def test_cancel_mid_iteration_leaves_whole_blocks(pipe) -> None:  # type: ignore[no-untyped-def]
    handle = pipe.submit(QUESTION, max_tokens=400, min_tokens=400, temperature=0.7, seed=2)
    deltas = handle.deltas()
    next(deltas)
    handle.cancel()
    done = handle.result()
    assert done.finish_reason is FinishReason.CANCELLED
    assert 0 < len(done.token_ids) < 400 and len(done.token_ids) % 8 == 0
    assert pipe.engine.active_slots == 0


def test_wrong_strategy_family_and_settings_are_errors() -> None:
    with pytest.raises(InvalidValueError, match="needs an autoregressive model"):
        build("tiny-masked", strategy="autoregressive")
    with pytest.raises(InvalidValueError, match="masked-diffusion sampler"):
        build("tiny", strategy="llada")
    with pytest.raises(InvalidValueError, match="steps=9"):
        build("tiny-masked", steps=9)
    with pytest.raises(InvalidValueError, match="iterative strategies"):
        build("tiny", block_length=4)


def test_steps_and_block_length_reach_the_sampler() -> None:
    with build("tiny-masked", strategy="fast_dllm", block_length=4,
               strategy_options={"threshold": 0.5}) as p:
        done = p.generate(QUESTION, max_tokens=8, min_tokens=8, temperature=0)
    step = next(e for e in done.trace if e.event_type == "step.configured")
    assert step.payload == {"step": 1, "sampler": "fast_dllm", "block_length": 4, "steps": 4,
                            "mask_token_id": 6144, "threshold": 0.5}
    with build("tiny-masked", block_length=16, steps=4) as p:
        done = p.generate(QUESTION, max_tokens=16, min_tokens=16, temperature=0)
    passes = [e for e in done.trace if e.event_type == "step.denoised"]
    assert [e.payload["committed"] for e in passes] == [4, 4, 4, 4]


def _paged(**options: object):  # type: ignore[no-untyped-def]
    return build("tiny-masked", options={"dtype": "float32", "pack": False, "block_size": 4,
                                         **options})


def _masked_request(ids: list[int], n: int):  # type: ignore[no-untyped-def]
    from pipeline.contracts.request import Request

    return Request(prompt_ids=ids, generation_config={
        "max_tokens": n, "temperature": 0, "ignore_eos": True})


def test_preempted_requests_resume_mid_block_as_if_alone() -> None:
    """More requests than KV blocks: preemption by recompute must restore exactly the
    committed tokens the cache held (all of them while a block is denoised; not those of a
    finished block awaiting its write), so every run equals the same run alone."""
    import random

    from pipeline.trace import check

    rng = random.Random(5)
    jobs = [[rng.randrange(100, 2000) for _ in range(rng.randrange(10, 20))] for _ in range(6)]
    with _paged(max_context=128, num_slots=1) as alone:
        expected = [list(alone.generate(_masked_request(ids, 24)).token_ids) for ids in jobs]
    with _paged(max_context=48, num_slots=4, kv_blocks=14) as pipe:
        handles = [pipe.submit(_masked_request(ids, 24)) for ids in jobs]
        done = [h.result(timeout=120) for h in handles]
    assert [list(d.token_ids) for d in done] == expected
    assert any(e.event_type == "preempted" for d in done for e in d.trace)
    for d in done:
        assert check(d).ok, check(d).render()


def test_logprobs_are_those_of_the_pass_that_committed_each_token(pipe) -> None:  # type: ignore[no-untyped-def]
    done = pipe.generate(QUESTION, max_tokens=8, min_tokens=8, temperature=0, logprobs=True,
                         top_logprobs=3)
    assert done.logprobs is not None and len(done.logprobs) == 8
    for token, record in zip(done.token_ids, done.logprobs):
        assert record.token_id == token and record.logprob <= 0.0
        assert len(record.top) == 3 and record.top[0].logprob >= record.logprob - 1e-6
        assert record.top[0].token_id == token  # greedy: the pick is the most likely


def test_seeded_runs_on_the_model_are_the_same_alone_and_batched() -> None:
    questions = ["What is a list comprehension?", "What does the json module do?",
                 "Explain the with statement."]
    config = GenerationConfig(max_tokens=16, min_tokens=16, temperature=0.9, seed=21)
    with build("tiny-masked", strategy="llada", steps=4,
               strategy_options={"remasking": "random"}) as p:
        alone = [p.generate(q, config).token_ids for q in questions]
        handles = [p.submit(q, config) for q in questions]
        batched = [h.result().token_ids for h in handles]
    assert batched == alone


def test_cli_check_and_diff_on_the_model_s_traces(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A full trace of the real model passes every invariant, the safe-prefix one against its
    own tokenizer; two runs with another number of steps part at the first pass."""
    import json

    from transports.cli import main
    from pipeline.events import JsonlSink

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, steps in ((a, 8), (b, 2)):
        with build("tiny-masked", steps=steps, sinks=[JsonlSink(path)]) as p:
            p.generate(QUESTION, max_tokens=16, min_tokens=16, temperature=0, recording="full")
    assert main(["trace", "check", str(a), "--model", str(TINY_MASKED_MODEL_DIR)]) == 0
    out = capsys.readouterr().out
    assert "no tokenizer" not in out and "is not the one" not in out
    assert main(["trace", "diff", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["product"] == "denoised commits"
    assert report["divergence"]["detail"].startswith("iteration 1 (block 0, pass 1)")
