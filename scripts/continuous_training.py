"""Shared training code of the two embedding-space models (continuous diffusion and flow).

``scripts/train_continuous_diffusion.py`` and ``scripts/train_flow.py`` differ only in how a
clean block of token embeddings is corrupted and what time value the model is told; the
rest is here: the corpus (the tiny AR model's, collected by ``train_default_model.py`` and
encoded with the tiny model's own tokenizer), the model (a small Llama-layout decoder with
the time MLP and self-conditioning projection of :mod:`backends.torch.conditioning`), the
block-causal training objective, the optimiser loop, and saving in the Hugging Face layout
with the ``pipeline_generation`` marker.

**Block-causal training** (BD3-LM's two-stream layout). A training row of N tokens is fed
twice: a clean stream (the token ids, causal attention, positions 0..N-1) and a noisy stream
(corrupted embeddings of the same tokens at the same positions). The row is cut into blocks
of ``block_length`` at a random offset; a noisy position attends to the clean positions
before its block and to every noisy position of its own block, never to later clean tokens.
That is exactly what generation computes: the prompt and the finished blocks sit in the KV
cache, written causally, and a block being denoised attends to that prefix and
bidirectionally to itself. So the cache of final blocks is exact, not an approximation.
The loss is the cross-entropy of the noisy positions' logits against the clean tokens (the
model predicts x0 as a distribution over the vocabulary; CDCD's score interpolation), with
self-conditioning on half of the batches (a first pass without, then the pass that learns,
fed the first pass's estimate, as in Chen et al.).

Runs are deterministic from ``--seed`` (seeded generators, deterministic algorithms, a fixed
thread count); ``--steps`` sets the schedule, ``--minutes`` is a wall-clock guard that stops
early, which the log then says.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from backends.torch.conditioning import embedding_space, time_features  # noqa: E402
from backends.torch.model import rms_norm  # noqa: E402
from backends.torch.rope import apply_rope  # noqa: E402

TINY = ROOT / "src" / "pipeline" / "default_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

Corrupt = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
"""``(x0 [B, N, H], block_of [B, N]) -> (x_t [B, N, H], time [B, N])`` for one batch."""


@dataclass
class TrainConfig:
    """Everything that decides the weights; recorded in the log next to them."""

    family: str = "continuous_diffusion"
    seed: int = 1234
    hidden_size: int = 192
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    seq_len: int = 96
    block_length: int = 16
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    self_condition_rate: float = 0.5
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


# --- model ----------------------------------------------------------------------------------


class Layer(nn.Module):
    """A pre-norm Llama block (the backend's math: RMSNorm, GQA + RoPE, SwiGLU)."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        y = rms_norm(x, self.input_layernorm, 1e-6)
        q = self.q_proj(y).view(b * n, self.heads, self.head_dim)
        k = self.k_proj(y).view(b * n, self.kv_heads, self.head_dim)
        v = self.v_proj(y).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, cos, sin).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = apply_rope(k, cos, sin).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        y = rms_norm(x, self.post_attention_layernorm, 1e-6)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Denoiser(nn.Module):
    """The trained model: token embeddings (tied head), layers, norm, time MLP, and the
    self-condition projection; :meth:`forward` runs the two-stream block-causal layout."""

    def __init__(self, cfg: TrainConfig, vocab_size: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(vocab_size, h)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(h))
        self.time_mlp = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h))
        self.self_condition = nn.Linear(h, h, bias=False)
        nn.init.zeros_(self.self_condition.weight)
        head_dim = h // cfg.num_heads
        base = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** base), persistent=False)

    def space(self) -> torch.Tensor:
        """The embedding space ``[V, H]`` (unit-RMS rows, differentiable)."""
        return embedding_space(self.embed_tokens.weight)

    def forward(self, ids: torch.Tensor, x_t: torch.Tensor, times: torch.Tensor,
                self_cond: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, N, V]`` at the noisy stream's positions, for clean ``ids [B, N]``,
        noisy inputs ``x_t [B, N, H]``, per-position ``times [B, N]``, the self-condition
        ``[B, N, H]`` (None: nothing added) and the ``[2N, 2N]`` attention mask."""
        b, n = ids.shape
        noisy = x_t + self.time_mlp(time_features(times.flatten(), x_t.shape[-1])).view_as(x_t)
        if self_cond is not None:
            noisy = noisy + self.self_condition(self_cond)
        x = torch.cat([self.embed_tokens(ids), noisy], dim=1)                   # [B, 2N, H]
        pos = torch.arange(n, device=ids.device).repeat(2)                       # [2N]
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().repeat(b, 1)                                             # [B*2N, D]
        sin = emb.sin().repeat(b, 1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = rms_norm(x[:, n:], self.norm, 1e-6)
        return F.linear(x, self.embed_tokens.weight)                            # [B, N, V]


def block_causal_mask(block_of: torch.Tensor) -> torch.Tensor:
    """``[B, 1, 2N, 2N]`` boolean: clean→clean causal; noisy→clean before its block;
    noisy→noisy within its block. ``block_of [B, N]`` numbers each position's block."""
    b, n = block_of.shape
    i = torch.arange(n)
    causal = (i[None, :] <= i[:, None]).expand(b, n, n)                         # [B, N, N]
    same = block_of[:, :, None] == block_of[:, None, :]
    before = block_of[:, None, :] < block_of[:, :, None]                         # key block < query's
    top = torch.cat([causal, torch.zeros(b, n, n, dtype=torch.bool)], dim=2)
    bottom = torch.cat([before, same], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


def block_ids(batch: int, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, N]`` block numbers, blocks of ``length`` cut at a random offset per row."""
    offset = torch.randint(0, length, (batch, 1), generator=gen)
    return (torch.arange(n)[None, :] + offset) // length


# --- data -----------------------------------------------------------------------------------


def corpus(seed: int) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """The tiny AR model's conversations, encoded with its tokenizer; every 50th held out."""
    import train_default_model as tdm
    from transformers import AutoTokenizer

    sections = tdm.topic_sections() + tdm.docstring_sections(tdm.stdlib_module_names())
    convs = tdm.conversations(sections, seed)
    tok = AutoTokenizer.from_pretrained(str(TINY))
    docs = tdm.encode_conversations(convs, tok)
    train = [d for i, d in enumerate(docs) if i % 50 != 49]
    held = [d for i, d in enumerate(docs) if i % 50 == 49]
    stats = {"sections": len(sections), "conversations": len(convs),
             "corpus_sha256": tdm.corpus_digest(sections),
             "train_tokens": sum(map(len, train)), "held_out_tokens": sum(map(len, held))}
    return train, held, stats


def pack(docs: list[list[int]], n: int, seed: int) -> torch.Tensor:
    """Documents shuffled by ``seed``, concatenated, cut into rows of ``n``."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in docs[i]]
    rows = len(stream) // n
    return torch.tensor(stream[:rows * n], dtype=torch.long).view(rows, n)


def batches(docs: list[list[int]], cfg: TrainConfig) -> Iterator[torch.Tensor]:
    """Endless batches; each epoch re-shuffles with ``seed + epoch``."""
    epoch = 0
    while True:
        rows = pack(docs, cfg.seq_len, cfg.seed + epoch)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            yield rows[order[i:i + cfg.batch_size]]
        epoch += 1


# --- training -------------------------------------------------------------------------------


def batch_loss(model: Denoiser, ids: torch.Tensor, corrupt: Corrupt, gen: torch.Generator,
               self_condition: bool) -> torch.Tensor:
    """Cross-entropy of the noisy stream's x0 logits for one batch."""
    blocks = block_ids(ids.shape[0], ids.shape[1], model.cfg.block_length, gen)
    mask = block_causal_mask(blocks)
    x0 = model.space()[ids]                                                  # [B, N, H]
    x_t, times = corrupt(x0, blocks, gen)
    sc = None
    if self_condition:
        with torch.no_grad():
            first = model(ids, x_t, times, None, mask)
            sc = first.float().softmax(-1) @ model.space().detach()
    logits = model(ids, x_t, times, sc, mask)
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Denoiser, docs: list[list[int]], cfg: TrainConfig, corrupt: Corrupt,
          minutes: float | None) -> dict[str, Any]:
    """The optimiser loop; returns the log."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    data, log, window, start, done = batches(docs, cfg), [], [], time.monotonic(), cfg.steps
    for step in range(cfg.steps):
        if minutes is not None and time.monotonic() - start > minutes * 60:
            print(f"time budget of {minutes} min reached at step {step}", flush=True)
            done = step
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        use_sc = torch.rand((), generator=gen).item() < cfg.self_condition_rate
        loss = batch_loss(model, next(data), corrupt, gen, use_sc)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(float(loss.detach()))
        if (step + 1) % 10 == 0:
            elapsed = time.monotonic() - start
            mean = sum(window) / len(window)
            print(f"step {step + 1:5d}  loss {mean:.4f}  {elapsed / 60:6.2f} min", flush=True)
            log.append({"step": step + 1, "loss": round(mean, 4), "minutes": round(elapsed / 60, 3)})
            window = []
    return {"steps_done": done, "seconds": round(time.monotonic() - start, 1), "log": log}


@torch.no_grad()
def evaluate(model: Denoiser, docs: list[list[int]], cfg: TrainConfig, corrupt: Corrupt
             ) -> float:
    """Mean held-out loss over a fixed set of batches and corruptions (no self-condition)."""
    model.eval()
    rows, gen = pack(docs, cfg.seq_len, seed=0), torch.Generator().manual_seed(0)
    losses = [float(batch_loss(model, rows[i:i + cfg.batch_size], corrupt, gen, False))
              for i in range(0, len(rows) - cfg.batch_size + 1, cfg.batch_size)]
    model.train()
    return sum(losses) / max(1, len(losses))


# --- saving ---------------------------------------------------------------------------------


def hf_state(model: Denoiser) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face Llama names (+ the conditioning tensors), bf16."""
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in hf_params(model).items()}


def load_hf_state(model: Denoiser, state: dict[str, torch.Tensor]) -> None:
    """Copy a saved folder's tensors (Hugging Face names) into ``model`` (float32)."""
    params = hf_params(model)
    if set(params) != set(state):
        raise ValueError(f"tensor names differ: {sorted(set(params) ^ set(state))[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name].float())


def hf_params(model: Denoiser) -> dict[str, torch.Tensor]:
    """The model's parameters under Hugging Face Llama names (+ the conditioning tensors)."""
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm,
           "model.time_mlp.0.weight": model.time_mlp[0].weight,
           "model.time_mlp.0.bias": model.time_mlp[0].bias,
           "model.time_mlp.2.weight": model.time_mlp[2].weight,
           "model.time_mlp.2.bias": model.time_mlp[2].bias,
           "model.self_condition.weight": model.self_condition.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer.input_layernorm
        out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{name}.weight"] = getattr(layer, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}.mlp.{name}.weight"] = getattr(layer, name).weight
    return out


def hf_config(cfg: TrainConfig, vocab_size: int, generation: dict[str, Any]) -> dict[str, Any]:
    """``config.json``: a Llama config, the conditioning, and the generation marker."""
    tiny = json.loads((TINY / "config.json").read_text())
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.hidden_size // cfg.num_heads,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True, "vocab_size": vocab_size,
        "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16", "bos_token_id": None,
        "eos_token_id": tiny["eos_token_id"], "pad_token_id": tiny["pad_token_id"],
        "embedding_conditioning": {"time": True, "self_condition": True},
        "pipeline_generation": generation,
    }


def save(model: Denoiser, cfg: TrainConfig, out: Path, generation: dict[str, Any]) -> None:
    """Write the folder: config, weights, and the tiny model's tokenizer files."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = model.embed_tokens.weight.shape[0]
    (out / "config.json").write_text(json.dumps(hf_config(cfg, vocab, generation), indent=2) + "\n")
    save_file(hf_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(TINY / name, out / name)


def samples(out: Path, prompts: list[str]) -> list[dict[str, str]]:
    """Answers of the saved model through the library, with its default strategy."""
    from pipeline import build

    pipe = build(str(out), strategy=json.loads((out / "config.json").read_text())
                 ["pipeline_generation"]["strategy"])
    found = []
    for prompt in prompts:
        done = pipe.generate([{"role": "user", "content": prompt}], max_tokens=48, seed=0)
        found.append({"prompt": prompt, "reply": done.text})
    return found


def parse_args(argv: list[str] | None, default_out: Path, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="output folder")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed, help="the run's seed")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps,
                        help="optimiser steps (sets the learning-rate schedule)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-clock guard for the optimiser loop (default: none)")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                        help="torch threads (the weights depend on it)")
    return parser.parse_args(argv)


def run(argv: list[str] | None, family: str, corrupt_for: Callable[[TrainConfig], Corrupt],
        generation: dict[str, Any], default_out: Path, description: str) -> None:
    """Collect, train, evaluate, save, sample, and write ``training_log.json``."""
    args = parse_args(argv, default_out, description)
    cfg = TrainConfig(family=family, seed=args.seed, steps=args.steps, threads=args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.monotonic()
    train_docs, held, stats = corpus(cfg.seed)
    print(json.dumps(stats), flush=True)
    vocab = json.loads((TINY / "config.json").read_text())["vocab_size"]
    model = Denoiser(cfg, vocab)
    params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {params:,}", flush=True)
    corrupt = corrupt_for(cfg)
    record = train(model, train_docs, cfg, corrupt, args.minutes)
    held_loss = evaluate(model, held, cfg, corrupt)
    print(f"held-out loss {held_loss:.4f}", flush=True)
    save(model, cfg, args.out, generation)
    log = {"config": asdict(cfg), "parameters": params, "data": stats,
           "held_out_loss": round(held_loss, 4), "generation": generation, **record,
           "versions": {"python": sys.version.split()[0], "torch": torch.__version__}}
    try:
        log["samples"] = samples(args.out, SAMPLE_PROMPTS)
    except Exception as exc:  # the weights are saved either way; say why there are no samples
        log["samples_error"] = repr(exc)
    log["total_minutes"] = round((time.monotonic() - t0) / 60, 2)
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


SAMPLE_PROMPTS = ["What is the os module?", "Explain the assert statement.",
                  "What does str.split do?"]
