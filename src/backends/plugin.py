"""Registers the built-in model backends through the ``pipeline_components`` hook.

Factories import lazily and read the build's :class:`~pipeline.options.BackendOptions`
(``build(..., options=...)``): ``num_slots``, ``max_context``, ``dtype``, ``device``,
``pack`` (oneDNN-packed float32 weights on CPU, default true), ``quantized`` (GGUF files
only), the KV pool's ``block_size`` (default 16) and size, as ``kv_blocks`` or as a byte
budget ``kv_cache_bytes`` (default: ``num_slots`` windows of ``max_context``; see
:mod:`backends.torch.backend`), and ``moe`` — the routed-experts function of MoE layers: ``"torch"``
(default, the reference), ``"triton"`` (fused Triton kernels; on a CPU only under
``TRITON_INTERPRET=1``, float32/float16), or a callable with ``moe_forward``'s signature.
``moe_configs`` adds folders of tuned Triton launch tables. ``expert_cache_bytes`` and
``expert_cache_policy`` put an MoE model's routed experts under a memory cap
(:mod:`backends.torch.experts`). A process started by ``torchrun`` with more than one rank
loads its part of a tensor/expert-parallel model instead (:mod:`backends.torch.parallel`):
``build()`` returns on rank 0 only; every other rank serves rank 0 inside it and then ends.
``backend="transformers"`` runs a Hugging Face folder on transformers' own implementation
(:mod:`backends.transformers`): ``dtype``, ``device``, ``num_slots``, ``max_context`` and
``threads`` apply, the torch backend's cache and kernel settings are refused. The built-in
backends take no ``extra`` options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.hookspecs import hookimpl
from pipeline.options import BackendOptions
from pipeline.registry import BuildContext, Component


def _torch(ctx: BuildContext) -> Any:
    from backends.torch.backend import TorchBackend
    from backends.moe_choice import moe_function

    if ctx.model_dir is None:
        raise ArtifactError("the torch backend needs a model folder")
    opts = ctx.options
    opts.refuse_extra("torch")
    if opts.quantized:
        raise InvalidValueError("quantized", True, "applies to GGUF files only; this model is "
                                "a Hugging Face folder of safetensors weights")
    settings: dict[str, Any] = dict(
        num_slots=opts.num_slots, max_context=opts.max_context, dtype=opts.torch_dtype,
        pack=opts.pack, kv_blocks=opts.kv_blocks, kv_cache_bytes=opts.kv_cache_bytes,
        block_size=opts.block_size, batch_invariant=opts.invariant,
        kv_int8=opts.kv_cache_dtype == "int8", threads=opts.threads)
    from backends.torch.parallel import launched_world

    if launched_world() is not None:  # torchrun: this rank's part of the model
        return _parallel(ctx.model_dir, opts, settings)
    backend = TorchBackend.from_dir(
        ctx.model_dir, device=opts.device, moe=moe_function(opts.moe, opts.moe_configs),
        expert_cache_bytes=opts.expert_cache_bytes, expert_cache_policy=opts.expert_cache_policy,
        **settings)
    if opts.moe == "triton":  # refuse at build time, not at the first request
        from backends.triton_moe.launch import check_device

        check_device(backend.model.weights.embed.device, backend.model.dtype)
    return backend


def _parallel(folder: Path, opts: BackendOptions, settings: dict[str, Any]) -> Any:
    """Under ``torchrun``: join the group and load this rank's part
    (:mod:`backends.torch.parallel`). Rank 0 gets the backend; any other rank serves rank 0's
    calls here and ends its process when rank 0 closes the group."""
    import os

    from backends.torch.parallel import join_group, parallel_backend

    if opts.expert_cache_bytes is not None or opts.moe != "torch":
        raise InvalidValueError("options", "expert_cache_bytes / moe", "a parallel group runs "
                                "the torch experts path with every expert of a rank resident")
    device = opts.device
    if device == "cuda":  # one device a rank
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    shard = join_group(device=device)
    return parallel_backend(folder, shard, device=device, **settings)


def _transformers(ctx: BuildContext) -> Any:
    """A Hugging Face folder on its own transformers implementation (the optional extra).
    The torch backend's memory and kernel settings do not apply and are refused by name;
    ``batch_invariant=True`` is refused by the builder, through the backend's capabilities."""
    from backends.transformers.backend import TransformersBackend

    if ctx.model_dir is None:
        raise ArtifactError("the transformers backend needs a Hugging Face model folder "
                            "(config.json and weights), not a GGUF file")
    opts = ctx.options
    opts.refuse_extra("transformers")
    torch_only = {"quantized": opts.quantized, "kv_cache_dtype": opts.kv_cache_dtype,
                  "kv_blocks": opts.kv_blocks, "kv_cache_bytes": opts.kv_cache_bytes,
                  "expert_cache_bytes": opts.expert_cache_bytes,
                  "moe_configs": list(opts.moe_configs) or None,
                  "moe": None if opts.moe == "torch" else opts.moe}
    for field, value in torch_only.items():
        if value is not None:
            raise InvalidValueError(field, value, "is a torch backend setting; the "
                                    "transformers backend keeps transformers' own cache and "
                                    "kernels")
    return TransformersBackend.from_dir(ctx.model_dir, dtype=opts.dtype, device=opts.device,
                                        num_slots=opts.num_slots, max_context=opts.max_context,
                                        threads=opts.threads)


def _gguf_backend(ctx: BuildContext) -> Any:
    from backends.gguf.backend import gguf_backend

    return gguf_backend(ctx)


@hookimpl
def pipeline_components() -> list[Component]:
    """The torch reference backend for Hugging Face checkpoints, and a GGUF file's weights
    (on the same torch backend; its tokenizer and chat template are stages)."""
    return [Component("backend", "torch", _torch,
                      "torch reference for HF checkpoints (dense and MoE)"),
            Component("backend", "gguf", _gguf_backend,
                      "a GGUF file's weights on the torch backend (dequantized at load)"),
            Component("backend", "transformers", _transformers,
                      "any causal LM transformers loads, on its own implementation "
                      "(optional extra: explicit-pipeline[transformers])")]
