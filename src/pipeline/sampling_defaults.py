"""The sampling a request gets when it sets none: the model's own recommendation, else the
pipeline's documented default.

Owns :func:`model_sampling` (what :func:`pipeline.build` lays under every request), the
documented fallback :data:`PIPELINE_DEFAULT`, the sources it names, and the readers of a
model's recommendation:

1. **a Hugging Face folder's** ``generation_config.json``: ``temperature``, ``top_k``,
   ``top_p``, ``min_p`` and ``repetition_penalty``, those it gives. A file with
   ``"do_sample": false`` asks transformers for greedy search and its sampling fields then
   are no recommendation (transformers ignores them), so none is taken from it; a file
   without ``do_sample`` or with ``true`` is taken as written. Source
   ``"generation_config.json"``.
2. **a GGUF file's** ``general.sampling.*`` metadata (the keys llama.cpp's converter writes
   from ``generation_config.json``): ``temp``, ``top_k``, ``top_p``, ``min_p`` and
   ``penalty_repeat`` (as ``repetition_penalty``, over the prompt and the whole output:
   ``penalty_last_n`` has no counterpart here). Source ``"GGUF metadata"``.
3. **otherwise** :data:`PIPELINE_DEFAULT`: temperature 0.2 with top_p 0.9 (chosen by
   measuring the default model on everyday questions, ``benchmarks/answer_quality.py``,
   docs/performance.md) and the DRY loop guard at multiplier 0.8 (chosen by measuring how
   often answers end by themselves, ``benchmarks/loops.py``). Source ``"pipeline default"``.

A field the model does not name stays off (``GenerationConfig``'s neutral value), not
transformers' or llama.cpp's own default for it. Keys no stage implements (mirostat, XTC,
``penalty_last_n``) are listed in :attr:`SamplingDefaults.ignored`, so the start-up line can
say so. A value outside its field's range is an :class:`~pipeline.errors.ArtifactError`
naming the file and key.

``build(defaults=...)`` replaces all of this (source ``"build(defaults=...)"``), and a
request's own fields are laid over whichever applies. ``GenerationConfig()`` itself stays the
neutral config (temperature 1, nothing truncated: the distribution as the model gives it,
and OpenAI's API default): it is what an explicit ``config=`` starts from.

Example::

    found = model_sampling(Path("models/Qwen3-0.6B"), None)
    found.source, found.config.temperature      # ('generation_config.json', 0.6)
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from pipeline.errors import ArtifactError, PipelineError
from pipeline.contracts.request import GenerationConfig

if TYPE_CHECKING:  # the registry imports torch; reading a recommendation needs none
    from pipeline.registry import BuildContext

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
"""The :class:`~pipeline.contracts.request.GenerationConfig` fields a model may recommend."""
GUARD_FIELDS = ("dry_multiplier", "dry_base", "dry_allowed_length")
"""The loop guard's fields (the DRY penalty, :mod:`stages.process.dry`): no model file
recommends them, the pipeline default sets them."""
UNUSED_WHEN_GREEDY = ("top_k", "top_p", "min_p", "typical_p")
"""The fields of the truncation processors, which are argmax-invariant and skip a greedy row
(:mod:`stages.process.truncation`): at temperature 0 they change nothing."""
DEFAULTED_FIELDS = (*SAMPLING_FIELDS, *GUARD_FIELDS)
"""The fields a request that leaves them out takes from the pipeline's defaults, in the
library, the command line and every HTTP dialect alike."""
PIPELINE_DEFAULT: Mapping[str, float] = {"temperature": 0.2, "top_p": 0.9, "dry_multiplier": 0.8}
"""The sampling of a model that recommends none: temperature and top_p from the answer-quality
measurement, and the DRY loop guard from the loop measurement (docs/performance.md, "Answer
quality" and "Loops at the defaults")."""
GENERATION_CONFIG = "generation_config.json"
GGUF_METADATA = "GGUF metadata"
PIPELINE = "pipeline default"
CALLER = "build(defaults=...)"
HF_KEYS = {name: name for name in SAMPLING_FIELDS}
"""``generation_config.json`` key → field."""
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
"""GGUF metadata key → field (llama.cpp's ``gguf.Keys.General.SAMPLING_*``)."""
GGUF_PREFIX = "general.sampling."
HF_IGNORED = ("typical_p", "epsilon_cutoff", "eta_cutoff", "top_a", "top_n_sigma")
"""``generation_config.json`` sampling keys that are read by no stage here."""


@attrs.frozen
class SamplingDefaults:
    """A pipeline's defaults (``config``), where they came from (``source``: one of
    :data:`GENERATION_CONFIG`, :data:`GGUF_METADATA`, :data:`PIPELINE`, :data:`CALLER`), and
    the model's sampling keys that were not used (``ignored``)."""

    config: GenerationConfig
    source: str
    ignored: tuple[str, ...] = ()

    def summary(self) -> str:
        """The sampling fields that are not neutral, as ``temperature 0.2, top_p 0.9``
        (``greedy`` at temperature 0)."""
        return sampling_summary(self.config)


def sampling_summary(config: GenerationConfig) -> str:
    """``config``'s sampling fields that differ from the neutral config, in order; when
    greedy, the fields that still act (penalties and the loop guard, not the truncation
    fields, which skip a greedy row)."""
    neutral = GenerationConfig()
    parts = ["greedy (temperature 0)" if config.greedy else f"temperature {config.temperature:g}"]
    parts += [f"{name} {getattr(config, name):g}" for name in DEFAULTED_FIELDS[1:]
              if getattr(config, name) != getattr(neutral, name)
              and not (config.greedy and name in UNUSED_WHEN_GREEDY)]
    return ", ".join(parts)


def pipeline_default() -> SamplingDefaults:
    """:data:`PIPELINE_DEFAULT` over the neutral config."""
    return SamplingDefaults(GenerationConfig.from_dict(PIPELINE_DEFAULT), PIPELINE)


def model_sampling(model_dir: Path | None, model_file: Path | None, *,
                   defaults: GenerationConfig | None = None,
                   gguf_metadata: Mapping[str, Any] | None = None
                   ) -> SamplingDefaults:
    """The defaults of a pipeline built from ``model_dir`` or ``model_file``: ``defaults``
    when the caller gave them, else the model's recommendation, else the pipeline default.
    ``gguf_metadata`` is the GGUF file's metadata, as the build's GGUF factories read it
    (this module opens no model file); a GGUF file given without it has no recommendation
    here."""
    if defaults is not None:
        return SamplingDefaults(defaults, CALLER)
    found: SamplingDefaults | None = None
    if model_file is not None:
        found = from_gguf(gguf_metadata, str(model_file)) if gguf_metadata else None
    elif model_dir is not None and (model_dir / GENERATION_CONFIG).is_file():
        found = from_generation_config(model_dir / GENERATION_CONFIG)
    return found or pipeline_default()


def for_build(context: BuildContext, defaults: GenerationConfig | None) -> SamplingDefaults:
    """:func:`model_sampling` for a build: a GGUF file's metadata is what the build's GGUF
    factories read when they opened it (``context.shared[OPENED]``,
    :func:`pipeline.gguf_file.opened`), not a second read."""
    metadata = None
    if context.model_file is not None:  # only a GGUF file's build imports the reader
        from pipeline.gguf_file import OPENED

        metadata = getattr(context.shared.get(OPENED), "metadata", None)
    return model_sampling(context.model_dir, context.model_file, defaults=defaults,
                          gguf_metadata=metadata)


def from_generation_config(path: Path) -> SamplingDefaults | None:
    """The recommendation of a ``generation_config.json`` (None: it makes none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("do_sample") is False:
        return None
    ignored = tuple(k for k in HF_IGNORED if k in data)
    return _recommended({HF_KEYS[k]: (k, data[k]) for k in HF_KEYS  # a null says nothing
                         if data.get(k) is not None},
                        str(path), GENERATION_CONFIG, ignored)


def from_gguf(metadata: Mapping[str, Any], where: str) -> SamplingDefaults | None:
    """The recommendation of a GGUF file's ``general.sampling.*`` keys (None: none)."""
    given = {GGUF_KEYS[k]: (k, metadata[k]) for k in GGUF_KEYS if k in metadata}
    ignored = tuple(sorted(k for k in metadata if k.startswith(GGUF_PREFIX)
                           and k not in GGUF_KEYS and k != "general.sampling.sequence"))
    return _recommended(given, where, GGUF_METADATA, ignored)


def _recommended(given: Mapping[str, tuple[str, Any]], where: str, source: str,
                 ignored: tuple[str, ...]) -> SamplingDefaults | None:
    """``given`` (field → (key, value)) over the neutral config, each value checked."""
    if not given:
        return None
    values: dict[str, Any] = {}
    for field, (key, value) in given.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(float(value)):
            raise ArtifactError(f"{where}: {key} must be a finite number, got {value!r}")
        if field == "top_k" and not float(value).is_integer():
            raise ArtifactError(f"{where}: {key} must be a whole number, got {value!r}")
        values[field] = int(float(value)) if field == "top_k" else float(value)
    try:
        config = GenerationConfig(**values)
    except PipelineError as exc:
        raise ArtifactError(f"{where}: a sampling setting is out of range: {exc}") from exc
    return SamplingDefaults(config, source, ignored)

