"""The edges a new user meets first: a model path that is not there, a misspelt keyword,
``build(device=..., dtype=...)``, and hints that run as printed.

Oracles: the file system (a path that exists or not), Python's own rules for keywords (the
error is still a ``TypeError``), and the shell's rule for finding a command (``PATH``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pipeline import build
from transports.cli import commands as cli
from pipeline.errors import (
    ArtifactError, InvalidValueError, UnknownKeywordError, UnknownNameError, plural,
)
from pipeline.model_paths import TINY_MODEL_DIR, resolve_model


@pytest.mark.parametrize("name", ["models/SmolLM2.gguf", "x.gguf", "./here", "a/b/c",
                                  "~/nothing-here"])
def test_a_path_that_is_not_there_says_no_such_file(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ArtifactError, match="no such folder or file") as err:
        resolve_model(name)
    assert "models--" not in str(err.value) and "cache" not in str(err.value)


def test_a_folder_here_is_a_path_and_a_repo_id_is_looked_up_in_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "models").mkdir()
    with pytest.raises(ArtifactError, match="no such folder or file"):
        resolve_model("models/Qwen3")  # models/ exists here: its missing entry, not a repo
    with pytest.raises(ArtifactError, match="not in the local Hugging Face cache"):
        resolve_model("Qwen/Qwen3")
    (tmp_path / "models" / "tiny").symlink_to(TINY_MODEL_DIR, target_is_directory=True)
    assert resolve_model("models/tiny").directory == Path("models/tiny")


def test_a_misspelt_keyword_names_the_closest_and_is_still_a_type_error() -> None:
    with pytest.raises(TypeError) as err:
        build("tiny", devcie="cpu")  # type: ignore[call-arg]
    assert isinstance(err.value, UnknownKeywordError)
    assert "did you mean 'device'?" in str(err.value) and "devcie" in str(err.value)
    with pytest.raises(UnknownKeywordError, match="did you mean 'strategy_options'"):
        build("tiny", strategy_option={})  # type: ignore[call-arg]


def test_device_and_dtype_are_keywords_of_build_as_well_as_options() -> None:
    with build("tiny", device="cpu", dtype="bfloat16") as pipe:
        info = pipe.model_info()
        assert info is not None and info.dtype == "bfloat16" and info.device == "cpu"
    with pytest.raises(InvalidValueError, match="options= already says 'float32'"):
        build("tiny", dtype="float16", options={"dtype": "float32"})
    with pytest.raises(InvalidValueError, match="dtype"):
        build("tiny", dtype="float13")


def test_an_unknown_stage_name_suggests_the_closest_in_plain_english() -> None:
    with pytest.raises(UnknownNameError) as err:
        build("tiny", strategy="speculativ")
    assert "did you mean 'speculative'?" in str(err.value)
    assert "registered strategies:" in str(err.value)
    assert [plural(n) for n in ("strategy", "key", "processor", "prefix", "match")] == [
        "strategies", "keys", "processors", "prefixes", "matches"]


def test_the_printed_hint_names_a_command_that_runs_from_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    program = venv / "pipeline"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(program)])
    monkeypatch.setenv("PATH", "/nonexistent")  # the environment is not active
    assert cli.command() == os.path.join(".venv", "bin", "pipeline")
    monkeypatch.setenv("PATH", str(venv))        # it is: the bare name finds this program
    assert cli.command() == "pipeline"
    monkeypatch.setattr(sys, "argv", [str(tmp_path / "pkg" / "__main__.py")])
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    assert cli.command() == os.path.join(".venv", "bin", "python") + " -m pipeline"
