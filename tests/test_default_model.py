"""The embedded default model: small, loads with build(), answers in English-looking words."""

from __future__ import annotations

import re

import pytest

from pipeline import FinishReason, build, cli
from pipeline.builder import DEFAULT_MODEL_DIR


def test_it_ships_in_hf_layout_within_16_mb() -> None:
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= 16 * 2**20


def test_build_without_arguments_uses_it_and_it_answers_in_words() -> None:
    with build() as pipe:
        assert pipe.engine is not None
        done = pipe.generate("Why is the sky usually blue? Answer in one sentence.",
                             max_tokens=60, temperature=0)
    assert done.finish_reason in (FinishReason.EOS, FinishReason.LENGTH)
    words = re.findall(r"[A-Za-z]+", done.text)
    assert len(words) >= 5
    # mostly letters and spaces, not byte noise
    letters = sum(c.isalpha() or c.isspace() for c in done.text)
    assert letters / max(len(done.text), 1) > 0.8, done.text


def test_demo_streams_and_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--max-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"ttft [\d.]+ ms \| \d+ tokens/s \| finish \w+ \| \d+ trace events", out)
