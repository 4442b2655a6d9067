"""The iterative-generation comparison (``benchmarks/iterative.py``) on a tiny setting.

Its core functions run in seconds so the script cannot rot, each against an independent
oracle: the AR scorer against hand-computed causal scores of a scripted model and against
transformers on the real tiny model; the masked-diffusion bound against its closed form on a
scripted denoiser (unbiased for a context-free one, exact for blocks of one); the forward
counts against the samplers' schedules; and the whole script once as a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.testing import ScriptedBackend, hashed_denoiser, hashed_logits

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import iterative  # noqa: E402
import iterative_bounds  # noqa: E402

VOCAB = 11
MASK = VOCAB - 1
DOC = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]


def nll_of(logits: torch.Tensor, token: int) -> float:
    return float(-torch.log_softmax(logits.double(), -1)[token])


def test_ar_nll_is_the_sum_of_causal_next_token_losses() -> None:
    fn = hashed_logits(VOCAB)
    backend = ScriptedBackend(VOCAB, fn, num_slots=1)
    context, target = DOC[:4], DOC[4:9]
    expected = sum(nll_of(fn(DOC[:j]), DOC[j]) for j in range(4, 9))
    assert iterative_bounds.ar_nll(backend, context, target) == pytest.approx(expected, rel=1e-6)
    assert iterative_bounds.ar_nll(backend, context, []) == 0.0
    with pytest.raises(ValueError, match="context"):
        iterative_bounds.ar_nll(backend, [], target)
    with pytest.raises(ValueError, match=r"\[11\] are outside"):
        iterative_bounds.ar_nll(backend, context, [1, VOCAB])


def test_masked_bound_of_blocks_of_one_is_the_exact_nll() -> None:
    """With L = 1 every draw masks the one position with weight 1: no Monte Carlo left."""
    denoise = hashed_denoiser(VOCAB)
    backend = ScriptedBackend(VOCAB, hashed_logits(VOCAB), num_slots=1, denoise=denoise)
    bound, variance = iterative_bounds.masked_elbo(backend, DOC, MASK, 1, 3,
                                                  torch.Generator().manual_seed(0))
    exact = sum(nll_of(denoise(DOC[:j], (MASK,), 0), DOC[j]) for j in range(1, len(DOC)))
    assert bound == pytest.approx(exact, rel=1e-9)
    assert variance == pytest.approx(0.0, abs=1e-12)


def test_masked_bound_is_unbiased_for_a_context_free_denoiser() -> None:
    """When each position's prediction ignores the rest, E[(L/k) sum_S nll] = sum nll."""
    table = torch.randn(len(DOC), VOCAB, generator=torch.Generator().manual_seed(5)) * 2

    def denoise(cached: Sequence[int], block: Sequence[int], offset: int) -> torch.Tensor:
        return table[len(cached) + offset]

    backend = ScriptedBackend(VOCAB, hashed_logits(VOCAB), num_slots=1, denoise=denoise)
    docs = [DOC] * 20
    got = iterative_bounds.masked_held_out(backend, docs, MASK, 4, 4, seed=3)
    exact = sum(nll_of(table[j], DOC[j]) for j in range(1, len(DOC))) / (len(DOC) - 1)
    assert got["tokens"] == 20 * (len(DOC) - 1)
    assert 0 < got["standard_error"] < 0.5
    assert abs(got["nats_per_token"] - exact) < 4 * got["standard_error"]


def test_masked_bound_refuses_what_it_cannot_estimate() -> None:
    backend = ScriptedBackend(VOCAB, hashed_logits(VOCAB), num_slots=1,
                              denoise=hashed_denoiser(VOCAB))
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="draws"):
        iterative_bounds.masked_elbo(backend, DOC, MASK, 4, 1, gen)
    with pytest.raises(ValueError, match="mask token"):
        iterative_bounds.masked_elbo(backend, DOC + [MASK], MASK, 4, 2, gen)


@pytest.fixture(scope="module")
def scorer() -> object:
    from backends.torch.backend import TorchBackend

    return TorchBackend.from_dir(TINY_MODEL_DIR, num_slots=1, dtype="float32")


def one_setting(label: str, scorer: object, max_tokens: int = 8) -> dict[str, object]:
    setting = iterative.pick([label])[0]
    return iterative.run_setting(setting, iterative.PROMPTS[:1], max_tokens, 1, scorer)


def test_ar_row_counts_one_forward_per_token_and_scores_like_transformers(
        scorer: object) -> None:
    transformers = pytest.importorskip("transformers")
    row = one_setting("AR greedy", scorer)
    tokens = row["tokens"]
    assert isinstance(tokens, int) and tokens > 0
    assert row["forwards"] == {"prefill": 1, "passes": 0, "writes": tokens - 1,
                               "positions": row["forwards"]["positions"]}  # type: ignore[index]
    assert row["forwards_per_token"] == pytest.approx(1.0)
    assert row["same_output_every_round"] is True
    # The oracle: transformers' model on the same ids, the output's mean NLL.
    from pipeline import build

    with build("tiny") as pipe:
        messages = [{"role": "user", "content": iterative.PROMPTS[0]}]
        prompt = list(pipe.tokenize(messages).input_ids)
        output = list(pipe.generate(messages, max_tokens=8, temperature=0.0, seed=0).token_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR,
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(output))
    assert row["ar_perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-3)


def test_masked_rows_follow_the_sampler_schedules(scorer: object) -> None:
    """llada with S steps per block of L: S passes per block opened, one write per block
    but the last (the request ends with it)."""
    row = one_setting("llada L8 S4", scorer, max_tokens=16)
    calls = row["forwards"]
    tokens = row["tokens"]
    assert isinstance(calls, dict) and isinstance(tokens, int)
    blocks = -(-tokens // 8)
    assert calls["prefill"] == 1
    assert calls["passes"] == 4 * blocks
    assert calls["writes"] == blocks - 1


def test_flow_rows_follow_the_solver_schedule(scorer: object) -> None:
    """Heun with S steps: 2S - 1 calls per block; the block (cut to the 8 tokens allowed) is
    written once its first token is committed, before the rest of it is."""
    row = one_setting("flow heun L16 S8", scorer)
    calls, tokens = row["forwards"], row["tokens"]
    assert isinstance(calls, dict) and isinstance(tokens, int)
    assert calls["prefill"] == 1 and calls["passes"] == 2 * 8 - 1
    assert 1 <= tokens <= 8
    assert calls["writes"] == (1 if tokens > 1 else 0)
    assert math.isfinite(float(row["ar_perplexity"]))  # type: ignore[arg-type]


def test_script_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "iterative.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "iterative.py"), "--settings", "AR greedy",
         "dfm L8 S8", "ddim L16 S20", "--prompts", "1", "--max-tokens", "6", "--rounds", "2",
         "--held-out-docs", "2", "--held-out-window", "16", "--draws", "2", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [r["label"] for r in report["rows"]] == ["AR greedy", "dfm L8 S8", "ddim L16 S20"]
    assert all(len(r["round_seconds"]) == 2 for r in report["rows"])
    assert len(report["machine"]["loadavg_before"].split()) == 3
    held = report["held_out"]
    assert held["data"]["conversations"] == 2
    assert isinstance(held["data"]["corpus_matches_training"], bool)
    whole, cut = held["scopes"]["whole conversations"], held["scopes"]["first 16 tokens"]
    assert whole["tiny"]["tokens"] == whole["tiny-masked"]["tokens"] \
        == held["data"]["tokens"] - 2
    assert cut["tiny"]["tokens"] == cut["tiny-masked"]["tokens"] == 2 * 15
    assert whole["tiny-masked"]["standard_error"] > 0
    assert held["none_computed"] == ["tiny-continuous", "tiny-flow"]
    for label in ("AR greedy", "dfm L8 S8", "ddim L16 S20", "held out:", "load average"):
        assert label in done.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "iterative.py"),
                          "--settings", "llada L99"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "unknown setting" in bad.stderr
