"""Opening a GGUF file: its metadata, its tensor index, and the model spec they describe.

Owns :class:`GGUFFile` (a memory-mapped file read with the ``gguf`` package from the llama.cpp
project: key-value metadata as Python values, tensors by name, a content ``snapshot``) and
:func:`hf_config`, the translation of GGUF metadata into the keys of a Hugging Face
``config.json`` so :meth:`~backends.torch.config.ModelSpec.from_hf_config` validates and
resolves it exactly as it does a folder's. Architectures: ``llama`` (``MixtralForCausalLM``
when it has experts), ``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``.

Every problem is an :class:`~pipeline.errors.ArtifactError` naming the file and the field:
not a GGUF file, truncated, an unknown architecture, a missing key.

Example::

    f = GGUFFile.open(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    spec = ModelSpec.from_hf_config(hf_config(f))
    f.metadata["tokenizer.ggml.pre"]                      # 'smollm'
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import ArtifactError
from pipeline.events import digest_json
from pipeline.models import is_gguf_file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
"""GGUF ``general.architecture`` values and the Hugging Face class each loads as (``llama``
with experts is Mixtral)."""
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


@attrs.frozen(eq=False)
class GGUFFile:
    """A GGUF file's metadata (``metadata``: key → Python value) and tensors (``tensors``:
    name → the reader's tensor, whose ``data`` is a view of the memory-mapped file)."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, Any]
    snapshot: str

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        """Read ``path``'s header and index (the tensor data stays mapped, unread)."""
        import gguf

        if not path.is_file():
            raise ArtifactError(f"{path}: no such GGUF file")
        if not is_gguf_file(path):
            raise ArtifactError(f"{path}: not a GGUF file (it does not start with b'GGUF')")
        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the package raises ValueError, IndexError, ... on bad files
            raise ArtifactError(f"{path}: unreadable GGUF file ({type(exc).__name__}: {exc}); "
                                "is it truncated?") from exc
        metadata = {key: _value(path, key, field) for key, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
        return cls(path, metadata, tensors, _snapshot(metadata, tensors))

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the file lacks ``key``."""
        return self.metadata.get(key, default)

    def need(self, key: str) -> Any:
        """A metadata value the file must have."""
        if key not in self.metadata:
            raise ArtifactError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        """``general.architecture``, checked against :data:`ARCHITECTURES`."""
        arch = self.need("general.architecture")
        if arch not in ARCHITECTURES:
            raise ArtifactError(f"{self.path}: general.architecture={arch!r} is not supported; "
                                f"supported: {', '.join(ARCHITECTURES)}")
        return str(arch)


def _value(path: Path, key: str, field: Any) -> Any:
    try:
        return field.contents()
    except Exception as exc:
        raise ArtifactError(f"{path}: metadata key {key!r} cannot be read ({exc})") from exc


def _snapshot(metadata: Mapping[str, Any], tensors: Mapping[str, Any]) -> str:
    """A content digest of the metadata and the tensor index (names, types, shapes, sizes)."""
    meta = {k: v for k, v in metadata.items() if k not in _BIG_ARRAYS}
    meta.update({k: digest_json(metadata[k]) for k in _BIG_ARRAYS if k in metadata})
    index = [[t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.n_bytes)]
             for t in tensors.values()]
    return digest_json({"format": "gguf", "metadata": meta, "tensors": index})


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """The Hugging Face ``config.json`` keys that ``f``'s metadata gives."""
    arch = f.architecture
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
