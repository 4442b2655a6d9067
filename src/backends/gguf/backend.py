"""The GGUF backend: a GGUF file's weights on the torch backend, from the build's one opening
of the file (:func:`pipeline.gguf_file.opened`, shared with the ``gguf`` tokenizer and chat
template of :mod:`stages.plugin`).

Owns :func:`hf_config`, the translation of GGUF metadata into the keys of a Hugging Face
``config.json`` so :meth:`~backends.torch.config.ModelSpec.from_hf_config` validates and
resolves it exactly as it does a folder's (architectures: ``llama``, ``MixtralForCausalLM``
when it has experts, ``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``; a missing key or an
unknown architecture is an :class:`~pipeline.errors.ArtifactError` naming the file and the
field), and the factory that :mod:`backends.plugin` registers as the ``backend`` named
``"gguf"``, which :func:`pipeline.build` picks for a model that is a GGUF file. It reads the
build's :class:`~pipeline.options.BackendOptions`: ``dtype`` is the compute dtype (default
float32), ``quantized`` keeps quantized matrices in their GGML encoding and multiplies chunk by
chunk (less memory, slower; default False: dequantize at load), and ``kv_blocks``,
``kv_cache_bytes`` and ``block_size`` size the KV pool as for the torch backend.

The torch backend's KV pool holds, by default, a whole window for every slot, so without a
``max_context`` the window is cut to what ``kv_cache_bytes`` (default 1 GiB) holds for
``num_slots`` slots (SmolLM2-135M, 8 slots: 2,816 of its 8,192 positions), in steps of 256,
and the pool is ``num_slots`` such windows (an explicit ``kv_cache_bytes`` or ``kv_blocks``
sizes it otherwise).
"""

from __future__ import annotations

from typing import Any

import torch

from backends.torch.config import ModelSpec
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.gguf_file import GGUFFile, opened
from pipeline.registry import BuildContext

KV_CACHE_BYTES = 1 << 30
"""The key/value cache a GGUF model gets when ``max_context`` is not given."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
"""GGUF ``general.architecture`` values and the Hugging Face class each loads as (``llama``
with experts is Mixtral)."""


def _architecture(f: GGUFFile) -> str:
    """``general.architecture``, checked against :data:`ARCHITECTURES`."""
    arch = f.need("general.architecture")
    if arch not in ARCHITECTURES:
        raise ArtifactError(f"{f.path}: general.architecture={arch!r} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)}")
    return str(arch)


def gguf_backend(ctx: BuildContext) -> Any:
    """The torch backend over the file's weights (dequantized to ``dtype`` at load, or kept
    quantized with ``quantized``)."""
    from backends.gguf.load import load_weights
    from backends.moe_choice import moe_function
    from backends.torch.backend import TorchBackend, fitting_context
    from backends.torch.model import Transformer
    from pipeline.process_memory import release_free_memory

    f, opts = opened(ctx), ctx.options
    opts.refuse_extra("gguf")
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
                        block_size=opts.block_size, kv_int8=int8, threads=opts.threads)


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` keys that ``f``'s metadata gives."""
    arch = _architecture(f)
    p = f"{arch}."
    experts = int(f.get(p + "expert_count", 0) or 0)
    name = "MixtralForCausalLM" if arch == "llama" and experts else ARCHITECTURES[arch]
    heads = int(f.need(p + "attention.head_count"))
    vocab = f.get(p + "vocab_size") or len(f.need("tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        "architectures": [name], "vocab_size": int(vocab),
        "hidden_size": int(f.need(p + "embedding_length")),
        "intermediate_size": int(f.get(p + "feed_forward_length", 0) or 0)
        or int(f.get(p + "expert_feed_forward_length", 1)),
        "num_hidden_layers": int(f.need(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(p + "attention.head_count_kv", heads)),
        "max_position_embeddings": int(f.need(p + "context_length")),
        "rms_norm_eps": float(f.need(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.get(p + "rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "dtype": "float32",
    }
    if f.get(p + "attention.key_length") is not None:
        cfg["head_dim"] = int(f.metadata[p + "attention.key_length"])
    cfg.update(_rope_scaling(f, p))
    if experts:
        cfg.update(_experts(f, p, arch, experts))
    if arch == "qwen2moe":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in f.tensors
    return cfg


def _rope_scaling(f: GGUFFile, p: str) -> dict[str, Any]:
    kind = f.get(p + "rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind not in ("linear", "yarn"):
        raise ArtifactError(f"{f.path}: {p}rope.scaling.type={kind!r} is not supported "
                            "(none, linear, yarn)")
    scaling: dict[str, Any] = {"rope_type": kind,
                               "factor": float(f.need(p + "rope.scaling.factor"))}
    original = f.get(p + "rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return {"rope_scaling": scaling}


def _experts(f: GGUFFile, p: str, arch: str, experts: int) -> dict[str, Any]:
    used = int(f.need(p + "expert_used_count"))
    if arch == "llama":  # Mixtral: the experts' width is the feed-forward length
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    out: dict[str, Any] = {"num_experts": experts, "num_experts_per_tok": used,
                           "moe_intermediate_size": int(f.need(p + "expert_feed_forward_length")),
                           "norm_topk_prob": arch == "qwen3moe"}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(
            f.get(p + "expert_shared_feed_forward_length", 0) or 0)
    return out
