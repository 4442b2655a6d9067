"""Traces of masked-diffusion runs: ``trace check`` passes a valid one and catches a broken
cache walk; ``trace diff`` names the first divergent iteration for runs that differ by seed,
number of steps, remasking rule and block length.

Oracle for the divergent iteration: the two traces' ``step.denoised`` events compared here
directly, pass by pass (what each pass was fed, what it committed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from transports.cli import main
from pipeline.events import Event, JsonlSink
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_denoiser, \
    hashed_logits
from pipeline.trace import check, diff
from pipeline.contracts.request import GenerationConfig
from tests.trace_runs import edit, is_

VOCAB = ByteTokenizer.VOCAB + 1
MASK = ByteTokenizer.VOCAB


def run(strategy: str = "llada", *, seed: int = 1, temperature: float = 0.0,
        block_length: int = 4, steps: int = 4, recording: str = "digest",
        sinks: tuple[Any, ...] = (), banned: tuple[int, ...] = (),
        **options: Any) -> list[Event]:
    backend = ScriptedBackend(VOCAB, hashed_logits(VOCAB), denoise=hashed_denoiser(VOCAB))
    with build_scripted(backend, strategy=strategy, block_length=block_length, steps=steps,
                        strategy_options={"mask_token_id": MASK, **options},
                        sinks=list(sinks)) as pipe:
        done = pipe.generate("hello", GenerationConfig(
            max_tokens=12, temperature=temperature, seed=seed,
            allowed_token_ids=tuple(range(97, 123)), banned_token_ids=banned),
            recording=recording)
    return list(done.trace)


def first_divergent_iteration(a: list[Event], b: list[Event]) -> int:
    """The oracle: the first pass whose input or commits differ (1-based)."""
    def passes(events: list[Event]) -> list[tuple[Any, ...]]:
        return [(e.payload["input_digest"], e.payload["positions"],
                 e.payload.get("ids_digest", e.payload.get("ids")))
                for e in events if e.event_type == "step.denoised"]
    pa, pb = passes(a), passes(b)
    return next(k for k, (x, y) in enumerate(zip(pa, pb), 1) if x != y)


@pytest.mark.parametrize("strategy,options", [
    ("llada", {}), ("llada", {"remasking": "random"}), ("fast_dllm", {}), ("dfm", {})])
@pytest.mark.parametrize("recording", ["digest", "full"])
def test_a_valid_diffusion_trace_passes_every_invariant(strategy: str, options: dict[str, Any],
                                                        recording: str) -> None:
    trace = run(strategy, temperature=0.7, steps=2, recording=recording, **options)
    report = check(trace, detokenize=lambda ids: ByteTokenizer().decode(ids))
    assert report.ok, report.render()
    assert any(e.event_type == "step.denoised" for e in trace)


def test_check_catches_a_block_that_was_recomputed_or_written_wrong() -> None:
    trace = run()
    # A denoising pass that claims to have written the cache.
    broken = edit(trace, lambda e: e.event_type == "decode.completed"
                  and e.payload.get("write") is False and e.payload["step"] == 4,
                  lambda p: p.update(cache_len=p["cache_len"] + 4))
    assert 3 in check(broken).violated
    # A block write that does not hold the committed tokens.
    broken = edit(trace, lambda e: e.event_type == "decode.completed" and "write" not in
                  e.payload and e.payload["step"] == 4,
                  lambda p: p.update(token_ids=[1, 2, 3, 4]))
    report = check(broken)
    assert 3 in report.violated and "last 4 committed tokens" in report.render()
    # A committed token that the pass it came from did not hold.
    broken = edit(trace, is_("token.selected", 2), lambda p: p.update(token_id=7))
    assert 3 in check(broken).violated


def test_identical_runs_do_not_diverge() -> None:
    report = diff(run(temperature=0.8, seed=3), run(temperature=0.8, seed=3))
    assert report.divergence is None


@pytest.mark.parametrize("change,product", [
    ({"seed": 2}, "rng"),
    ({"steps": 2}, "denoised commits"),
    ({"remasking": "random"}, "denoised commits"),
    ({"block_length": 8}, "denoiser input"),
])
def test_diff_names_the_first_divergent_iteration(change: dict[str, Any], product: str
                                                  ) -> None:
    base: dict[str, Any] = {"seed": 1, "temperature": 0.8 if "seed" in change else 0.0}
    a, b = run(**base), run(**{**base, **change})
    report = diff(a, b)
    assert report.divergence is not None
    assert report.divergence.product == product
    k = first_divergent_iteration(a, b)
    assert f"iteration {k} " in report.divergence.detail
    declared = {key for key, _, _ in report.declared}
    for key in set(change) - {"seed"}:
        assert f"strategy.{key}" in declared


def test_a_later_divergence_is_found_at_its_iteration() -> None:
    """Banning the token the last pass committed changes nothing before the first pass
    that predicts it at a position it commits: the diff names that pass, not the first."""
    a = run(recording="full")
    last = [e for e in a if e.event_type == "step.denoised"][-1]
    b = run(recording="full", banned=(last.payload["ids"][0],))
    k = first_divergent_iteration(a, b)
    assert k > 1
    report = diff(a, b)
    assert report.divergence is not None
    assert report.divergence.product == "denoised commits"
    assert f"iteration {k} " in report.divergence.detail


def test_cli_diff_and_check_on_diffusion_traces(tmp_path: Path, capsys: Any) -> None:
    fa, fb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(sinks=(JsonlSink(fa),))
    run(steps=2, sinks=(JsonlSink(fb),))
    assert main(["trace", "check", str(fa)]) == 0
    assert "iterative strategy" in capsys.readouterr().out
    assert main(["trace", "diff", str(fa), str(fb), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["product"] == "denoised commits"
    assert "iteration 1 (block 0, pass 1)" in report["divergence"]["detail"]
    assert {"field": "strategy.steps", "a": 4, "b": 2} in report["declared"]
