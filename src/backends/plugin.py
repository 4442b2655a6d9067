"""Registers the built-in model backends through the ``pipeline_components`` hook.

Factories import lazily; options come from ``build(..., options={...})``: ``num_slots``,
``max_context``, ``dtype``, ``device``.
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import ArtifactError
from pipeline.hookspecs import hookimpl
from pipeline.registry import BuildContext, Component


def _torch(ctx: BuildContext) -> Any:
    from backends.torch.backend import TorchBackend

    if ctx.model_dir is None:
        raise ArtifactError("the torch backend needs a model folder")
    opts = ctx.options
    return TorchBackend.from_dir(
        ctx.model_dir, num_slots=int(opts.get("num_slots", 8)),
        max_context=opts.get("max_context"), dtype=opts.get("dtype"),
        device=opts.get("device", "cpu"))


@hookimpl
def pipeline_components() -> list[Component]:
    """The torch reference backend for Hugging Face checkpoints."""
    return [Component("backend", "torch", _torch,
                      "torch reference for HF checkpoints (dense and MoE)")]
