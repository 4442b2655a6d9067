"""Every implementation satisfies its Protocol: structurally (mypy) and by name (runtime).

One mypy --strict run checks both files that exist to be type-checked: the stages, backends
and fakes against their Protocols (``protocol_conformance.py``) and the worked example plugin
(``examples/no_repeat_ngram.py``, docs/plugins.md) as a ``LogitProcessor``. mypy analyses the
library (and torch) once for both, in the checkout's own cache (``.mypy_cache``, which
``make test``'s ``mypy --strict src`` fills first); each test asserts on its file's errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline
from pipeline import testing

HERE = Path(__file__).parent
ROOT = HERE.parent
CONFORMANCE = HERE / "protocol_conformance.py"
EXAMPLE = ROOT / "examples" / "no_repeat_ngram.py"


@pytest.fixture(scope="module")
def mypy() -> tuple[int, list[str], str]:
    """mypy --strict over both files, against this checkout's src/: its exit status, its
    error lines and all it printed."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--show-absolute-path",
         str(CONFORMANCE), str(EXAMPLE)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "MYPYPATH": str(ROOT / "src")})
    printed = result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    # 0: clean; 1: errors, each on a line of its own; anything else: mypy did not check
    assert (result.returncode, bool(errors)) in {(0, False), (1, True)}, printed
    return result.returncode, errors, printed


def test_implementations_satisfy_their_protocols_under_mypy(
        mypy: tuple[int, list[str], str]) -> None:
    _, errors, printed = mypy
    # every error but the example's own: this file's, or one in a module it imports
    assert [line for line in errors if not line.startswith(str(EXAMPLE))] == [], printed


def test_mypy_proves_the_example_plugin_a_logit_processor(
        mypy: tuple[int, list[str], str]) -> None:
    _, errors, printed = mypy
    assert [line for line in errors if line.startswith(str(EXAMPLE))] == [], printed


def test_fakes_pass_runtime_protocol_checks() -> None:
    assert isinstance(testing.ByteTokenizer(), pipeline.Tokenizer)
    assert isinstance(testing.ChatMLRenderer(), pipeline.Renderer)
    assert isinstance(testing.ByteDetokenizer(), pipeline.Detokenizer)
    assert isinstance(testing.BanTokenProcessor(1), pipeline.LogitProcessor)
    assert isinstance(testing.TokenCountStopper(1), pipeline.Stopper)
    assert isinstance(testing.ScriptedBackend(4, testing.peaked(4, lambda t: 0)), pipeline.Backend)
