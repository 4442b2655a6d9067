"""Shared by the expert-tier and parallel benchmarks: a random Qwen3 checkpoint written to a
folder (float32 safetensors, one tensor per matrix, as transformers saves them), dense or MoE.

No benchmark of its own (``LIBRARIES`` in ``benchmarks/smoke.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def random_qwen3(folder: Path, *, hidden: int, layers: int, heads: int, kv_heads: int,
                 head_dim: int, vocab: int, intermediate: int, scale: float,
                 experts: int = 0, top_k: int = 4, router_scale: float = 0.5) -> Path:
    """A random ``Qwen3ForCausalLM`` (``experts`` 0) or ``Qwen3MoeForCausalLM`` checkpoint in
    ``folder``: matrices drawn N(0, ``scale``²) (the router's N(0, ``router_scale``²), the
    token table's N(0, 1)), norms at one; ``intermediate`` is the dense MLP's width, or each
    expert's."""
    from safetensors.torch import save_file

    config = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "dtype": "float32", "hidden_act": "silu"}
    if experts:
        config |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "intermediate_size": 2048, "moe_intermediate_size": intermediate,
                   "num_experts": experts, "num_experts_per_tok": top_k,
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    else:
        config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "intermediate_size": intermediate}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, std: float = scale) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def mlp(p: str) -> dict[str, torch.Tensor]:
        return {f"{p}.gate_proj.weight": w(intermediate, hidden),
                f"{p}.up_proj.weight": w(intermediate, hidden),
                f"{p}.down_proj.weight": w(hidden, intermediate)}

    t = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0),
         "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        t |= {f"{p}.input_layernorm.weight": torch.ones(hidden),
              f"{p}.post_attention_layernorm.weight": torch.ones(hidden),
              f"{p}.self_attn.q_proj.weight": w(heads * head_dim, hidden),
              f"{p}.self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
              f"{p}.self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
              f"{p}.self_attn.o_proj.weight": w(hidden, heads * head_dim),
              f"{p}.self_attn.q_norm.weight": torch.ones(head_dim),
              f"{p}.self_attn.k_norm.weight": torch.ones(head_dim)}
        if experts:
            t[f"{p}.mlp.gate.weight"] = w(experts, hidden, std=router_scale)
            for e in range(experts):
                t |= mlp(f"{p}.mlp.experts.{e}")
        else:
            t |= mlp(f"{p}.mlp")
    save_file(t, str(folder / "model.safetensors"))
    return folder
