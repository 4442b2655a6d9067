"""Benchmark: the torch backend against transformers on the same random Qwen3-MoE weights.

Measures, in one run and on one machine:

- decode tokens/s at batch 1 and batch 8 (greedy, 128 new tokens after a 512-token prompt),
  ours through ``pipeline.generate``/``submit`` (the whole engine) vs transformers'
  ``generate``; decode time = total minus the time of the same call with 1 new token;
- decode at batch 1 as a fraction of the memory-bandwidth roofline: bytes of the parameters
  one token touches (attention, norms, router, top-k experts, the LM head) divided by the copy
  bandwidth measured here (``torch`` clone of a 512 MiB tensor, bytes read + written);
- prefill tokens/s for a 2,048-token prompt vs transformers, and as a fraction of the fp32
  matmul peak measured here (``torch.mm`` at the model's shapes);
- peak resident memory of our side alone (a child process that loads the same folder and runs
  the same prefill and batch-8 decode) vs weights + KV cache.

Prints a table and writes ``benchmarks/results/torch_backend.json`` (``--out``).
Run: ``.venv/bin/python benchmarks/torch_backend.py [--quick]``. ``--smoke``: the same code in
seconds on a tiny random Qwen3-MoE (one layer, H = 64, four experts; 16 new tokens after an
8-token prompt, a 32-token prefill, an 8 MiB copy, the memory run in this process rather than
a child): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from pipeline import build
from pipeline.engine import EngineConfig
from pipeline.testing import ByteDetokenizer, ByteTokenizer, ChatMLRenderer

RESULTS = Path(__file__).parent / "results" / "torch_backend.json"
FULL = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
            num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=512, intermediate_size=2048, vocab_size=32000)
QUICK = dict(FULL, num_hidden_layers=2, num_experts=8, vocab_size=4096)
SMOKE = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             intermediate_size=64, vocab_size=512)


def make_model(shape: dict[str, int], folder: Path) -> transformers.PreTrainedModel:
    """A random-weight Qwen3-MoE saved to ``folder`` (fp32)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**shape, max_position_embeddings=4096,
                                         tie_word_embeddings=True, norm_topk_prob=True)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls, in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def hf_generate(model: Any, ids: torch.Tensor, new: int) -> None:
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0, eos_token_id=None)


def ours_generate(pipe: Any, prompts: list[list[int]], new: int) -> None:
    """Submit every prompt at once (raw text whose byte tokens are the ids), wait for all."""
    handles = [pipe.submit(_raw(ids), max_tokens=new, temperature=0, ignore_eos=True)
               for ids in prompts]
    for h in handles:
        h.result()


def _raw(ids: list[int]) -> Any:
    from pipeline.contracts.request import Request

    return Request(prompt=bytes(ids).decode("ascii"))  # ASCII bytes: one token each


def decode_rates(model: Any, pipe: Any, batch: int, prompt_len: int, new: int,
                 repeats: int) -> dict[str, float]:
    """Decode tokens/s for ours and transformers at ``batch``."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(32, 127, (batch, prompt_len), generator=gen)  # ASCII bytes
    prompts = [row.tolist() for row in ids]
    hf_total = timed(lambda: hf_generate(model, ids, new), repeats)
    hf_first = timed(lambda: hf_generate(model, ids, 1), repeats)
    ours_total = timed(lambda: ours_generate(pipe, prompts, new), repeats)
    ours_first = timed(lambda: ours_generate(pipe, prompts, 1), repeats)
    tokens = batch * (new - 1)
    ours = tokens / (ours_total - ours_first)
    hf = tokens / (hf_total - hf_first)
    return {"ours_tok_s": ours, "hf_tok_s": hf, "ratio": ours / hf}


def copy_bandwidth(mib: int = 512) -> float:
    """Bytes/s of a large tensor copy (read + write), best of 5."""
    src = torch.empty(mib * 2**18, dtype=torch.float32).fill_(1.0)  # mib MiB
    dst = torch.empty_like(src)
    best = min(timed(lambda: dst.copy_(src), 1) for _ in range(5))
    return 2 * src.numel() * 4 / best


def matmul_peak(m: int, k: int, n: int) -> float:
    """FLOP/s of an fp32 ``[m,k] @ [k,n]`` matmul, best of 5."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    best = min(timed(lambda: a @ b, 1) for _ in range(5))
    return 2 * m * k * n / best


def touched_bytes(shape: dict[str, int]) -> int:
    """Bytes of the fp32 parameters one decoded token reads."""
    h, d = shape["hidden_size"], shape["head_dim"]
    attn = h * d * (shape["num_attention_heads"] * 2 + shape["num_key_value_heads"] * 2)
    experts = shape["num_experts_per_tok"] * 3 * h * shape["moe_intermediate_size"]
    router = shape["num_experts"] * h
    per_layer = attn + experts + router + 2 * h + 2 * d
    return 4 * (shape["num_hidden_layers"] * per_layer + shape["vocab_size"] * h + h)


def prefill_rates(model: Any, pipe: Any, length: int, repeats: int) -> dict[str, float]:
    """Prefill tokens/s (ours vs transformers) for one ``length``-token prompt."""
    ids = torch.randint(32, 127, (1, length), generator=torch.Generator().manual_seed(1))
    hf = length / timed(lambda: hf_generate(model, ids, 1), repeats)
    ours = length / timed(lambda: ours_generate(pipe, [ids[0].tolist()], 1), repeats)
    return {"ours_tok_s": ours, "hf_tok_s": hf, "ratio": ours / hf}


def our_pipeline(folder: str, prefill_len: int) -> Any:
    """Our engine over ``folder`` with byte-level text stages (8 slots)."""
    return build(folder, tokenizer=ByteTokenizer(), renderer=ChatMLRenderer(),
                 detokenizer=ByteDetokenizer(),
                 engine=EngineConfig(token_budget=4096, max_prefill_chunk=4096),
                 options={"num_slots": 8, "max_context": prefill_len + 8})


def our_memory(folder: str, prefill_len: int, prompt_len: int, new: int) -> float:
    """Child process: load ours alone, prefill + batch-8 decode; peak RSS in MB."""
    torch.set_grad_enabled(False)
    with our_pipeline(folder, prefill_len) as pipe:
        ids = torch.randint(32, 127, (8, prompt_len), generator=torch.Generator().manual_seed(8))
        ours_generate(pipe, [ids[0].tolist() * (prefill_len // prompt_len)], 1)
        ours_generate(pipe, [row.tolist() for row in ids], new)
    return peak_rss_mb()


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM; ``ru_maxrss`` would carry the parent's peak
    across ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e3
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3


def our_peak_rss(folder: str, prefill_len: int, prompt_len: int, new: int) -> float:
    """Peak RSS (MB) of :func:`our_memory` in a fresh interpreter."""
    out = subprocess.run([sys.executable, __file__, "--memory-child", folder, str(prefill_len),
                          str(prompt_len), str(new)], check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a smoke run")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on a tiny random model, the memory run in this process")
    parser.add_argument("--memory-child", nargs=4, metavar=("DIR", "PREFILL", "PROMPT", "NEW"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        folder, *sizes = args.memory_child
        print(our_memory(folder, *map(int, sizes)))
        return
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    prompt_len, new, prefill_len = ((8, 16, 32) if args.smoke else (64, 16, 256) if args.quick
                                    else (512, 128, 2048))
    torch.set_grad_enabled(False)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(shape, Path(tmp))
        params = sum(p.numel() for p in model.parameters())
        pipe = our_pipeline(tmp, prefill_len)
        rows: dict[str, Any] = {"params": params, "shape": shape}
        rows["decode_b1"] = decode_rates(model, pipe, 1, prompt_len, new, args.repeats)
        rows["decode_b8"] = decode_rates(model, pipe, 8, prompt_len, new, args.repeats)
        bandwidth = copy_bandwidth(8 if args.smoke else 512)
        roofline = bandwidth / touched_bytes(shape)
        rows["roofline"] = {"copy_GBps": bandwidth / 1e9, "roofline_tok_s": roofline,
                            "fraction": rows["decode_b1"]["ours_tok_s"] / roofline}
        rows["prefill"] = prefill_rates(model, pipe, prefill_len, args.repeats)
        peak = matmul_peak(prefill_len, shape["hidden_size"], shape["hidden_size"])
        active = touched_bytes(shape) / 4  # active parameters per token
        rows["prefill"]["matmul_peak_GFLOPs"] = peak / 1e9
        rows["prefill"]["fraction_of_peak"] = rows["prefill"]["ours_tok_s"] * 2 * active / peak
        kv = pipe.engine.backend.cache
        kv_bytes = sum(t.numel() * t.element_size() for t in [*kv.k, *kv.v])
        pipe.close()
        ours_peak = (our_memory(tmp, prefill_len, prompt_len, new) if args.smoke else
                     our_peak_rss(tmp, prefill_len, prompt_len, new))
        rows["memory"] = {"ours_peak_rss_MB": ours_peak,
                          "weights_MB": params * 4 / 1e6, "kv_cache_MB": kv_bytes / 1e6,
                          "both_peak_rss_MB": peak_rss_mb()}
    rows["smoke"] = args.smoke
    report(rows)
    out = args.out or (Path(tempfile.gettempdir()) / "torch_backend-smoke.json" if args.smoke
                       else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


def report(rows: dict[str, Any]) -> None:
    """Print the table."""
    print(f"Qwen3-MoE, {rows['params'] / 1e6:.0f} M parameters, fp32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'measure':<22}{'ours':>12}{'transformers':>14}{'ratio':>9}")
    for key in ("decode_b1", "decode_b8", "prefill"):
        r = rows[key]
        print(f"{key + ' tok/s':<22}{r['ours_tok_s']:>12.1f}{r['hf_tok_s']:>14.1f}"
              f"{r['ratio']:>9.2f}")
    r = rows["roofline"]
    print(f"decode b1 vs roofline: {r['fraction']:.0%} of {r['roofline_tok_s']:.1f} tok/s "
          f"({r['copy_GBps']:.1f} GB/s copy)")
    p = rows["prefill"]
    print(f"prefill vs matmul peak: {p['fraction_of_peak']:.0%} of {p['matmul_peak_GFLOPs']:.0f}"
          " GFLOP/s")
    m = rows["memory"]
    print(f"ours alone: peak RSS {m['ours_peak_rss_MB']:.0f} MB vs weights "
          f"{m['weights_MB']:.0f} MB + KV {m['kv_cache_MB']:.0f} MB "
          f"(both engines in one process: {m['both_peak_rss_MB']:.0f} MB)")


if __name__ == "__main__":
    main()
