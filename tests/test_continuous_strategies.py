"""The ``ddpm``, ``ddim`` and ``flow`` strategies end to end (issue 14, docs/design.md §10).

Oracles: the first block a run commits equals a direct computation with the training
scripts' model (one block-causal forward per step, the update rules of :mod:`updates`, the
same counter-based noise), so the engine's plumbing (cache, block attention, time and
self-conditioning, noise keys) adds nothing; seeded runs are identical alone and batched;
EOS, stop strings and ``max_tokens`` cut the committed text where they fall; streaming and
cancellation work mid-iteration; ``trace check`` passes and ``trace diff`` names the first
divergent iteration. Behaviour is tested on small randomly initialised models (fast, and
independent of how well the shipped ones learned); the shipped models are loaded by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import build
from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.events import Event
from pipeline.trace import check, diff
from pipeline.contracts.output import Completion
from pipeline.contracts.request import Recording
from stages.strategies.continuous.noise import gaussian
from stages.strategies.continuous.schedules import NoiseSchedule
from stages.strategies.continuous.updates import ddim_step, ddpm_step, uniform_grid
from test_continuous_backend import training_module

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEDULE = {"beta_schedule": "squaredcos_cap_v2", "num_train_timesteps": 1000}
L = 8


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random small denoiser saved twice: as a diffusion model and as a flow model."""
    ct = training_module()
    cfg = ct.TrainConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    torch.manual_seed(11)
    model = ct.Denoiser(cfg, vocab_size=6144)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    base = tmp_path_factory.mktemp("continuous")
    out = {"diffusion": base / "diffusion", "flow": base / "flow"}
    ct.save(model, cfg, out["diffusion"], {"family": "continuous_diffusion", "strategy": "ddim",
                                           "block_length": L, "steps": 5,
                                           "noise_schedule": SCHEDULE})
    ct.save(model, cfg, out["flow"], {"family": "flow", "strategy": "flow", "block_length": L,
                                      "steps": 4, "solver": "euler"})
    return out


def pipe_for(folders: dict[str, Path], strategy: str, **options: Any) -> Any:
    folder = folders["flow" if strategy == "flow" else "diffusion"]
    return build(folder, strategy=strategy, strategy_options=options,
                 options={"dtype": "float32", "pack": False})


def kinds(c: Completion, kind: str) -> list[Event]:
    return [e for e in c.trace if e.event_type == kind]


# --- the first block against a direct computation -------------------------------------------


def direct_first_block(folder: Path, prompt: list[int], seed: int, strategy: str,
                       steps: int, solver: str = "euler", eta: float = 0.0) -> list[int]:
    """Block 1 computed with the training model: no engine, no cache."""
    ct = training_module()
    from safetensors.torch import load_file

    cfg = ct.TrainConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2)
    model = ct.Denoiser(cfg, vocab_size=6144)
    ct.load_hf_state(model, load_file(folder / "model.safetensors"))
    m, d = len(prompt), cfg.hidden_size
    ids = torch.tensor([prompt + [0] * L])
    mask = ct.block_causal_mask(torch.tensor([[0] * m + [1] * L]))
    space = model.space().detach()
    x = gaussian(seed, 0, 1, 0, (L, d))
    x0_prev = None
    if strategy == "flow":
        grid = uniform_grid(steps)
        times = list(grid[:-1])
    else:
        schedule = NoiseSchedule.make(SCHEDULE["beta_schedule"], SCHEDULE["num_train_timesteps"])
        ts = schedule.timesteps(steps, "trailing")
        times = [t / 1000 for t in ts]
    logits = None
    with torch.no_grad():
        for i, time in enumerate(times):
            x_t = torch.cat([torch.zeros(m, d), x])[None]
            sc = None if x0_prev is None else torch.cat([torch.zeros(m, d), x0_prev])[None]
            logits = model(ids, x_t, torch.full((1, m + L), time), sc, mask)[0, m:]
            x0 = logits.softmax(-1) @ space
            if strategy == "flow":
                x = x + (grid[i + 1] - grid[i]) * (x0 - x) / (1 - time)
            else:
                t, prev = ts[i], (ts[i + 1] if i + 1 < len(ts) else -1)
                a, ap = schedule.alpha_bar(t), schedule.alpha_bar(prev)
                noise = gaussian(seed, 0, 1, i + 1, (L, d)) if prev >= 0 else None
                x = (ddpm_step(x, x0, a, ap, noise) if strategy == "ddpm"
                     else ddim_step(x, x0, a, ap, eta, noise))
            x0_prev = x0
    assert logits is not None
    return [int(t) for t in logits.argmax(-1).tolist()]


@pytest.mark.parametrize("strategy,options", [
    ("ddim", {}), ("ddim", {"eta": 0.7}), ("ddpm", {}), ("flow", {})])
def test_first_block_equals_a_direct_computation(folders: dict[str, Path], strategy: str,
                                                 options: dict[str, Any]) -> None:
    with pipe_for(folders, strategy, **options) as pipe:
        c = pipe.generate("Tell me about lists.", max_tokens=L, seed=5, ignore_eos=True,
                          recording=Recording.FULL)
    prompt = kinds(c, "input.tokenized")[0].payload["input_ids"]
    seed = kinds(c, "selection.configured")[0].payload["seed"]
    steps = 4 if strategy == "flow" else 5
    want = direct_first_block(folders["flow" if strategy == "flow" else "diffusion"], prompt,
                              seed, strategy, steps, eta=options.get("eta", 0.0))
    assert list(c.token_ids) == want


# --- the engine's face ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddpm", "flow"])
def test_seeded_runs_are_identical_alone_and_batched(folders: dict[str, Path],
                                                     strategy: str) -> None:
    prompts = ["What is a tuple?", "Explain the with statement.", "What does len do?"]
    with pipe_for(folders, strategy) as pipe:
        alone = [pipe.generate(p, max_tokens=12, seed=i, ignore_eos=True).token_ids
                 for i, p in enumerate(prompts)]
        handles = [pipe.submit(p, max_tokens=12, seed=i, ignore_eos=True)
                   for i, p in enumerate(prompts)]
        batched = [h.result().token_ids for h in handles]
        other = pipe.generate(prompts[0], max_tokens=12, seed=99, ignore_eos=True).token_ids
    assert batched == alone
    assert other != alone[0]


def test_max_tokens_cuts_the_last_block(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "ddim") as pipe:
        c = pipe.generate("hi", max_tokens=11, seed=1, ignore_eos=True)
    assert len(c.token_ids) == 11 and c.finish_reason.value == "length"
    lengths = [e.payload["length"] for e in kinds(c, "step.iteration")]
    assert lengths == [L] * 5 + [3] * 5                   # two blocks of 5 steps each
    assert check(c).ok


def test_stop_token_and_stop_string_end_the_committed_text(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "ddim") as pipe:
        free = pipe.generate("hi", max_tokens=24, seed=3, ignore_eos=True)
        ids = list(free.token_ids)
        k = next(i for i in range(10, 24) if ids[i] not in ids[:i])   # first occurrence
        by_token = pipe.generate("hi", max_tokens=24, seed=3, stop_token_ids=[ids[k]])
        stop = free.text[len(free.text) // 2:len(free.text) // 2 + 5]
        by_string = pipe.generate("hi", max_tokens=24, seed=3, ignore_eos=True, stop=[stop])
    assert list(by_token.token_ids) == ids[:k + 1]
    assert by_token.finish_reason.value == "stop_token"
    assert free.text.startswith(by_token.text)             # the stop token's text is not kept
    assert by_string.text == free.text[:free.text.find(stop)]
    assert by_string.finish_reason.value == "stop_string"
    for c in (free, by_token, by_string):
        assert check(c).ok, check(c).render()


def test_stream_delivers_each_block_when_it_is_final(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "flow") as pipe:
        deltas = list(pipe.stream("Describe sets.", max_tokens=20, seed=2, ignore_eos=True))
        done = pipe.generate("Describe sets.", max_tokens=20, seed=2, ignore_eos=True)
    assert "".join(d.text for d in deltas) == done.text
    assert sum(len(d.token_ids) for d in deltas) == 20
    # Every token of a block is selected after the block's last pass, before the next block's
    # first: committed text streams as blocks finish.
    order = [(e.event_type, e.payload.get("block", e.payload.get("step")))
             for e in done.trace if e.event_type in ("step.iteration", "token.selected")]
    blocks = [payload for kind, payload in order if kind == "step.iteration"]
    assert blocks == sorted(blocks) and set(blocks) == {0, 1, 2}
    seen_block = -1
    for kind, value in order:
        if kind == "step.iteration":
            seen_block = value
        else:
            assert (value - 1) // L == seen_block         # token t belongs to the open block


class CancelAfter:
    """A sink that signals once it has seen ``n`` denoising passes."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.event = n, 0, threading.Event()

    def emit(self, event: Event) -> None:
        if event.event_type == "step.iteration":
            self.seen += 1
            if self.seen >= self.n:
                self.event.set()

    def close(self) -> None:
        pass


def test_cancel_mid_iteration_frees_the_slot(folders: dict[str, Path]) -> None:
    sink = CancelAfter(3)
    folder = folders["diffusion"]
    with build(folder, strategy="ddim", strategy_options={"steps": 400}, sinks=[sink],
               options={"num_slots": 1, "dtype": "float32", "pack": False}) as pipe:
        handle = pipe.submit("hi", max_tokens=16, seed=1, ignore_eos=True)
        assert sink.event.wait(60)
        handle.cancel()
        c = handle.result(60)
        assert c.finish_reason.value == "cancelled" and c.token_ids == ()
        passes = len(kinds(c, "step.iteration"))
        assert 3 <= passes < 400
        assert check(c).ok
        after = pipe.generate("hi", max_tokens=4, seed=1, ignore_eos=True)  # the slot is free
        assert len(after.token_ids) == 4


def test_forced_tokens_are_refused_clearly(folders: dict[str, Path]) -> None:
    """Refused at submit (the strategy's ``honours``), before anything is queued."""
    with pipe_for(folders, "ddim") as pipe:
        with pytest.raises(InvalidValueError, match="cannot force output tokens") as caught:
            pipe.submit("hi", max_tokens=4, forced_prefix=[5, 6])
        assert caught.value.field == "forced_prefix"
        with pytest.raises(InvalidValueError, match="cannot force output tokens") as caught:
            pipe.submit("hi", max_tokens=4, reasoning_budget_tokens=2)
        assert caught.value.field == "reasoning_budget_tokens"
        assert pipe.generate("hi", max_tokens=2, seed=1, ignore_eos=True).token_ids


def test_logprobs_are_those_of_the_final_distribution(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "ddim") as pipe:
        c = pipe.generate("hi", max_tokens=10, seed=4, ignore_eos=True, logprobs=True,
                          top_logprobs=2)
    assert c.logprobs is not None and len(c.logprobs) == 10
    for token, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert lp.top[0].token_id == token                 # rounding by logits is the argmax
        assert lp.top[0].logprob == pytest.approx(lp.logprob)


def test_heun_makes_two_calls_per_interval_but_the_last(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "flow", solver="heun", steps=4) as heun:
        c = heun.generate("hi", max_tokens=L, seed=1, ignore_eos=True)
    times = [e.payload["time"] for e in kinds(c, "step.iteration")]
    assert times == [0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75]
    assert check(c).ok


def test_nearest_rounding_picks_embeddings(folders: dict[str, Path]) -> None:
    with pipe_for(folders, "ddim", rounding="nearest") as pipe:
        c = pipe.generate("hi", max_tokens=L, seed=1, ignore_eos=True)
    rounded = kinds(c, "step.rounded")
    assert rounded and rounded[0].payload["rounding"] == "nearest"
    assert len(c.token_ids) == L and check(c).ok


# --- traces ---------------------------------------------------------------------------------


def run(folders: dict[str, Path], strategy: str, seed: int, **options: Any) -> Completion:
    with pipe_for(folders, strategy, **options) as pipe:
        return pipe.generate("Tell me about loops.", max_tokens=12, seed=seed,
                             ignore_eos=True)


@pytest.mark.parametrize("strategy", ["ddim", "flow"])
def test_trace_diff_names_the_first_divergent_iteration(folders: dict[str, Path],
                                                        strategy: str) -> None:
    base = run(folders, strategy, 1)
    assert diff(base, run(folders, strategy, 1)).divergence is None
    by_seed = diff(base, run(folders, strategy, 2)).divergence
    assert by_seed is not None and by_seed.product == "iteration state"
    assert by_seed.step == 1 and "iteration 1 of the block at token 1" in by_seed.detail
    by_steps = diff(base, run(folders, strategy, 1, steps=8)).divergence
    assert by_steps is not None and by_steps.product == "iteration time"
    assert "iteration 2 of the block at token 1" in by_steps.detail   # the first pass agrees


def test_trace_diff_finds_a_later_block(folders: dict[str, Path]) -> None:
    """Runs that share block 1 and differ from block 2 on (max_tokens cuts it shorter)."""
    with pipe_for(folders, "ddpm") as pipe:
        a = pipe.generate("hi", max_tokens=12, seed=1, ignore_eos=True)
        b = pipe.generate("hi", max_tokens=10, seed=1, ignore_eos=True)
    found = diff(a, b).divergence
    assert found is not None and found.step == L + 1 and found.product == "block length"
    assert found.a == 4 and found.b == 2
    assert "iteration 1 of the block at token 9" in found.detail


# --- options --------------------------------------------------------------------------------


def test_options_are_checked_at_build(folders: dict[str, Path]) -> None:
    with pytest.raises(UnknownFieldError, match="solver"):
        pipe_for(folders, "ddim", solver="heun")
    with pytest.raises(UnknownFieldError, match="eta"):
        pipe_for(folders, "flow", eta=0.5)
    with pytest.raises(InvalidValueError, match="ddim.eta"):
        pipe_for(folders, "ddim", eta=2)
    with pytest.raises(InvalidValueError, match="steps"):
        pipe_for(folders, "ddpm", steps=0)
    with pytest.raises(InvalidValueError, match="flow.solver"):
        pipe_for(folders, "flow", solver="rk4")
    with pytest.raises(InvalidValueError, match="block_length"):
        pipe_for(folders, "flow", block_length=0)
    with pytest.raises(InvalidValueError, match="family 'flow'"):
        build(folders["diffusion"], strategy="flow")
    with pytest.raises(InvalidValueError, match="family 'continuous_diffusion'"):
        build("tiny", strategy="ddim")


# --- the shipped models ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=["tiny-continuous", "tiny-flow"])
def shipped(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    name = request.param
    strategy = "ddim" if name == "tiny-continuous" else "flow"
    with build(name, strategy=strategy) as pipe:
        yield strategy, pipe


def test_shipped_models_generate_and_their_traces_check(shipped: tuple[str, Any]) -> None:
    strategy, pipe = shipped
    c = pipe.generate("What is the os module?", max_tokens=32, seed=0)
    assert c.token_ids and c.text.strip()
    assert kinds(c, "selection.configured")[0].payload["strategy"] == strategy
    assert check(c).ok, check(c).render()


def test_preempted_requests_resume_where_they_were(folders: dict[str, Path]) -> None:
    """A pool too small for every request at once makes the engine preempt some by
    recompute, mid-block; each still commits exactly what it commits alone."""
    prompts = [f"Question number {i}: what is {w}?" for i, w in
               enumerate(["a list", "a dict", "a set", "a tuple", "a class", "a module"])]
    folder = folders["diffusion"]
    small = {"dtype": "float32", "pack": False, "block_size": 4, "max_context": 64,
             "num_slots": 4, "kv_blocks": 16}
    with build(folder, strategy="ddim", options={**small, "num_slots": 1}) as pipe:
        alone = [pipe.generate(p, max_tokens=20, seed=i, ignore_eos=True).token_ids
                 for i, p in enumerate(prompts)]
    with build(folder, strategy="ddim", options=small) as pipe:
        handles = [pipe.submit(p, max_tokens=20, seed=i, ignore_eos=True)
                   for i, p in enumerate(prompts)]
        done = [h.result(120) for h in handles]
    assert any(kinds(c, "preempted") for c in done), "the pool was meant to force preemption"
    assert [c.token_ids for c in done] == alone
    for c in done:
        assert check(c).ok, check(c).render()


def test_trace_cli_checks_and_diffs_shipped_model_runs(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """``pipeline trace check`` / ``diff`` on JSONL traces of the shipped flow model."""
    from transports import cli
    from pipeline.events import event_line

    files = []
    with build("tiny-flow", strategy="flow") as sixteen, \
            build("tiny-flow", strategy="flow", strategy_options={"steps": 8}) as eight:
        for name, pipe in (("a", sixteen), ("b", eight)):
            done = pipe.generate("What is a list?", max_tokens=20, seed=4,
                                 recording=Recording.FULL)
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(event_line(e) + "\n" for e in done.trace))
            files.append(str(path))
    assert cli.main(["trace", "check", files[0]]) == 0
    capsys.readouterr()
    assert cli.main(["trace", "diff", files[0], files[1]]) == 1
    out = capsys.readouterr().out
    assert "earliest internal difference: iteration time at step 1" in out
    assert "iteration 2 of the block at token 1 (16 vs 8 per block)" in out
