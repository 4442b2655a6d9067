"""A GGUF file's model, as the torch backend reads one: the metadata as ``config.json`` keys.

Owns :func:`hf_config`, the translation of GGUF metadata (read by :mod:`pipeline.gguf_file`)
into the keys of a Hugging Face ``config.json`` so
:meth:`~backends.torch.config.ModelSpec.from_hf_config` validates and resolves it exactly as
it does a folder's. Architectures: ``llama`` (``MixtralForCausalLM`` when it has experts),
``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``. A missing key or an unknown architecture is
an :class:`~pipeline.errors.ArtifactError` naming the file and the field.

Example::

    f = GGUFFile.open(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    spec = ModelSpec.from_hf_config(hf_config(f))
"""

from __future__ import annotations

from typing import Any

from pipeline.errors import ArtifactError
from pipeline.gguf_file import GGUFFile

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
