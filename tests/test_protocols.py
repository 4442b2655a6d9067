"""Every implementation satisfies its Protocol: structurally (mypy) and by name (runtime)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pipeline
from pipeline import testing

HERE = Path(__file__).parent


def test_implementations_satisfy_their_protocols_under_mypy() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary",
         str(HERE / "protocol_conformance.py")],
        capture_output=True, text=True, cwd=HERE.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_fakes_pass_runtime_protocol_checks() -> None:
    assert isinstance(testing.ByteTokenizer(), pipeline.Tokenizer)
    assert isinstance(testing.ChatMLRenderer(), pipeline.Renderer)
    assert isinstance(testing.ByteDetokenizer(), pipeline.Detokenizer)
    assert isinstance(testing.BanTokenProcessor(1), pipeline.LogitProcessor)
    assert isinstance(testing.TokenCountStopper(1), pipeline.Stopper)
    assert isinstance(testing.ScriptedBackend(4, testing.peaked(4, lambda t: 0)), pipeline.Backend)
