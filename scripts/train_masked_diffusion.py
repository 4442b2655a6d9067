"""Train the small masked-diffusion model that ships inside the package
(``src/pipeline/diffusion_models/masked``).

What it reads: the same corpus and the same chat conversations as the tiny autoregressive model
(``scripts/train_default_model.py``: CPython's pydoc topics and standard-library docstrings,
wrapped in ChatML conversations), tokenized with that model's tokenizer plus one added special
token, ``<|mask|>``.

What it learns: a block-diffusion denoiser in the BD3-LM style (Arriola et al. 2025), so that a
KV cache of finished blocks is exact at sampling time. Each training sequence of ``seq_len``
tokens is cut into blocks of a length drawn per batch from ``BLOCK_LENGTHS`` (the first block
cut short by a random offset, so blocks start anywhere, as they do after a prompt). Every block
gets a masking rate ``t ~ U(0, 1)`` and each of its tokens is replaced by ``<|mask|>`` with
probability ``t``. The model sees the clean sequence and the noisy one side by side (``2 *
seq_len`` inputs, the noisy copy at the same positions):

* a clean token attends causally to the clean tokens up to itself (exactly what the engine's
  prompt prefill and a finished block's cache write compute);
* a noisy token attends to the clean tokens before its block and bidirectionally to every
  token of its own noisy block (exactly what a denoising pass over the cached prefix computes).

The loss is MDLM's / LLaDA's: cross-entropy at the masked positions, weighted by ``1/t``,
averaged over the sequence's tokens -- an upper bound on the negative log-likelihood per token.

The architecture is a dense ``Qwen3ForCausalLM`` (RMSNorm, q/k norms, rotary positions, SwiGLU,
tied embeddings), written out in plain torch so the attention mask above can be used; the saved
folder is a Hugging Face layout the torch backend loads, with a ``pipeline_generation`` key in
``config.json`` that marks it as a masked-diffusion model and names its defaults.

The run is deterministic from ``--seed`` (seeded ``random.Random`` and torch generators,
deterministic algorithms, a fixed thread count): ``--steps`` sets the learning-rate schedule and
``--minutes`` is a wall-clock guard that stops early (the log says so, and then the weights
depend on the machine's speed).

Usage::

    python scripts/train_masked_diffusion.py --out src/pipeline/diffusion_models/masked
    python scripts/train_masked_diffusion.py --out /tmp/smoke --steps 20 --minutes 2
    python scripts/train_masked_diffusion.py --out src/pipeline/diffusion_models/masked --samples-only
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as corpus  # noqa: E402  (the corpus of the tiny AR model)

REPO = Path(__file__).resolve().parent.parent
AR_MODEL = REPO / "src" / "pipeline" / "default_model"
MASK_TOKEN = "<|mask|>"
BLOCK_LENGTHS = (4, 8, 16, 32)
DEFAULT_STRATEGY = "llada"
DEFAULT_BLOCK_LENGTH = 8
DEFAULT_STEPS = 8


@dataclass
class TrainConfig:
    """Everything that decides the weights; recorded next to them."""

    seed: int = 1234
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 500
    lr: float = 3e-3
    warmup_steps: int = 40
    weight_decay: float = 0.1
    min_mask_rate: float = 1e-3
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    threads: int = 1


# ---------------------------------------------------------------------------------------------
# Tokenizer and data
# ---------------------------------------------------------------------------------------------

def masked_tokenizer() -> Tokenizer:
    """The tiny AR model's tokenizer with ``<|mask|>`` added as a special token (last id)."""
    tok = Tokenizer.from_file(str(AR_MODEL / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(MASK_TOKEN, special=True, normalized=False)])
    return tok


def prepare_data(cfg: TrainConfig, tok: Tokenizer) -> tuple[list[list[int]], list[list[int]],
                                                            dict[str, Any]]:
    """The AR model's conversations, encoded; every 50th is held out (as there)."""
    sections = corpus.topic_sections() + corpus.docstring_sections(corpus.stdlib_module_names())
    convs = corpus.conversations(sections, cfg.seed)
    hf_tok = corpus.hf_tokenizer(tok)
    docs = corpus.encode_conversations(convs, hf_tok)
    train_docs = [d for i, d in enumerate(docs) if i % 50 != 49]
    held_out = [d for i, d in enumerate(docs) if i % 50 == 49]
    stats = {"sections": len(sections), "conversations": len(convs),
             "corpus_sha256": corpus.corpus_digest(sections),
             "train_tokens": sum(map(len, train_docs)), "held_out_tokens": sum(map(len, held_out))}
    print(json.dumps(stats), flush=True)
    return train_docs, held_out, stats


def pack(docs: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle the documents with ``seed``, concatenate, and cut ``[n, seq_len]`` blocks."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = len(stream) // seq_len
    return torch.tensor(stream[:n * seq_len], dtype=torch.long).view(n, seq_len)


def batches(docs: list[list[int]], cfg: TrainConfig) -> Iterator[torch.Tensor]:
    """Endless ``[batch, seq_len]`` batches; each epoch re-shuffles with ``seed + epoch``."""
    epoch = 0
    while True:
        blocks = pack(docs, cfg.seq_len, cfg.seed + epoch)
        order = torch.randperm(len(blocks),
                               generator=torch.Generator().manual_seed(cfg.seed + epoch))
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            yield blocks[order[i: i + cfg.batch_size]]
        epoch += 1


# ---------------------------------------------------------------------------------------------
# Block-causal noising
# ---------------------------------------------------------------------------------------------

def block_ids(n: int, length: int, offset: int) -> torch.Tensor:
    """``[n]`` block index of each position: blocks start at ``offset``, ``offset + length``,
    ... (positions before ``offset`` form a short block 0 when ``offset`` > 0)."""
    return (torch.arange(n) + (length - offset) % length) // length


def attention_mask(blocks: torch.Tensor) -> torch.Tensor:
    """``[2N, 2N]`` bool (True: may attend) over ``[clean (N), noisy (N)]`` inputs.

    clean i -> clean j when j <= i; noisy i -> clean j when block(j) < block(i); noisy i ->
    noisy j when block(j) == block(i); clean never sees noisy.
    """
    n = blocks.shape[0]
    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]                                     # [N, N]
    before = blocks[None, :] < blocks[:, None]
    same = blocks[None, :] == blocks[:, None]
    top = torch.cat([causal, torch.zeros(n, n, dtype=torch.bool)], 1)
    bottom = torch.cat([before, same], 1)
    return torch.cat([top, bottom], 0)


def noise(batch: torch.Tensor, blocks: torch.Tensor, mask_id: int, min_rate: float,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(noisy [B, N], masked [B, N] bool, rate [B, N])``: a rate ``t`` per block, each token
    masked with probability ``t`` (LLaDA's ``(1 - eps) * t + eps``)."""
    b, n = batch.shape
    count = int(blocks[-1]) + 1
    t = torch.rand(b, count, generator=gen)
    rate = ((1 - min_rate) * t + min_rate)[:, blocks]                         # [B, N]
    masked = torch.rand(b, n, generator=gen) < rate
    return torch.where(masked, torch.full_like(batch, mask_id), batch), masked, rate


# ---------------------------------------------------------------------------------------------
# The model: a dense Qwen3 decoder in plain torch, with Hugging Face parameter names
# ---------------------------------------------------------------------------------------------

class Qwen3(torch.nn.Module):
    """``Qwen3ForCausalLM``'s computation; ``forward`` takes an explicit attention mask."""

    def __init__(self, cfg: TrainConfig, vocab: int) -> None:
        super().__init__()
        self.cfg, self.head_dim = cfg, cfg.hidden_size // cfg.num_heads
        h, d, kv = cfg.hidden_size, self.head_dim, cfg.num_kv_heads
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.embed = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.q, layer.k, layer.v = lin(h, cfg.num_heads * d), lin(h, kv * d), lin(h, kv * d)
            layer.o, layer.gate, layer.up = lin(cfg.num_heads * d, h), lin(h, cfg.intermediate_size), \
                lin(h, cfg.intermediate_size)
            layer.down = lin(cfg.intermediate_size, h)
            for name, size in (("attn_norm", h), ("mlp_norm", h), ("q_norm", d), ("k_norm", d)):
                setattr(layer, name, torch.nn.Parameter(torch.ones(size)))
            self.layers.append(layer)
        self.norm = torch.nn.Parameter(torch.ones(h))
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv, persistent=False)

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps) * w

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """transformers' rotate-half rotary embedding; ``x [B, heads, T, D]``."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]           # [T, D/2]
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Final normed hidden states ``[B, T, H]``; ``mask [T, T]`` bool or None (causal)."""
        cfg, d = self.cfg, self.head_dim
        x = self.embed(ids)
        b, t, _ = x.shape
        for layer in self.layers:
            y = self.rms(x, layer.attn_norm)
            q = self.rms(layer.q(y).view(b, t, cfg.num_heads, d), layer.q_norm).transpose(1, 2)
            k = self.rms(layer.k(y).view(b, t, cfg.num_kv_heads, d), layer.k_norm).transpose(1, 2)
            v = layer.v(y).view(b, t, cfg.num_kv_heads, d).transpose(1, 2)
            q, k = self.rope(q, positions), self.rope(k, positions)
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            x = x + layer.o(a.transpose(1, 2).reshape(b, t, -1))
            y = self.rms(x, layer.mlp_norm)
            x = x + layer.down(F.silu(layer.gate(y)) * layer.up(y))
        return self.rms(x, self.norm)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.embed.weight.T

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under ``Qwen3ForCausalLM``'s names (tied head: no ``lm_head``)."""
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm}
        names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                 "down": "mlp.down_proj"}
        norms = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for ours, theirs in names.items():
                out[p + theirs + ".weight"] = getattr(layer, ours).weight
            for ours, theirs in norms.items():
                out[p + theirs + ".weight"] = getattr(layer, ours)
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def diffusion_loss(model: Qwen3, batch: torch.Tensor, length: int, offset: int, mask_id: int,
                   cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """The ``1/t``-weighted masked cross-entropy per token (a NELBO estimate) of one batch."""
    b, n = batch.shape
    blocks = block_ids(n, length, offset)
    noisy, masked, rate = noise(batch, blocks, mask_id, cfg.min_mask_rate, gen)
    positions = torch.arange(n).repeat(2)
    h = model.hidden(torch.cat([batch, noisy], 1), positions, attention_mask(blocks))
    wanted = h[:, n:][masked]                                                 # [M, H]
    ce = F.cross_entropy(model.logits(wanted).float(), batch[masked], reduction="none")
    return (ce / rate[masked]).sum() / (b * n)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Qwen3, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; norms are not decayed."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train(model: Qwen3, docs: list[list[int]], mask_id: int, cfg: TrainConfig,
          minutes: float | None) -> dict[str, Any]:
    """Run the optimiser for ``cfg.steps`` steps or until ``minutes`` pass; return the log."""
    opt, data, log = make_optimizer(model, cfg), batches(docs, cfg), []
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    start, window, step, stopped = time.monotonic(), [], 0, None
    model.train()
    for step in range(cfg.steps):
        if minutes is not None and time.monotonic() - start > minutes * 60:
            stopped = f"time budget of {minutes} min reached at step {step}"
            print(stopped, flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        length = rng.choice(BLOCK_LENGTHS)
        loss = diffusion_loss(model, next(data), length, rng.randrange(length), mask_id, cfg, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(float(loss.detach()))
        if (step + 1) % 25 == 0 or step + 1 == cfg.steps:
            elapsed = time.monotonic() - start
            mean = sum(window) / len(window)
            print(f"step {step + 1:5d}  loss {mean:.4f}  lr {lr_at(step, cfg):.2e}  "
                  f"{elapsed / 60:6.2f} min", flush=True)
            log.append({"step": step + 1, "loss": round(mean, 4), "minutes": round(elapsed / 60, 3)})
            window = []
    else:
        step = cfg.steps
    return {"steps_done": step, "stopped_early": stopped,
            "seconds": round(time.monotonic() - start, 1), "log": log}


@torch.no_grad()
def evaluate(model: Qwen3, docs: list[list[int]], mask_id: int, cfg: TrainConfig,
             length: int) -> dict[str, float]:
    """Held-out NELBO per token (nats; the masked-diffusion bound on the NLL, averaged over
    rates drawn from a fixed seed) with blocks of ``length``, and the causal-prefix
    cross-entropy of predicting a block's tokens from the clean prefix alone (all masked)."""
    model.eval()
    blocks, gen = pack(docs, cfg.seq_len, seed=0), torch.Generator().manual_seed(0)
    nelbo = []
    for i in range(0, len(blocks), cfg.batch_size):
        nelbo.append(float(diffusion_loss(model, blocks[i:i + cfg.batch_size], length, 0,
                                          mask_id, cfg, gen)))
    model.train()
    return {"block_length": length, "nelbo_per_token": round(sum(nelbo) / len(nelbo), 4)}


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------

def save(model: Qwen3, tok: Tokenizer, cfg: TrainConfig, out: Path) -> None:
    """The Hugging Face layout: bf16 safetensors, config with the pipeline marker, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(model.hf_state_dict(), str(out / "model.safetensors"), metadata={"format": "pt"})
    mask_id = tok.token_to_id(MASK_TOKEN)
    ar_config = json.loads((AR_MODEL / "config.json").read_text())
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": tok.get_vocab_size(), "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "sliding_window": None,
        "bos_token_id": None, "eos_token_id": ar_config["eos_token_id"],
        "pad_token_id": ar_config["pad_token_id"],
        "pipeline_generation": {
            "family": "masked_diffusion", "strategy": DEFAULT_STRATEGY,
            "mask_token_id": mask_id, "block_length": DEFAULT_BLOCK_LENGTH,
            "steps": DEFAULT_STEPS, "attention": "block_causal",
            "trained_block_lengths": list(BLOCK_LENGTHS)},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_config = json.loads((AR_MODEL / "tokenizer_config.json").read_text())
    tok_config["mask_token"] = MASK_TOKEN
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    shutil.copy(AR_MODEL / "generation_config.json", out / "generation_config.json")
    for path in out.iterdir():
        path.chmod(0o644)


SAMPLE_PROMPTS = ["Why is the sky usually blue? Answer in one sentence.",
                  "What is a list comprehension?", "What does the json module do?"]
SAMPLE_SETTINGS: list[dict[str, Any]] = [
    {"strategy": "llada", "block_length": 8, "steps": 8, "options": {}},
    {"strategy": "llada", "block_length": 8, "steps": 4, "options": {}},
    {"strategy": "llada", "block_length": 8, "steps": 8, "options": {"remasking": "random"}},
    {"strategy": "fast_dllm", "block_length": 8, "steps": 8, "options": {"threshold": 0.9}},
    {"strategy": "dfm", "block_length": 8, "steps": 8, "options": {}},
]


def samples(out: Path, seed: int) -> list[dict[str, Any]]:
    """Answer ``SAMPLE_PROMPTS`` through the pipeline with each of ``SAMPLE_SETTINGS``
    (greedy: temperature 0; 64 tokens at most)."""
    sys.path.insert(0, str(REPO / "src"))
    from pipeline import GenerationConfig, build

    results = []
    for setting in SAMPLE_SETTINGS:
        pipe = build(str(out), strategy=setting["strategy"], steps=setting["steps"],
                     block_length=setting["block_length"],
                     strategy_options=setting["options"] or None)
        for prompt in SAMPLE_PROMPTS:
            done = pipe.generate([{"role": "user", "content": prompt}],
                                 GenerationConfig(max_tokens=64, temperature=0.0, seed=seed))
            forwards = sum(1 for e in done.trace if e.event_type == "decode.completed")
            results.append({**{k: v for k, v in setting.items() if k != "options"},
                            **setting["options"], "prompt": prompt, "reply": done.text,
                            "tokens": len(done.token_ids), "model_forwards": forwards + 1})
            print(json.dumps(results[-1]), flush=True)
        pipe.close()
    return results


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; the defaults are the shipped model's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "src/pipeline/diffusion_models/masked",
                        help="folder to write the model to")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed, help="the run's seed")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps,
                        help="optimiser steps (sets the learning-rate schedule)")
    parser.add_argument("--minutes", type=float, default=28.0,
                        help="wall-clock guard for the optimiser loop (at most 30)")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads,
                        help="torch threads (the weights depend on it)")
    parser.add_argument("--samples-only", action="store_true",
                        help="only (re)write the sample answers of the model in --out")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 30:
        parser.error(f"--minutes must be in (0, 30], got {args.minutes}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Collect, tokenize, train, evaluate, save, and write ``training_log.json``."""
    args = parse_args(argv)
    log_path = args.out / "training_log.json"
    if args.samples_only:
        record = json.loads(log_path.read_text())
        record["samples"] = samples(args.out, record["config"]["seed"])
        log_path.write_text(json.dumps(record, indent=1) + "\n")
        return
    cfg = TrainConfig(seed=args.seed, steps=args.steps, threads=args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.monotonic()
    tok = masked_tokenizer()
    mask_id = tok.token_to_id(MASK_TOKEN)
    train_docs, held_out, stats = prepare_data(cfg, tok)
    model = Qwen3(cfg, tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}; mask id {mask_id}; data in {time.monotonic() - t0:.1f} s",
          flush=True)
    run = train(model, train_docs, mask_id, cfg, args.minutes)
    held = [evaluate(model, held_out, mask_id, cfg, n) for n in (8, 16)]
    print(json.dumps(held), flush=True)
    save(model, tok, cfg, args.out)
    record = {"config": asdict(cfg), "block_lengths": list(BLOCK_LENGTHS),
              "parameters": n_params, "mask_token_id": mask_id, "data": stats,
              "held_out": held, "versions": {"python": sys.version.split()[0],
                                             "torch": torch.__version__},
              "total_minutes": round((time.monotonic() - t0) / 60, 2), **run}
    log_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({p.name: p.stat().st_size for p in sorted(args.out.iterdir())}), flush=True)


if __name__ == "__main__":
    main()
