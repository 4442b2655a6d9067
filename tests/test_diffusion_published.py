"""The masked- and continuous-diffusion samplers as published (issue 21), and their traces.

Oracles, each independent of the code under test:

- confidence: LLaDA's ``low_confidence`` remasking written out here (``x0 = argmax(logits/T +
  Gumbel)``, ``conf = softmax(model logits)[x0]``, commit the top-k), and a closed form for
  Fast-dLLM: when every raw probability is at most 0.8 no position clears a 0.9 threshold, so
  each pass commits exactly one position, although the processed (T = 0.5) probability of
  the likely token is 0.64 / 0.68 = 0.94;
- ``dfm``: the discrete Euler solver written out here with a model call on every pass; the
  saved calls are exactly its passes that commit nothing (the block they feed is the one
  just fed), and with κ = t² the first pass's jump probability is 1 - exp(0) = 0;
- the model marker's ``attention`` and LLaDA's unimplemented options: refused by name;
- determinism at temperature 0 without a seed: two requests (two request ids) agree;
- the trace: ``step.configured`` of the continuous strategies against the options given;
  ``trace diff`` shows the committed tokens, and blames a settings change before the seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import build
from pipeline.errors import ArtifactError, InvalidValueError, UnknownFieldError
from pipeline.events import Event
from pipeline.contracts.forcing import Forcing
from pipeline.model_paths import TINY_MASKED_MODEL_DIR, generation_marker
from pipeline.contracts.decode import Row
from pipeline.contracts.model import Attention
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_denoiser, \
    hashed_logits
from pipeline.trace import check, diff
from pipeline.contracts.request import GenerationConfig
from stages.process import make_processor
from tests.trace_runs import edit
from stages.strategies.diffusion import (
    DiffusionSettings, DiscreteFlowStrategy, FastDllmStrategy, LladaStrategy,
    MaskedDiffusionStrategy, uniforms,
)

V = 16
MASK = 15
VOCAB = ByteTokenizer.VOCAB + 1
MASK_BYTE = ByteTokenizer.VOCAB


def row(seed: int | None = 7, temperature: float = 0.0, derived: int = 99) -> Row:
    config = GenerationConfig(max_tokens=64, temperature=temperature, seed=seed)
    return Row("r", config, (1, 2, 3), (), 1, derived if seed is None else seed,
               frozenset({0}))


def settings(**kw: Any) -> DiffusionSettings:
    return DiffusionSettings(mask_token_id=MASK, **kw)


def two_way(p: float, a: int = 3, b: int = 4) -> torch.Tensor:
    """``[V]`` logits: token a with probability p, token b with 1 - p, the rest ~0."""
    z = torch.full((V,), -40.0, dtype=torch.float64)
    z[a], z[b] = math.log(p), math.log(1 - p)
    return z


def open_block(strategy: MaskedDiffusionStrategy, r: Row) -> Any:
    state = strategy.start(r, Forcing.none())
    assert strategy.update([state], [r], [torch.zeros(1, V)])[0].taken == ()
    return state


# --- 1. confidence is the model's probability, not the processed one ----------------------


def test_fast_dllm_threshold_reads_the_raw_probability() -> None:
    """Raw: p(a) = 0.8, p(b) = 0.2 at every position, so no confidence exceeds 0.9 and each
    pass commits exactly one position (Fast-dLLM's "at least one"). At T = 0.5 the processed
    p(a) is 0.64 / 0.68 = 0.941 > 0.9: a rule reading it would commit several per pass."""
    length, temperature = 8, 0.5
    logits = two_way(0.8).repeat(length, 1).float()
    processed_pa = 0.8 ** 2 / (0.8 ** 2 + 0.2 ** 2)
    assert processed_pa > 0.9
    for seed in range(5):
        r = row(seed, temperature)
        fast = FastDllmStrategy([make_processor("temperature")],
                                settings(block_length=length, steps=length, threshold=0.9))
        state = open_block(fast, r)
        committed = []
        for _ in range(length):
            update = fast.update([state], [r], [logits])[0]
            committed += [p["committed"] for t, p in update.events if t == "step.denoised"]
            if update.taken:
                break
        assert committed == [1] * length


def llada_reference(raw: torch.Tensor, temperature: float, seed: int, k: int,
                    processed_confidence: bool = False) -> list[int]:
    """LLaDA ``generate.py``, one step, low_confidence: Gumbel-max on the tempered logits
    (the mask never predicted), confidence from the softmax of the model's own logits (or,
    to show that the test tells them apart, of the tempered ones)."""
    scores = raw.double() / temperature
    scores[:, MASK] = float("-inf")
    u = uniforms(seed, 0, 0, tuple(raw.shape))
    x0 = (scores - torch.log(-torch.log(u))).argmax(-1)
    read = scores if processed_confidence else raw.double()
    conf = torch.softmax(read, -1).gather(-1, x0[:, None])[:, 0]
    return sorted(int(j) for j in torch.sort(conf, descending=True, stable=True).indices[:k])


def test_llada_ranks_positions_by_the_model_probability() -> None:
    """Position 0: p = 0.55 on one token, 0.45 spread over 14 (processed at T = 0.5: 0.95);
    position 1: 0.6 / 0.4 over two (processed: 0.69). The raw order (1 before 0) and the
    processed order (0 before 1) disagree; the pass must follow the raw one, as LLaDA does."""
    spread = torch.full((V,), math.log(0.45 / 14), dtype=torch.float64)
    spread[5], spread[MASK] = math.log(0.55), -40.0
    raw = torch.stack([spread, two_way(0.6)]).float()
    temperature, differs = 0.5, 0
    for seed in range(40):
        r = row(seed, temperature)
        llada = LladaStrategy([make_processor("temperature")], settings(block_length=2, steps=2))
        state = open_block(llada, r)
        update = llada.update([state], [r], [raw])[0]
        positions = next(p["positions"] for t, p in update.events if t == "step.denoised")
        assert positions == llada_reference(raw, temperature, seed, 1)
        differs += positions != llada_reference(raw, temperature, seed, 1, True)
    assert differs > 0  # the two readings do part on these seeds


# --- 3. dfm: passes that commit nothing reuse the logits --------------------------------


def block_denoiser(calls: list[int]) -> Any:
    """Logits that depend on the whole block (stale logits would show), counting calls."""
    def logits_of(block: list[int]) -> torch.Tensor:
        calls.append(1)
        key = hashlib.sha256(repr(block).encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        return torch.randn(len(block), V, generator=gen) * 2
    return logits_of


def dfm_reference(length: int, steps: int, power: float, seed: int, temperature: float
                  ) -> tuple[list[int], int, int]:
    """``MixtureDiscreteEulerSolver`` with a mask source, a model call on every step: the
    final block, the calls made, and the steps that committed nothing."""
    calls: list[int] = []
    model = block_denoiser(calls)
    block, h, empty = [MASK] * length, 1.0 / steps, 0
    for i in range(steps):
        z = model(block).double()
        z[:, MASK] = float("-inf")
        if temperature > 0:
            gumbel = -torch.log(-torch.log(uniforms(seed, 0, 4 * i, (length, V))))
            x1 = (z / temperature + gumbel).argmax(-1)
        else:
            x1 = z.argmax(-1)
        t = i * h
        kappa, dkappa = t ** power, power * t ** (power - 1) if t > 0 or power >= 1 else 0.0
        p = 1.0 if i == steps - 1 else 1 - math.exp(-h * dkappa / (1 - kappa))
        u = uniforms(seed, 0, 4 * i + 2, (length,))
        jump = [block[j] == MASK and (i == steps - 1 or float(u[j]) < p)
                for j in range(length)]
        empty += not any(jump)
        block = [int(x1[j]) if jump[j] else block[j] for j in range(length)]
    return block, len(calls), empty


@pytest.mark.parametrize("power,temperature", [(1.0, 1.0), (2.0, 1.0), (3.0, 0.0)])
def test_dfm_reuses_logits_and_matches_the_solver_that_calls_every_step(
        power: float, temperature: float) -> None:
    length, steps = 12, 8
    saved = 0
    for seed in range(6):
        want, ref_calls, empty = dfm_reference(length, steps, power, seed, temperature)
        r = row(seed, temperature)
        chain = [make_processor("temperature")] if temperature > 0 else []
        dfm = DiscreteFlowStrategy(chain, settings(block_length=length, steps=steps,
                                                   kappa_power=power))
        state = open_block(dfm, r)
        calls: list[int] = []
        model = block_denoiser(calls)
        events = []
        while True:
            update = dfm.update([state], [r], [model(list(dfm.plan(state).token_ids))])[0]
            events += [p for t, p in update.events if t == "step.denoised"]
            if update.taken:
                break
        assert [t.token_id for t in update.taken] == want
        assert len(events) == ref_calls == steps
        assert len(calls) == ref_calls - empty        # one call per block state fed
        assert [e["reused"] for e in events] == [
            k > 0 and events[k - 1]["committed"] == 0 for k in range(len(events))]
        final = next(p for t, p in update.events if t == "step.block_final")
        assert final["forwards"] == len(calls) and final["passes"] == steps
        saved += empty
        if power > 1:  # κ'(0) = 0: the first pass cannot commit, the second reuses its call
            assert events[0]["committed"] == 0 and events[1]["reused"]
    assert saved > 0


def denoiser_backend() -> ScriptedBackend:
    return ScriptedBackend(VOCAB, hashed_logits(VOCAB), denoise=hashed_denoiser(VOCAB))


def scripted(backend: ScriptedBackend, strategy: str = "dfm", **kw: Any) -> Any:
    options = {"mask_token_id": MASK_BYTE, **kw.pop("options", {})}
    return build_scripted(backend, strategy=strategy, strategy_options=options, **kw)


def test_dfm_in_the_engine_skips_the_forwards_and_its_trace_checks() -> None:
    backend = denoiser_backend()
    with scripted(backend, block_length=4, steps=4, options={"kappa_power": 2.0}) as pipe:
        done = pipe.generate("hi", GenerationConfig(max_tokens=12, temperature=0.8, seed=3,
                                                    banned_token_ids=(256,)))
    trace = list(done.trace)
    passes = [e.payload for e in trace if e.event_type == "step.denoised"]
    denoise_calls = [c for c in backend.model_calls if c.attention is Attention.BLOCK]
    assert len(denoise_calls) == sum(not p["reused"] for p in passes)
    assert len(denoise_calls) == sum(p["committed"] > 0 for p in passes)
    assert all(p["reused"] for p in passes if p["block_step"] == 2)   # κ'(0) = 0
    report = check(trace, detokenize=lambda ids: ByteTokenizer().decode(ids))
    assert report.ok, report.render()


def test_check_refuses_a_reused_pass_whose_logits_are_stale() -> None:
    with scripted(denoiser_backend(), block_length=4, steps=4,
                  options={"kappa_power": 2.0}) as pipe:
        done = pipe.generate("hi", GenerationConfig(max_tokens=8, temperature=0.8, seed=3,
                                                    banned_token_ids=(256,)))
    events = list(done.trace)
    assert check(events).ok
    broken = edit(events, lambda e: e.event_type == "step.denoised",
                  lambda p: p.update(committed=1))
    report = check(broken)
    assert 3 in report.violated and "stale" in report.render()


# --- 2. the model marker and LLaDA's other options ----------------------------------------


def marked(tmp_path: Path, attention: Any) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for item in TINY_MASKED_MODEL_DIR.iterdir():
        if item.is_file() and item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((TINY_MASKED_MODEL_DIR / "config.json").read_text())
    if attention is None:
        del config["pipeline_generation"]["attention"]
    else:
        config["pipeline_generation"]["attention"] = attention
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("attention", ["bidirectional", "full", "causal", 3])
def test_a_marker_asking_for_other_attention_is_refused_at_build(tmp_path: Path,
                                                                  attention: Any) -> None:
    folder = marked(tmp_path, attention)
    with pytest.raises(ArtifactError, match=r"pipeline_generation\.attention=.*accepted: "
                                            r"'block_causal'"):
        build(folder)
    with pytest.raises(ArtifactError, match="attention"):
        build(folder, strategy="fast_dllm")


@pytest.mark.parametrize("attention", ["block_causal", None])
def test_a_block_causal_marker_or_none_is_accepted(tmp_path: Path, attention: Any) -> None:
    marker = generation_marker(marked(tmp_path, attention))
    assert marker is not None and marker["family"] == "masked_diffusion"


@pytest.mark.parametrize("option", ["cfg_scale", "confidence_eos_eot_inf"])
def test_llada_options_not_implemented_are_refused_by_name(option: str) -> None:
    with pytest.raises(InvalidValueError, match=f"strategy_options.{option}=.*not implemented"):
        scripted(denoiser_backend(), "llada", options={option: 1.0})


def test_logits_eos_inf_is_checked() -> None:
    with pytest.raises(InvalidValueError, match="logits_eos_inf=1: must be bool"):
        scripted(denoiser_backend(), "llada", options={"logits_eos_inf": 1})
    with pytest.raises(UnknownFieldError, match="logits_eos_inf"):
        scripted(denoiser_backend(), "fast_dllm", options={"logits_eos_inf": True})


@pytest.mark.parametrize("eos_inf", [False, True])
def test_logits_eos_inf_is_llada_setting_the_eos_logit_to_minus_infinity(eos_inf: bool
                                                                         ) -> None:
    """Position 0: p(EOS) = 0.5, p(a) = 0.3, p(b) = 0.2; position 1: p(c) = 0.55. LLaDA
    (greedy) commits position 1 first (0.55 > 0.5); with ``logits_eos_inf`` position 0
    predicts a with confidence 0.3 / 0.5 = 0.6 > 0.55 and goes first."""
    eos = 0
    p0 = torch.full((V,), 1e-12, dtype=torch.float64)
    p0[eos], p0[3], p0[4] = 0.5, 0.3, 0.2
    p1 = torch.full((V,), 0.45 / (V - 2), dtype=torch.float64)
    p1[6], p1[MASK] = 0.55, 1e-12
    raw = torch.log(torch.stack([p0, p1])).float()
    # The reference, written out: generate.py with temperature 0, steps = 2, one block.
    ref = raw.double().clone()
    if eos_inf:
        ref[:, eos] = float("-inf")
    x0 = ref.argmax(-1)
    conf = torch.softmax(ref, -1).gather(-1, x0[:, None])[:, 0]
    first = int(conf.argmax())
    assert first == (0 if eos_inf else 1)
    r = row(None)  # its end-of-sequence ids: {0}
    llada = LladaStrategy([], settings(block_length=2, steps=2, logits_eos_inf=eos_inf))
    state = open_block(llada, r)
    update = llada.update([state], [r], [raw])[0]
    event = next(p for t, p in update.events if t == "step.denoised")
    assert event["positions"] == [first] and event["ids"] == [int(x0[first])]


# --- 4. temperature 0 is deterministic; the traces declare it ------------------------------


@pytest.mark.parametrize("strategy,options,kind", [
    ("dfm", {}, "fixed"), ("llada", {"remasking": "random"}, "fixed"), ("llada", {}, None)])
def test_greedy_runs_without_a_seed_are_deterministic(strategy: str, options: dict[str, Any],
                                                      kind: str | None) -> None:
    with scripted(denoiser_backend(), strategy, block_length=4, steps=2,
                  options=options) as pipe:
        config = GenerationConfig(max_tokens=12, temperature=0.0, banned_token_ids=(256,))
        runs = [pipe.generate("hello", config) for _ in range(3)]
        sampled = [pipe.generate("hello", GenerationConfig(
            max_tokens=12, temperature=1.0, banned_token_ids=(256,))) for _ in range(3)]
    assert len({r.request_id for r in runs}) == 3
    assert len({r.token_ids for r in runs}) == 1
    configured = [e.payload for e in runs[0].trace if e.event_type == "step.configured"][0]
    assert configured.get("noise") == kind
    if kind == "fixed":
        assert configured["noise_seed"] == 0
    assert len({r.token_ids for r in sampled}) > 1        # no seed, sampling: per request
    noise = [e.payload for e in sampled[0].trace if e.event_type == "step.configured"][0]
    assert noise["noise"] == "request" and "noise_seed" not in noise


# --- 4. the differ ---------------------------------------------------------------------


def run(strategy: str = "llada", *, seed: int = 1, temperature: float = 0.0,
        recording: str = "digest", **options: Any) -> list[Event]:
    with scripted(denoiser_backend(), strategy, block_length=4, steps=4,
                  options=options) as pipe:
        done = pipe.generate("hello", GenerationConfig(
            max_tokens=12, temperature=temperature, seed=seed,
            allowed_token_ids=tuple(range(97, 123))), recording=recording)
    return list(done.trace)


def tokens_at(trace: list[Event], k: int) -> tuple[list[int], list[int]]:
    """Pass k's positions and the tokens finally committed there (the oracle)."""
    p = [e.payload for e in trace if e.event_type == "step.denoised"][k - 1]
    selected = {e.payload["step"]: e.payload["token_id"] for e in trace
                if e.event_type == "token.selected"}
    return p["positions"], [selected[p["step"] + j] for j in p["positions"]]


@pytest.mark.parametrize("recording", ["digest", "full"])
def test_diff_shows_the_tokens_two_seeds_committed(recording: str) -> None:
    a = run(seed=1, temperature=0.9, recording=recording)
    b = run(seed=2, temperature=0.9, recording=recording)
    found = diff(a, b).divergence
    assert found is not None and found.product == "rng"
    k = int(found.detail.split("iteration ")[1].split(" ")[0])
    for trace in (a, b):
        positions, ids = tokens_at(trace, k)
        assert f"{positions} = {ids}" in found.detail


def test_diff_blames_a_settings_change_before_the_seed() -> None:
    a = run(seed=1, temperature=0.9)
    b = run(seed=2, temperature=0.9, remasking="random")
    found = diff(a, b).divergence
    assert found is not None and found.product == "denoised commits"
    assert "remasking 'low_confidence' vs 'random'" in found.detail


def test_continuous_diff_names_the_settings_behind_a_state_change() -> None:
    """DDIM with eta 0 and 0.5 from the same seed: the first call agrees, the state after
    it does not (eta's noise), and the diff says which setting moved it."""
    runs = []
    for eta in (0.0, 0.5):
        with build("tiny-continuous", strategy="ddim", steps=3, block_length=4,
                   strategy_options={"eta": eta}) as pipe:
            runs.append(pipe.generate("hi", max_tokens=4, seed=1, ignore_eos=True))
    report = diff(*runs)
    assert ("strategy.eta", 0.0, 0.5) in report.declared
    found = report.divergence
    assert found is not None and found.product == "iteration state"
    assert "iteration 2 of the block at token 1" in found.detail
    assert "settings differ (eta 0.0 vs 0.5)" in found.detail


@pytest.fixture(scope="module")
def flow_runs() -> list[Any]:
    with build("tiny-flow", strategy="flow", steps=2, block_length=4) as pipe:
        return [pipe.generate("hi", max_tokens=4, temperature=0, ignore_eos=True)
                for _ in range(2)] + [pipe.generate("hi", max_tokens=4, ignore_eos=True)
                                      for _ in range(2)]


def test_continuous_greedy_runs_without_a_seed_are_deterministic(flow_runs: list[Any]
                                                                 ) -> None:
    greedy, sampled = flow_runs[:2], flow_runs[2:]
    assert greedy[0].token_ids == greedy[1].token_ids
    assert diff(greedy[0], greedy[1]).divergence is None
    configured = [e.payload for e in greedy[0].trace if e.event_type == "step.configured"]
    assert configured[0]["noise"] == "fixed" and configured[0]["noise_seed"] == 0
    found = diff(sampled[0], sampled[1]).divergence
    assert found is not None and found.product == "iteration state"
    assert "the noise seeds differ" in found.detail


@pytest.mark.parametrize("strategy,options,extra", [
    ("flow", {"solver": "heun", "steps": 4}, {"rule": "heun", "calls": 2 * 4 - 1,
                                               "solver": "heun"}),
    ("ddim", {"eta": 0.25, "steps": 3, "spacing": "leading"},
     {"rule": "ddim", "calls": 3, "eta": 0.25, "spacing": "leading"}),
    ("ddpm", {"steps": 2, "rounding": "nearest"}, {"rule": "ddpm", "calls": 2,
                                                    "spacing": "trailing"}),
])
def test_continuous_strategies_declare_their_settings(strategy: str, options: dict[str, Any],
                                                      extra: dict[str, Any]) -> None:
    model = "tiny-flow" if strategy == "flow" else "tiny-continuous"
    with build(model, strategy=strategy, strategy_options={"block_length": 4, **options}
               ) as pipe:
        done = pipe.generate("hi", max_tokens=4, seed=3, ignore_eos=True)
    configured = [e.payload for e in done.trace if e.event_type == "step.configured"]
    assert len(configured) == 1
    want = {"step": 1, "sampler": strategy, "block_length": 4, "self_condition": True,
            "rounding": options.get("rounding", "logits"), "steps": options["steps"],
            "noise": "seeded", **extra}
    assert configured[0] == want
