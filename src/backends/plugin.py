"""Registers the built-in model backends through the ``pipeline_components`` hook.

Factories import lazily; options come from ``build(..., options={...})``: ``num_slots``,
``max_context``, ``dtype``, ``device``, ``pack`` (oneDNN-packed float32 weights on CPU,
default true), and ``moe`` — the routed-experts function of MoE
layers: ``"torch"`` (default, the reference), ``"triton"`` (fused Triton kernels; on a CPU
only under ``TRITON_INTERPRET=1``, float32/float16), or a callable with
``moe_forward``'s signature. ``moe_configs`` adds folders of tuned Triton launch tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import ArtifactError, BackendError, InvalidValueError
from pipeline.hookspecs import hookimpl
from pipeline.registry import BuildContext, Component


def _torch(ctx: BuildContext) -> Any:
    from backends.torch.backend import TorchBackend

    if ctx.model_dir is None:
        raise ArtifactError("the torch backend needs a model folder")
    opts = ctx.options
    backend = TorchBackend.from_dir(
        ctx.model_dir, num_slots=int(opts.get("num_slots", 8)),
        max_context=opts.get("max_context"), dtype=opts.get("dtype"),
        device=opts.get("device", "cpu"), pack=bool(opts.get("pack", True)),
        moe=_moe(opts.get("moe", "torch"), opts.get("moe_configs", ())))
    if opts.get("moe") == "triton":  # refuse at build time, not at the first request
        from backends.triton_moe.launch import check_device

        check_device(backend.model.weights.embed.device, backend.model.dtype)
    return backend


def _moe(choice: Any, folders: Any) -> Any:
    if callable(choice):
        return choice
    if choice == "torch":
        from backends.torch.moe import moe_forward

        return moe_forward
    if choice == "triton":
        try:
            from backends.triton_moe.launch import TritonMoe
        except ImportError as exc:
            raise BackendError(f"moe='triton' needs the triton package ({exc}); install "
                               "the 'triton' extra") from exc
        return TritonMoe([Path(f) for f in folders])
    raise InvalidValueError("moe", choice, "must be 'torch', 'triton' or a callable")


@hookimpl
def pipeline_components() -> list[Component]:
    """The torch reference backend for Hugging Face checkpoints."""
    return [Component("backend", "torch", _torch,
                      "torch reference for HF checkpoints (dense and MoE)")]
