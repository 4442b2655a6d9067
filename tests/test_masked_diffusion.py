"""Masked-diffusion samplers on scripted denoisers with known per-position distributions.

Oracles: LLaDA's ``get_num_transfer_tokens`` written out here from its reference code; the
ranking of known confidences; the threshold rule applied by hand; discrete flow matching's
jump probability ``1 - exp(-h dκ/(1-κ))`` computed here; the analytic softmax distribution a
Gumbel-max draw must follow; solo runs for batched ones; the backend's own log of calls for
the KV reuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from pipeline.errors import InvalidValueError, UnknownFieldError
from pipeline.contracts.forcing import Forcing
from pipeline.contracts.decode import Row
from pipeline.contracts.model import Attention
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_denoiser, \
    hashed_logits
from pipeline.contracts.request import GenerationConfig
from stages.process import make_processor
from stages.strategies.diffusion import (
    DiffusionSettings, DiscreteFlowStrategy, FastDllmStrategy, LladaStrategy,
    MaskedDiffusionStrategy, uniforms,
)
from stages.strategies.diffusion.rules import num_transfer_tokens

V = 16
MASK = 15


def llada_schedule(masked: int, steps: int) -> list[int]:
    """LLaDA's ``get_num_transfer_tokens`` for one row, as its reference code writes it."""
    mask_num = torch.tensor([[masked]])
    base = mask_num // steps
    remainder = mask_num % steps
    out = torch.zeros(1, steps, dtype=torch.int64) + base
    for i in range(1):
        out[i, :remainder[i]] += 1
    return out[0].tolist()


def make_row(seed: int | None = 7, temperature: float = 0.0, max_tokens: int = 64,
             derived: int = 99) -> Row:
    """A request's row; ``seed=None`` is a request without a seed, whose row carries the
    seed ``derived`` from its id."""
    config = GenerationConfig(max_tokens=max_tokens, temperature=temperature, seed=seed)
    return Row("r", config, (1, 2, 3), (), 1, derived if seed is None else seed,
               frozenset({0}))


def confidence_logits(conf: Sequence[float], tokens: Sequence[int]) -> torch.Tensor:
    """``[L, V]`` logits whose softmax gives ``tokens[j]`` probability ``conf[j]`` and
    spreads the rest evenly over the other non-mask tokens."""
    rows = []
    for c, t in zip(conf, tokens):
        p = torch.full((V,), (1 - c) / (V - 2), dtype=torch.float64)
        p[t], p[MASK] = c, 0.0
        rows.append(torch.log(p))
    return torch.stack(rows).float()


def run_block(strategy: MaskedDiffusionStrategy, row: Row,
              logits_of: Callable[[list[int]], torch.Tensor]) -> list[dict[str, object]]:
    """Open a block, then denoise until it is final; the ``step.denoised`` payloads."""
    state = strategy.start(row, Forcing.none())
    update = strategy.update([state], [row], [torch.zeros(1, V)])[0]
    assert update.taken == ()
    events = []
    while True:
        plan = strategy.plan(state)
        assert plan.attention is Attention.BLOCK and not plan.write
        update = strategy.update([state], [row], [logits_of(list(plan.token_ids))])[0]
        events += [p for t, p in update.events if t == "step.denoised"]
        if update.taken:
            assert [t.token_id for t in update.taken] == state.block
            return events


def settings(**kw: object) -> DiffusionSettings:
    return DiffusionSettings(mask_token_id=MASK, **kw)  # type: ignore[arg-type]


# --- the schedule ------------------------------------------------------------------------


@pytest.mark.parametrize("masked,steps", [(10, 4), (8, 8), (32, 5), (7, 1), (16, 3)])
def test_schedule_is_llada_get_num_transfer_tokens(masked: int, steps: int) -> None:
    assert num_transfer_tokens(masked, steps) == llada_schedule(masked, steps)


@pytest.mark.parametrize("length,steps", [(10, 4), (8, 8), (12, 5)])
def test_commits_per_step_follow_the_schedule(length: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(length * steps)
    conf = (0.3 + 0.6 * torch.rand(length, generator=gen)).tolist()
    tokens = torch.randint(0, MASK, (length,), generator=gen).tolist()
    llada = LladaStrategy([], settings(block_length=length, steps=steps))
    events = run_block(llada, make_row(), lambda block: confidence_logits(conf, tokens))
    assert [e["committed"] for e in events] == llada_schedule(length, steps)


# --- which positions -----------------------------------------------------------------------


def test_low_confidence_remasking_commits_the_most_confident_positions() -> None:
    conf = [0.41, 0.93, 0.55, 0.62, 0.87, 0.35, 0.71, 0.48, 0.66, 0.90]
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    llada = LladaStrategy([], settings(block_length=10, steps=4))
    events = run_block(llada, make_row(), lambda block: confidence_logits(conf, tokens))
    ranked = sorted(range(10), key=lambda j: -conf[j])
    counts = llada_schedule(10, 4)
    expected, at = [], 0
    for k in counts:
        expected.append(sorted(ranked[at:at + k]))
        at += k
    assert [e["positions"] for e in events] == expected


def test_confidence_is_recomputed_every_pass() -> None:
    """A position's confidence rises once its neighbour is committed: the order follows."""
    def logits_of(block: list[int]) -> torch.Tensor:
        conf = [0.9 if j == 0 or block[j - 1] != MASK else 0.2 + 0.01 * j for j in range(6)]
        return confidence_logits(conf, [4] * 6)

    llada = LladaStrategy([], settings(block_length=6, steps=6))
    events = run_block(llada, make_row(), logits_of)
    assert [e["positions"] for e in events] == [[0], [1], [2], [3], [4], [5]]


def test_random_remasking_follows_the_schedule_and_the_seed() -> None:
    conf = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    logits = confidence_logits(conf, [1] * 8)
    firsts = []
    for seed in range(200):
        llada = LladaStrategy([], settings(block_length=8, steps=4, remasking="random"))
        events = run_block(llada, make_row(seed=seed), lambda block: logits)
        assert [e["committed"] for e in events] == [2, 2, 2, 2]
        firsts += events[0]["positions"]  # type: ignore[operator]
    counts = torch.bincount(torch.tensor(firsts), minlength=8).float()
    # Uniform over positions (400 picks, 50 expected each), not by confidence.
    assert counts.min() > 25 and counts.max() < 80


@pytest.mark.parametrize("threshold", [0.5, 0.75, 0.9])
def test_threshold_commits_exactly_the_positions_above_it(threshold: float) -> None:
    conf = [0.41, 0.93, 0.55, 0.62, 0.87, 0.35, 0.71, 0.48, 0.66, 0.95]
    fast = FastDllmStrategy([], settings(block_length=10, steps=10, threshold=threshold))
    events = run_block(fast, make_row(), lambda block: confidence_logits(conf, [2] * 10))
    left = set(range(10))
    for event in events:
        above = sorted(j for j in left if conf[j] > threshold)
        expected = above or [max(left, key=lambda j: conf[j])]
        assert event["positions"] == expected
        left -= set(expected)
    assert not left


def test_threshold_commits_one_when_none_is_above() -> None:
    conf = [0.3, 0.2, 0.45, 0.1]
    fast = FastDllmStrategy([], settings(block_length=4, steps=4, threshold=0.9))
    events = run_block(fast, make_row(), lambda block: confidence_logits(conf, [2] * 4))
    assert [e["positions"] for e in events] == [[2], [0], [1], [3]]


# --- sampling --------------------------------------------------------------------------------


def test_gumbel_draws_follow_the_tempered_softmax() -> None:
    """At temperature T the predicted token is a draw from softmax(logits / T)."""
    base = torch.full((V,), -30.0)
    base[[1, 2, 3]] = torch.tensor([1.0, 0.5, -0.5])
    temperature = 0.7
    logits = base.repeat(32, 1)
    chain = [make_processor("temperature")]
    counts = torch.zeros(V)
    for seed in range(100):
        llada = LladaStrategy(chain, settings(block_length=32, steps=1))
        state = llada.start(make_row(seed, temperature), Forcing.none())
        row = make_row(seed, temperature)
        llada.update([state], [row], [torch.zeros(1, V)])
        update = llada.update([state], [row], [logits])[0]
        for taken in update.taken:
            counts[taken.token_id] += 1
    expected = torch.softmax(base / temperature, -1)
    freq = counts / counts.sum()
    assert torch.allclose(freq, expected, atol=0.02), (freq[:4], expected[:4])


@pytest.mark.parametrize("steps,power", [(4, 1.0), (8, 1.0), (4, 2.0)])
def test_dfm_jumps_with_the_euler_step_probability(steps: int, power: float) -> None:
    """Over many seeds, the share of masked positions that unmask at each Euler step is
    ``1 - exp(-h κ'(t) / (1 - κ(t)))``; the last step unmasks all that is left."""
    length, seeds = 32, 120
    logits = confidence_logits([0.9] * length, [5] * length)
    jumped = torch.zeros(steps)
    masked_before = torch.zeros(steps)
    for seed in range(seeds):
        dfm = DiscreteFlowStrategy([], settings(block_length=length, steps=steps,
                                                kappa_power=power))
        for i, event in enumerate(run_block(dfm, make_row(seed), lambda block: logits)):
            jumped[i] += event["committed"]  # type: ignore[operator]
            masked_before[i] += event["masked"]  # type: ignore[operator]
    h = 1.0 / steps
    for i in range(steps - 1):
        t = i * h
        kappa, dkappa = t ** power, power * t ** (power - 1)
        p = 1 - math.exp(-h * dkappa / (1 - kappa))
        share = float(jumped[i] / masked_before[i])
        sd = math.sqrt(p * (1 - p) / float(masked_before[i]))
        assert abs(share - p) < 4 * sd + 1e-9, (i, share, p)
    assert jumped[-1] == masked_before[-1]


def test_dfm_step_matches_its_reference_update_exactly() -> None:
    """One solver step against the update written out here: x_1 is the Gumbel-max draw of
    the posterior, a masked position jumps where its uniform is below 1 - exp(-h λ)."""
    length, steps, seed = 24, 4, 11
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(length, V, generator=gen)
    row = make_row(seed, temperature=1.0)
    dfm = DiscreteFlowStrategy([make_processor("temperature")],
                               settings(block_length=length, steps=steps))
    state = dfm.start(row, Forcing.none())
    dfm.update([state], [row], [torch.zeros(1, V)])
    update = dfm.update([state], [row], [logits])[0]
    # The reference: iteration 0's draws (Gumbel for x_1, then the jump uniforms).
    masked_logits = logits.double().clone()
    masked_logits[:, MASK] = float("-inf")
    u = uniforms(seed, 0, 0, (length, V))
    x1 = (masked_logits - torch.log(-torch.log(u))).argmax(-1)
    h = 1.0 / steps
    p_jump = 1 - math.exp(-h * 1.0 / (1 - 0.0))
    jump = uniforms(seed, 0, 2, (length,)) < p_jump
    expected = [int(x1[j]) if jump[j] else MASK for j in range(length)]
    assert state.block == expected
    event = next(p for t, p in update.events if t == "step.denoised")
    assert event["positions"] == [j for j in range(length) if jump[j]]


# --- the loop in the engine -------------------------------------------------------------------


def denoiser_backend(**kw: object) -> ScriptedBackend:
    vocab = ByteTokenizer.VOCAB + 1  # the bytes, the specials, and a mask token
    return ScriptedBackend(vocab, hashed_logits(vocab), denoise=hashed_denoiser(vocab),
                           **kw)  # type: ignore[arg-type]


MASK_BYTE = ByteTokenizer.VOCAB


def scripted_pipe(backend: ScriptedBackend, strategy: str = "llada", **kw: object) -> object:
    options = {"mask_token_id": MASK_BYTE, **kw.pop("options", {})}  # type: ignore[dict-item]
    return build_scripted(backend, strategy=strategy, strategy_options=options, **kw)


def test_finished_blocks_are_written_once_and_never_recomputed() -> None:
    backend = denoiser_backend()
    pipe = scripted_pipe(backend, block_length=4, steps=2)
    done = pipe.generate("hi", GenerationConfig(max_tokens=12, temperature=0.0,  # type: ignore[attr-defined]
                                                banned_token_ids=(256,)))
    assert len(done.token_ids) == 12
    calls = backend.model_calls
    prompt = calls[0]
    denoise = [c for c in calls[1:] if c.attention is Attention.BLOCK]
    writes = [c for c in calls[1:] if c.write]
    assert all(not c.write and len(c.token_ids) == 4 for c in denoise)
    assert len(denoise) == 3 * 2                       # 3 blocks, 2 passes each
    # Each block is written once, causally, right where the cache ends, and the cache only
    # ever holds the prompt and the committed tokens.
    assert [(c.start, c.attention) for c in writes] == [
        (len(prompt.token_ids) + 4 * b, Attention.CAUSAL) for b in range(2)]
    assert [t for c in writes for t in c.token_ids] == list(done.token_ids[:8])
    for c in denoise:
        assert c.start == len(prompt.token_ids) + 4 * (denoise.index(c) // 2)
    pipe.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("strategy,options", [
    ("llada", {"remasking": "random"}), ("llada", {}), ("fast_dllm", {"threshold": 0.3}),
    ("dfm", {})])
def test_seeded_runs_are_identical_alone_and_batched(strategy: str,
                                                     options: dict[str, object]) -> None:
    config = GenerationConfig(max_tokens=10, temperature=0.9, seed=5,
                              banned_token_ids=(256,))
    prompts = ["alpha", "beta", "gamma"]
    alone = []
    for prompt in prompts:
        pipe = scripted_pipe(denoiser_backend(), strategy, block_length=4, options=options)
        alone.append(pipe.generate(prompt, config).token_ids)  # type: ignore[attr-defined]
        pipe.close()  # type: ignore[attr-defined]
    backend = denoiser_backend(delay_s=0.002)
    pipe = scripted_pipe(backend, strategy, block_length=4, options=options)
    handles = [pipe.submit(p, config) for p in prompts]  # type: ignore[attr-defined]
    batched = [h.result().token_ids for h in handles]
    pipe.close()  # type: ignore[attr-defined]
    assert batched == alone
    assert any(len(sizes) > 1 for _, sizes in backend.calls)  # they did share forwards
    again = scripted_pipe(denoiser_backend(), strategy, block_length=4, options=options)
    other = again.generate("alpha", attrs_evolve_seed(config, 6))  # type: ignore[attr-defined]
    again.close()  # type: ignore[attr-defined]
    assert other.token_ids != alone[0]


def attrs_evolve_seed(config: GenerationConfig, seed: int) -> GenerationConfig:
    import attrs

    return attrs.evolve(config, seed=seed)


def test_forced_prefix_fills_the_first_positions() -> None:
    pipe = scripted_pipe(denoiser_backend(), block_length=4)
    forced = tuple(ByteTokenizer().encode_text("OK: "))
    done = pipe.generate("x", GenerationConfig(max_tokens=8, temperature=0.0,  # type: ignore[attr-defined]
                                               forced_prefix=forced, banned_token_ids=(256,)))
    assert done.token_ids[:4] == forced
    pipe.close()  # type: ignore[attr-defined]


# --- building ---------------------------------------------------------------------------------


def test_settings_are_checked() -> None:
    with pytest.raises(InvalidValueError, match="steps"):
        DiffusionSettings(mask_token_id=1, block_length=4, steps=5)
    with pytest.raises(InvalidValueError, match="remasking"):
        DiffusionSettings(mask_token_id=1, remasking="lowest")
    with pytest.raises(InvalidValueError, match="threshold"):
        DiffusionSettings(mask_token_id=1, threshold=1.5)
    backend = denoiser_backend()
    with pytest.raises(UnknownFieldError, match="did you mean 'remasking'"):
        scripted_pipe(backend, options={"remasker": "random"})
    with pytest.raises(UnknownFieldError, match="threshold"):
        scripted_pipe(backend, options={"threshold": 0.5})          # llada takes none
    with pytest.raises(InvalidValueError, match="mask_token_id"):
        build_scripted(backend, strategy="llada")
    with pytest.raises(InvalidValueError, match="below the model's vocabulary"):
        build_scripted(backend, strategy="llada", strategy_options={"mask_token_id": 10_000})
    with pytest.raises(InvalidValueError, match="given twice"):
        scripted_pipe(backend, steps=2, options={"steps": 2})
    with pytest.raises(InvalidValueError, match="iterative strategies"):
        build_scripted(backend, steps=4)


# --- the noise --------------------------------------------------------------------------------


def test_uniforms_are_a_pure_function_of_key_and_index() -> None:
    a = uniforms(5, 2, 9, (64, 300))
    assert torch.equal(a, uniforms(5, 2, 9, (64, 300)))
    assert torch.equal(a.flatten()[:300], uniforms(5, 2, 9, (300,)))     # shape-independent
    for other in (uniforms(6, 2, 9, (64, 300)), uniforms(5, 3, 9, (64, 300)),
                  uniforms(5, 2, 10, (64, 300))):
        assert (other != a).float().mean() > 0.99


def test_uniforms_are_uniform_and_uncorrelated() -> None:
    u = uniforms(1234, 0, 0, (200_000,))
    assert 0 < float(u.min()) and float(u.max()) < 1
    # Kolmogorov-Smirnov against U(0, 1): D < 1.63 / sqrt(n) at the 1% level.
    ordered = torch.sort(u).values
    n = ordered.numel()
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = float(torch.maximum(grid - ordered, ordered - (grid - 1 / n)).max())
    assert d < 1.63 / math.sqrt(n)
    lag = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1]
    assert abs(float(lag)) < 0.01


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_the_prediction_is_llada_add_gumbel_noise_then_argmax(temperature: float) -> None:
    """LLaDA: ``logits.exp() / (-log u) ** T`` in float64, argmax; ours takes the logits
    already divided by T (the temperature processor) and the same uniforms."""
    from stages.strategies.diffusion.rules import gumbel_argmax

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    u = uniforms(3, 0, 5, (64, 50))
    llada = (logits.exp() / (-torch.log(u)) ** temperature).argmax(-1)
    assert torch.equal(gumbel_argmax(logits / temperature, u), llada)
