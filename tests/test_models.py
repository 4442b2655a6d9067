"""Where a named model is found (pipeline.model_paths): folders, GGUF files, short names, and repo
ids in the local Hugging Face cache, offline, by huggingface_hub's own rules (the oracle:
``huggingface_hub.try_to_load_from_cache`` on the same cache layout)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pipeline import build
from pipeline.errors import ArtifactError
from pipeline.model_paths import TINY_MODEL_DIR, hf_cache_dir, resolve_model

REPO = "Org/tiny-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(root: Path, *, ref: bool = True, snapshots: int = 1) -> Path:
    """A hub cache holding the tiny model as REPO (files copied into each snapshot)."""
    repo = root / "models--Org--tiny-model"
    for i in range(snapshots):
        commit = COMMIT if i == 0 else f"{i:040d}"
        shutil.copytree(TINY_MODEL_DIR, repo / "snapshots" / commit)
    if ref:
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_the_cache_folder_follows_hf_hub_cache_then_hf_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hf_cache_dir() == tmp_path / "cache"


def test_a_cached_repo_id_resolves_like_huggingface_hub(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import try_to_load_from_cache

    snapshot = fake_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    found = resolve_model(REPO).directory
    assert found == snapshot
    oracle = try_to_load_from_cache(REPO, "config.json", cache_dir=str(tmp_path))
    assert isinstance(oracle, str) and Path(oracle).parent == found
    with build(REPO) as pipe:
        assert pipe.description["model"] == str(snapshot)
        assert pipe.count_tokens("hello") > 0


def test_a_repo_id_not_in_the_cache_says_where_it_looked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ArtifactError) as err:
        resolve_model("Org/absent")
    assert str(tmp_path / "models--Org--absent") in str(err.value)
    assert "nothing is downloaded" in str(err.value)


def test_without_refs_main_the_only_snapshot_is_used_and_two_are_ambiguous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "one"))
    only = fake_cache(tmp_path / "one", ref=False)
    assert resolve_model(REPO).directory == only
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "two"))
    fake_cache(tmp_path / "two", ref=False, snapshots=2)
    with pytest.raises(ArtifactError, match="2 snapshots and no refs/main"):
        resolve_model(REPO)


def test_names_and_paths() -> None:
    assert resolve_model("tiny").directory == TINY_MODEL_DIR
    assert resolve_model(TINY_MODEL_DIR).directory == TINY_MODEL_DIR
    with pytest.raises(ArtifactError, match="not a known name"):
        resolve_model("no-such-model-here")
