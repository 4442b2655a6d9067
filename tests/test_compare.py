"""``pipeline compare`` locates planted differences: each is reported at the layer it was
planted in and not before, dtype noise is reported as noise, and two implementations of one
model (the torch and the transformers backends) agree within the float32 tolerance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_weights import redraw
from pipeline.compare import CompareReport, compare, compare_models
from pipeline.errors import InvalidValueError
from pipeline.testing import ByteDetokenizer, ByteTokenizer, ChatMLRenderer

transformers = pytest.importorskip("transformers")
V = ByteTokenizer.VOCAB
PROMPT = "Why is the sky blue? Tell me in a few words."
FIXTURES = Path(__file__).parent / "gguf_fixtures"


def stages() -> dict[str, Any]:
    return dict(tokenizer=ByteTokenizer(), renderer=ChatMLRenderer(),
                detokenizer=ByteDetokenizer())


def save(folder: Path, change: Any = None, **config: Any) -> Path:
    """A tiny random Qwen3 (4 layers) in ``folder``, ``change(model)`` applied first."""
    torch.manual_seed(0)
    settings = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2)
    settings.update(config)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**settings)).eval()
    redraw(model)
    if change is not None:
        with torch.no_grad():
            change(model)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("base"))


def side(**build: Any) -> dict[str, Any]:
    return {**stages(), **build}


def planted(base: Path, other: Path, **options: Any) -> CompareReport:
    return compare_models(base, PROMPT, a=side(model=base), b=side(model=other),
                          dry_multiplier=0, **options)


def test_torch_and_transformers_backends_agree_in_float32(base: Path) -> None:
    report = compare_models(base, PROMPT, a=side(backend="torch"),
                            b=side(backend="transformers"), dry_multiplier=0, max_tokens=24)
    assert report.answers.first_token is None           # the same 24 tokens
    assert len(report.steps) == 24 and report.first_step_beyond is None
    assert report.first_layer is None and report.tapped
    assert max(s.max_diff for s in report.steps) < 1e-4
    assert all(d.max_diff / d.explained < 0.5 for d in report.layers)
    assert [d.name for d in report.layers][:2] == ["embed", "layers.0.attention"]
    assert "every tap within noise" in report.render()
    json.dumps(report.to_json())


def test_a_perturbed_weight_is_located_at_its_layer_and_not_before(base: Path,
                                                                     tmp_path: Path) -> None:
    def perturb(model: Any) -> None:
        w = model.model.layers[2].mlp.down_proj.weight
        w.add_(0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(5)))

    report = planted(base, save(tmp_path, perturb))
    assert report.first_layer is not None and report.first_layer.name == "layers.2.mlp"
    assert report.layer_step == 1
    names = [d.name for d in report.layers]
    before = report.layers[:names.index("layers.2.mlp")]
    assert all(d.max_diff == 0 for d in before)     # one backend, one dtype: bit for bit
    assert "first layer beyond tolerance: layers.2.mlp at step 1" in report.render()


@pytest.mark.parametrize("config", [{"rms_norm_eps": 1e-4}, {"rope_theta": 500000.0}],
                         ids=["rmsnorm-eps", "rope-theta"])
def test_a_changed_norm_epsilon_or_rope_theta_is_located_in_layer_0_attention(
        base: Path, tmp_path: Path, config: dict[str, Any]) -> None:
    report = planted(base, save(tmp_path, **config))
    assert report.first_layer is not None
    assert report.first_layer.name == "layers.0.attention"
    assert report.layers[0].name == "embed" and report.layers[0].max_diff == 0
    assert not report.steps[0].within


def test_bfloat16_against_float32_is_noise_until_a_near_tie_flips(base: Path) -> None:
    """On this prompt the two dtypes part at step 9, where float32's margin between the two
    tokens is 0.019 and bfloat16's 0.016: far less than bfloat16's rounding of logits."""
    report = compare_models(base, "What is 2+2?", a=side(options={"dtype": "float32"}),
                            b=side(options={"dtype": "bfloat16"}), dry_multiplier=0,
                            max_tokens=48)
    assert report.dtypes == ("float32", "bfloat16")
    assert report.first_step_beyond is None and report.first_layer is None
    assert report.flip is not None and report.flip.near_tie
    assert report.answers.first_token is not None
    assert report.flip.step == report.answers.first_token.step == len(report.steps) == 9
    assert "a near tie that rounding explains" in report.render()


def test_quantized_against_float_is_located_where_quantization_enters() -> None:
    """A GGUF file kept quantized (its token table in float16, its matrices int4) against
    the same file dequantized to float32: not explained by the dtypes, from the embedding
    on."""
    model = FIXTURES / "llama-q4_k.gguf"
    report = compare_models(model, "The quick brown fox", a={"options": {"quantized": False}},
                            b={"options": {"quantized": True}}, max_tokens=8)
    assert report.first_layer is not None and report.first_layer.name == "embed"
    assert report.layer_step == 1 and not report.steps[0].within


def test_batched_and_alone_are_identical_with_batch_invariance(base: Path) -> None:
    from pipeline import build

    with build(base, **stages(), options={"batch_invariant": True}) as a, \
            build(base, **stages(), options={"batch_invariant": True}) as b:
        seen: list[int] = []
        forward = b.engine.backend.forward
        b.engine.backend.forward = lambda calls: (seen.append(len(calls)), forward(calls))[1]
        report = compare(a, b, PROMPT, company=(0, 3), max_tokens=12)
    assert seen.count(4) == len(report.steps) == 12  # B's lockstep forwards carried 3 more
    assert all(s.max_diff == 0 for s in report.steps)
    assert all(d.max_diff == 0 for d in report.layers)
    assert report.answers.first_token is None


def test_different_requests_are_refused_unless_asked(base: Path) -> None:
    from pipeline import build

    with build(base, **stages()) as a, build(base, **stages()) as b:
        with pytest.raises(InvalidValueError, match="temperature: 0 vs 0.7"):
            compare(a, b, PROMPT, b_options={"temperature": 0.7})
        with pytest.raises(InvalidValueError, match="text differs"):
            compare(a, b, PROMPT, b_prompt="Another question?")
        report = compare(a, b, PROMPT, b_prompt="Another question?", max_tokens=4,
                         allow_request_difference=True, taps=False)
        assert report.prompt_tokens[0] != report.prompt_tokens[1]
        assert "tokenize differently" in report.render()


def test_taps_on_a_backend_without_them_are_a_clear_error() -> None:
    from pipeline.testing import ScriptedBackend, build_scripted, peaked

    def model() -> ScriptedBackend:
        return ScriptedBackend(V, peaked(V, lambda ids: 65))

    with build_scripted(model()) as a, build_scripted(model()) as b:
        with pytest.raises(InvalidValueError, match="no layer taps.*--no-taps"):
            compare(a, b, "hi", max_tokens=3)
        report = compare(a, b, "hi", max_tokens=3, taps=False)
        assert report.first_step_beyond is None and not report.tapped


def test_the_command_compares_the_two_backends_on_the_shipped_tiny_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transports.cli.commands import main

    out = tmp_path / "report.json"
    rc = main(["compare", "--model", "tiny", "--a", "backend=torch", "--b",
               "backend=transformers", "--max-tokens", "4", "--json", str(out), "What is 2+2?"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "A: backend=torch (bfloat16)" in printed and "layers.3.mlp" in printed
    report = json.loads(out.read_text())
    assert report["labels"] == ["backend=torch", "backend=transformers"]
    assert len(report["steps"]) == 4 and report["first_layer"] is None


@pytest.mark.parametrize("argv, words", [
    (["--a", "dtipe=float32"], "'dtipe': is not a setting compare knows"),
    (["--a", "threads=two"], "threads='two': must be a whole number"),
    (["--b", "batch_invariant=maybe"], "must be on or off"),
    (["--b", "backend"], "must be KEY=VALUE"),
])
def test_the_command_refuses_a_bad_side_naming_it(argv: list[str], words: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from transports.cli.commands import main

    assert main(["compare", "--model", "tiny", *argv, "hi"]) == 1
    assert words in capsys.readouterr().err


def test_sampled_without_a_seed_both_sides_draw_alike(base: Path) -> None:
    """At a temperature above 0 and no seed, both sides use one seed: the same model in
    both configurations gives the same answer, not a divergence made by two seeds."""
    report = compare_models(base, PROMPT, a=side(), b=side(), temperature=0.9, max_tokens=12)
    assert report.answers.first_token is None and report.answers.divergence is None
