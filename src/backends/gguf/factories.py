"""The GGUF components: a GGUF file's tokenizer, chat template and weights, each built from one
opening of the file per build.

Owns the factories that :mod:`backends.plugin` registers as ``tokenizer``, ``renderer`` and
``backend`` named ``"gguf"``, which :func:`pipeline.build` picks for a model that is a GGUF
file. Options (``build(..., options=...)``): ``num_slots``, ``max_context``, ``dtype``
(compute dtype, default float32), ``device``, ``pack``, ``moe``, ``kv_blocks`` and
``block_size`` as for the torch backend, and ``quantized``: keep quantized matrices in their
GGML encoding and multiply chunk by chunk (less memory, slower; default False: dequantize at
load).

The torch backend's KV pool holds, by default, a whole window for every slot, so without a
``max_context`` the window is cut to what ``kv_cache_bytes`` (default 1 GiB) holds for
``num_slots`` slots (SmolLM2-135M, 8 slots: 2,816 of its 8,192 positions), in steps of 256,
and the pool is ``num_slots`` such windows (``kv_blocks`` sizes it otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.gguf.file import GGUFFile, hf_config
from backends.torch.config import ModelSpec
from pipeline.errors import ArtifactError
from pipeline.registry import BuildContext

_OPENED = "gguf.file"
KV_CACHE_BYTES = 1 << 30
"""The key/value cache a GGUF model gets when ``max_context`` is not given."""


def opened(ctx: BuildContext) -> GGUFFile:
    """The build's GGUF file, opened on first use and shared by the three factories."""
    if ctx.model_file is None:
        raise ArtifactError("the gguf components need a model file (a .gguf path)")
    if _OPENED not in ctx.shared:
        ctx.shared[_OPENED] = GGUFFile.open(ctx.model_file)
    f: GGUFFile = ctx.shared[_OPENED]
    return f


def gguf_tokenizer(ctx: BuildContext) -> Any:
    """The file's tokenizer as an :class:`~stages.tokenize.hf.HFTokenizer`."""
    from backends.gguf.tokenizer import gguf_tokenizer as make

    f = opened(ctx)
    return make(f.metadata, str(f.path))


def gguf_renderer(ctx: BuildContext) -> Any:
    """The file's chat template (``tokenizer.chat_template``)."""
    from backends.gguf.tokenizer import gguf_renderer as make

    f = opened(ctx)
    return make(f.metadata, str(f.path))


def gguf_backend(ctx: BuildContext) -> Any:
    """The torch backend over the file's weights (dequantized to ``dtype`` at load, or kept
    quantized with ``quantized``)."""
    from backends.gguf.load import load_weights
    from backends.plugin import kv_pool_options, moe_function
    from backends.torch.backend import TorchBackend, torch_dtype
    from backends.torch.model import Transformer

    f, opts = opened(ctx), ctx.options
    spec = ModelSpec.from_hf_config(hf_config(f))
    dtype = opts.get("dtype") or torch.float32
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    loaded = load_weights(f, spec, dtype=dtype, device=opts.get("device", "cpu"),
                          quantized=bool(opts.get("quantized", False)))
    model = Transformer(spec, loaded.weights,
                        moe=moe_function(opts.get("moe", "torch"), opts.get("moe_configs", ())),
                        pack=bool(opts.get("pack", True)), own_products=loaded.products)
    slots = int(opts.get("num_slots", 8))
    window = opts.get("max_context") or fitting_context(
        spec, slots, model.dtype, int(opts.get("kv_cache_bytes", KV_CACHE_BYTES)))
    pool = kv_pool_options({k: v for k, v in opts.items() if k != "kv_cache_bytes"})
    return TorchBackend(model, f.snapshot, num_slots=slots, max_context=window, **pool)


def fitting_context(spec: ModelSpec, slots: int, dtype: torch.dtype, budget: int) -> int:
    """The longest window (a multiple of 256, at most the model's) whose keys and values for
    ``slots`` slots fit in ``budget`` bytes."""
    per_position = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    fits = budget // (slots * per_position) // 256 * 256
    return max(256, min(spec.max_position_embeddings, fits))
