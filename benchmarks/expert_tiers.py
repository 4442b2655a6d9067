"""Benchmark: an MoE model's decode speed against the fraction of its experts kept resident.

``BackendOptions(expert_cache_bytes=...)`` caps the memory of the routed experts; the rest are
read from the memory-mapped weight file when routing asks for them (:mod:`backends.torch.experts`).
For each model and setting, the same runs: a random 12-token prompt, then ``--tokens`` decode
steps fed random tokens (teacher forcing: each run routes afresh, and every setting sees the
same inputs), run 0 to warm up and ``--repeats`` timed runs, each with its own draw:

- **full**: every expert loaded (the ordinary model; the oracle for the tokens);
- **100 %**, **50 %**, **25 %**: a cap of that fraction of the experts' bytes, with the
  ``lfu`` and the ``lru`` policy.

Per setting: decode tokens per second, the cache's hit rate (routed lookups that found the
expert resident), bytes read from the file per token, resident expert bytes, and whether the
argmax of every step's logits equals the full model's (it must: the cap changes speed, not
results).

Models: ``tiny`` is the package's trained 4-layer, 8-expert Qwen3-MoE (its routing is skewed,
as trained routers are); ``random`` is a random Qwen3-MoE written to a temporary folder
(``--random-layers`` layers of ``--random-experts`` experts, hidden 512, expert width 768,
top-4: about 0.9 GB of float32 experts), whose routing is close to uniform, the hard case for
any cache. The file's pages stay in the operating system's page cache between misses here
(the machine has the memory), so a miss costs a copy, a conversion and (float32 on a CPU) a
oneDNN repack, not a disk read: on a machine where the file does not fit in memory, misses
cost more.

Prints a table, writes ``benchmarks/results/expert_tiers.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/expert_tiers.py [--tokens 48]``; ``--smoke``: the tiny
model only, 4 tokens: it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from backends.torch.backend import TorchBackend
from pipeline.model_paths import TINY_MODEL_DIR
from pipeline.contracts.model import PrefillChunk
from random_checkpoint import random_qwen3

def random_moe(folder: Path, layers: int, experts: int) -> Path:
    """The random Qwen3-MoE of the module docstring (float32 safetensors)."""
    return random_qwen3(folder, hidden=512, layers=layers, heads=8, kv_heads=4, head_dim=64,
                        vocab=8192, intermediate=768, scale=0.05, experts=experts, top_k=4)


def decode(backend: TorchBackend, tokens: int, run: int) -> tuple[list[int], float]:
    """Run ``run``'s decode: a 12-token prompt, then ``tokens`` decode steps fed tokens drawn
    for that run (teacher forcing, so every setting sees the same inputs and a new run
    routes afresh instead of replaying the last one). Returns the argmax of every step's
    logits (the capped model's must equal the full model's) and the decode's tokens per
    second."""
    g = torch.Generator().manual_seed(run)
    vocab = backend.vocab_size
    prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
    feed = torch.randint(0, vocab, (tokens,), generator=g).tolist()
    slot = backend.allocate()
    z = backend.prefill([PrefillChunk(slot, tuple(prompt), 0, True)])[0]
    out = [int(z.argmax())]
    start = time.perf_counter()
    for t in feed:
        out.append(int(backend.decode([slot], [t])[0].argmax()))
    elapsed = time.perf_counter() - start
    backend.release(slot)
    return out, tokens / elapsed


def measure(name: str, folder: Path, tokens: int, fractions: list[float],
            repeats: int) -> list[dict[str, Any]]:
    """Run 0 warms up (and fills a cache); runs 1..repeats are timed (best kept)."""
    rows: list[dict[str, Any]] = []
    full = TorchBackend.from_dir(folder, num_slots=1, max_context=512, dtype="float32")
    runs = [decode(full, tokens, r) for r in range(repeats + 1)]
    want = [r[0] for r in runs]
    spec, moe = full.model.spec, full.model.spec.moe
    assert moe is not None
    experts = len(spec.moe_layers) * moe.num_experts * 3 * moe.intermediate_size * spec.hidden_size
    rows.append({"model": name, "setting": "full", "policy": "-",
                 "tok_s": max(r[1] for r in runs[1:]), "hit_rate": 1.0, "read_per_token": 0,
                 "resident_bytes": experts * 4, "same_tokens": True})
    del full
    for fraction in fractions:
        for policy in ("lfu", "lru"):
            backend = TorchBackend.from_dir(folder, num_slots=1, max_context=512,
                                            dtype="float32",
                                            expert_cache_bytes=int(experts * 4 * fraction),
                                            expert_cache_policy=policy)
            cache = backend.model.experts
            assert cache is not None
            got = [decode(backend, tokens, 0)]
            before = (cache.stats.hits, cache.stats.misses, cache.stats.read_bytes)
            got += [decode(backend, tokens, r) for r in range(1, repeats + 1)]
            hits = cache.stats.hits - before[0]
            misses = cache.stats.misses - before[1]
            rows.append({
                "model": name, "setting": f"{fraction:.0%}", "policy": policy,
                "tok_s": max(r[1] for r in got[1:]), "hit_rate": hits / max(1, hits + misses),
                "read_per_token": (cache.stats.read_bytes - before[2]) / (repeats * tokens),
                "resident_bytes": cache.stats.resident_bytes,
                "same_tokens": [r[0] for r in got] == want})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random-layers", type=int, default=6)
    parser.add_argument("--random-experts", type=int, default=32)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "expert_tiers.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    fractions = [1.0, 0.5, 0.25]
    with open("/proc/loadavg") as fh:
        load_before = fh.read().split()[:3]
    rows = measure("tiny", TINY_MODEL_DIR, 4 if args.smoke else args.tokens, fractions,
                   1 if args.smoke else args.repeats)
    if not args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            folder = random_moe(Path(tmp) / "random", args.random_layers, args.random_experts)
            rows += measure("random", folder, args.tokens, fractions, args.repeats)
    with open("/proc/loadavg") as fh:
        load_after = fh.read().split()[:3]
    print(f"{'model':7} {'setting':8} {'policy':6} {'tok/s':>8} {'hit rate':>9} "
          f"{'read/token':>12} {'resident':>12} same")
    for r in rows:
        print(f"{r['model']:7} {r['setting']:8} {r['policy']:6} {r['tok_s']:8.1f} "
              f"{r['hit_rate']:9.1%} {r['read_per_token'] / 1e6:10.2f}MB "
              f"{r['resident_bytes'] / 1e6:10.1f}MB {r['same_tokens']}")
    print(f"load before {' '.join(load_before)}, after {' '.join(load_after)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads":
        torch.get_num_threads(), "load_before": load_before, "load_after": load_after,
        "tokens": args.tokens, "smoke": args.smoke, "rows": rows}, indent=2))
    if not all(r["same_tokens"] for r in rows):
        raise SystemExit("a capped model's argmax tokens differ from the full model's")


if __name__ == "__main__":
    main()
