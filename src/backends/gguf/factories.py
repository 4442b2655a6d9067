"""The GGUF components: a GGUF file's tokenizer, chat template and weights, each built from one
opening of the file per build.

Owns the factories that :mod:`backends.plugin` registers as ``tokenizer``, ``renderer`` and
``backend`` named ``"gguf"``, which :func:`pipeline.build` picks for a model that is a GGUF
file. It reads the build's :class:`~pipeline.options.BackendOptions`: ``dtype`` is the
compute dtype (default float32), ``quantized`` keeps quantized matrices in their GGML
encoding and multiplies chunk by chunk (less memory, slower; default False: dequantize at
load), and ``kv_blocks``, ``kv_cache_bytes`` and ``block_size`` size the KV pool as for the
torch backend.

The torch backend's KV pool holds, by default, a whole window for every slot, so without a
``max_context`` the window is cut to what ``kv_cache_bytes`` (default 1 GiB) holds for
``num_slots`` slots (SmolLM2-135M, 8 slots: 2,816 of its 8,192 positions), in steps of 256,
and the pool is ``num_slots`` such windows (an explicit ``kv_cache_bytes`` or ``kv_blocks``
sizes it otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.gguf.file import GGUFFile, hf_config
from backends.torch.config import ModelSpec
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.registry import MODEL_METADATA, BuildContext

_OPENED = "gguf.file"
KV_CACHE_BYTES = 1 << 30
"""The key/value cache a GGUF model gets when ``max_context`` is not given."""


def opened(ctx: BuildContext) -> GGUFFile:
    """The build's GGUF file, opened on first use and shared by the three factories."""
    if ctx.model_file is None:
        raise ArtifactError("the gguf components need a model file (a .gguf path)")
    if _OPENED not in ctx.shared:
        ctx.shared[_OPENED] = GGUFFile.open(ctx.model_file)
        ctx.shared[MODEL_METADATA] = ctx.shared[_OPENED].metadata
    f: GGUFFile = ctx.shared[_OPENED]
    return f


def gguf_tokenizer(ctx: BuildContext) -> Any:
    """The file's tokenizer as an :class:`~stages.tokenize.hf.HFTokenizer`."""
    from backends.gguf.tokenizer import gguf_tokenizer as make

    f = opened(ctx)
    return make(f.metadata, str(f.path))


def gguf_renderer(ctx: BuildContext) -> Any:
    """The file's chat template (``tokenizer.chat_template``); a file without one (a base
    model, as llama.cpp's converter writes it from a folder with no template) gets the plain
    renderer, as a Hugging Face folder without a template does."""
    from backends.gguf.tokenizer import CHAT_TEMPLATE
    from backends.gguf.tokenizer import gguf_renderer as make

    f = opened(ctx)
    if CHAT_TEMPLATE not in f.metadata:
        from stages.render import PlainRenderer

        return PlainRenderer()
    return make(f.metadata, str(f.path))


def gguf_backend(ctx: BuildContext) -> Any:
    """The torch backend over the file's weights (dequantized to ``dtype`` at load, or kept
    quantized with ``quantized``)."""
    from backends.gguf.load import load_weights
    from backends.plugin import moe_function, refuse_extra
    from backends.torch.backend import TorchBackend, fitting_context
    from backends.torch.model import Transformer
    from pipeline.process_memory import release_free_memory

    f, opts = opened(ctx), ctx.options
    refuse_extra(opts, "gguf")
    from backends.torch.parallel import launched_world

    if launched_world() is not None:
        raise InvalidValueError("model", str(f.path), "a parallel group (torchrun) splits a "
                                "Hugging Face folder of safetensors weights; a GGUF file runs "
                                "in one process")
    spec = ModelSpec.from_hf_config(hf_config(f))
    dtype = opts.torch_dtype or torch.float32
    tiered = opts.expert_cache_bytes is not None
    loaded = load_weights(f, spec, dtype=dtype, device=opts.device,
                          quantized=opts.keeps_quantized, mapped_experts=tiered)
    experts = None
    if opts.expert_cache_bytes is not None:
        from backends.gguf.load import GGUFExperts
        from backends.torch.experts import ExpertCache

        experts = ExpertCache(GGUFExperts(f, spec), spec, cap_bytes=opts.expert_cache_bytes,
                              policy=opts.expert_cache_policy, dtype=dtype,
                              device=loaded.weights.norm.device, pack=opts.pack)
    model = Transformer(spec, loaded.weights, moe=moe_function(opts.moe, opts.moe_configs),
                        pack=opts.pack, own_products=loaded.products,
                        batch_invariant=opts.invariant, experts=experts)
    if experts is None:
        f.drop_resident_pages()  # the weights are copies now (tiers still read the file)
    release_free_memory()    # and the load's scratch is free: hand its pages back
    budget = KV_CACHE_BYTES if opts.kv_cache_bytes is None else opts.kv_cache_bytes
    int8 = opts.kv_cache_dtype == "int8"
    window = opts.max_context or fitting_context(spec, opts.num_slots, model.dtype, budget, int8)
    return TorchBackend(model, f.snapshot, num_slots=opts.num_slots, max_context=window,
                        kv_blocks=opts.kv_blocks, kv_cache_bytes=opts.kv_cache_bytes,
                        block_size=opts.block_size, kv_int8=int8)
