"""Run the benchmarks' smoke modes: every script here (or those named) with ``--smoke``.

A smoke run is a script's own code end to end (build, measure, table, JSON) on the tiny model
at the smallest sizes, in seconds: it checks that the script still works; its figures mean
nothing. ``tests/test_benchmarks_smoke.py`` runs this and checks each script's JSON.

Each script runs in a process of its own with ``--smoke --out DIR/NAME.json`` (for
``moe_tune``, whose ``--out`` is a folder of tables: ``DIR/moe_tune``), its output going to
``DIR/NAME.log``. By default that process is forked from this one after torch and the library
are imported once (a fresh interpreter per script would cost more than most smoke runs;
nothing here starts a thread or touches triton before forking); ``--spawn`` runs each as
``python benchmarks/NAME.py`` instead. Every run gets ``OMP_NUM_THREADS=--threads`` (1 by
default: on a busy machine a second intra-op thread can make a step many times slower while it
waits at barriers for a descheduled sibling, and a smoke run's figures mean nothing anyway). A
run that outlives ``--timeout`` is killed with the processes it started. Prints a line per script and writes ``DIR/smoke.json``: per script its
exit status, seconds, JSON and log paths. Exit status 1 when any failed.

``--serve`` is for the tests: it reads script names from stdin, one a line, runs each when it
arrives and answers with one JSON line (``name``, ``rc``, ``seconds``, ``out``, ``log``; the
first line says it is ready), so that each test times its own script.

Run: ``.venv/bin/python benchmarks/smoke.py [NAME ...] [--dir DIR] [--timeout 120] [--spawn]``
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LIBRARIES = ("iterative_bounds", "moe_common", "random_checkpoint", "smoke")
"""Modules here that are no benchmark: imported by the scripts (and this runner itself)."""
FOLDER_OUT = ("moe_tune",)
"""Scripts whose ``--out`` is a folder (the tuner writes a table file named by its key)."""
PRELOAD = ("torch", "numpy", "pipeline", "pipeline.builder", "pipeline.pipe", "pipeline.engine",
           "pipeline.trace", "pipeline.testing", "backends.torch.backend", "pipeline.gguf_file",
           "backends.gguf.load", "stages.structured", "stages.process", "stages.select",
           "stages.strategies",
           "transports.sse", "transports.http.server.app", "httpx", "jsonschema", "transformers",
           "transformers.generation.logits_process")
"""What the forking parent imports once (whichever are installed). Nothing that imports
triton: the MoE scripts must set ``TRITON_INTERPRET`` before it loads."""


def scripts() -> list[str]:
    """Every benchmark script here, by name."""
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in LIBRARIES)


def out_path(name: str, folder: Path) -> Path:
    """Where ``name``'s smoke run writes (its ``--out``)."""
    return folder / name if name in FOLDER_OUT else folder / f"{name}.json"


def preload() -> float:
    """Import :data:`PRELOAD` (what is installed of it); seconds taken."""
    started = time.perf_counter()
    for module in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    return time.perf_counter() - started


def can_fork() -> bool:
    """Whether forking is safe here: a POSIX fork, one thread, triton not loaded yet."""
    return (hasattr(os, "fork") and threading.active_count() == 1
            and not any(m == "triton" or m.startswith("triton.") for m in sys.modules))


def _child(script: Path, argv: list[str], log: Path) -> None:
    """In the forked child: run ``script`` as ``__main__`` with ``argv``; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills what it started too
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = [str(script), *argv]
        sys.path[0] = str(script.parent)
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _kill_group(pgid: int) -> None:
    """Kill process group ``pgid`` (a smoke run's, and what it started) if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_forked(script: Path, argv: list[str], log: Path, timeout: float) -> int | None:
    """Exit status of ``script`` run in a forked child (None: killed at ``timeout``)."""
    pid = os.fork()
    if pid == 0:
        _child(script, argv, log)
    with contextlib.suppress(PermissionError, ProcessLookupError):
        os.setpgid(pid, pid)  # also here, so the group exists before any kill
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _kill_group(pid)  # whatever it left running
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _kill_group(pid)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.02)


def run_spawned(script: Path, argv: list[str], log: Path, timeout: float) -> int | None:
    """Exit status of ``python script argv`` (None: killed at ``timeout``)."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            _kill_group(proc.pid)
            proc.wait()


def smoke_run(name: str, folder: Path, timeout: float, fork: bool) -> dict[str, Any]:
    """Run ``name --smoke --out ...`` (forked or spawned): its exit status (None: timed out),
    seconds, JSON and log paths."""
    out, log = out_path(name, folder), folder / f"{name}.log"
    began = time.perf_counter()
    run = run_forked if fork else run_spawned
    code = run(HERE / f"{name}.py", ["--smoke", "--out", str(out)], log, timeout)
    return {"name": name, "rc": code, "seconds": round(time.perf_counter() - began, 2),
            "out": str(out), "log": str(log)}


def serve(folder: Path, timeout: float, fork: bool, preload_s: float) -> int:
    """Answer each name read from stdin with its run, as one JSON line on stdout."""
    known = scripts()
    print(json.dumps({"ready": True, "mode": "fork" if fork else "spawn",
                      "preload_s": round(preload_s, 2), "dir": str(folder)}), flush=True)
    while line := sys.stdin.readline():
        name = line.strip()
        if not name:
            continue
        result = (smoke_run(name, folder, timeout, fork) if name in known else
                  {"name": name, "rc": None, "error": f"unknown benchmark; known: {known}"})
        print(json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("names", nargs="*", help="scripts to run (default: all)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the JSON and logs go (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per script")
    parser.add_argument("--spawn", action="store_true",
                        help="a fresh interpreter per script instead of a fork of this one")
    parser.add_argument("--serve", action="store_true",
                        help="run the names read from stdin, answering in JSON lines")
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP (torch intra-op) threads of every run (default 1)")
    args = parser.parse_args(argv)
    known = scripts()
    unknown = sorted(set(args.names) - set(known))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {known}")
    names = args.names or known
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    folder.mkdir(parents=True, exist_ok=True)
    src = str(ROOT / "src")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if src not in paths:  # the scripts' own children (servers, probes) import the library
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [src, *paths]))
    if src not in sys.path:
        sys.path.insert(1, src)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads, here or in a child
    fork = not args.spawn and can_fork()
    preload_s = preload() if fork else 0.0
    fork = fork and can_fork()  # the imports started no thread and loaded no triton
    if args.serve:
        return serve(folder, args.timeout, fork, preload_s)
    summary: dict[str, Any] = {"mode": "fork" if fork else "spawn",
                               "preload_s": round(preload_s, 2), "runs": {}}
    print(f"smoke runs in {folder} ({summary['mode']}; preload {preload_s:.1f} s)", flush=True)
    started = time.perf_counter()
    for name in names:
        run = smoke_run(name, folder, args.timeout, fork)
        summary["runs"][name] = {k: v for k, v in run.items() if k != "name"}
        code = run["rc"]
        state = "ok" if code == 0 else f"timed out ({args.timeout:.0f} s)" if code is None \
            else f"FAILED ({code})"
        print(f"{name:<18} {state:<10} {run['seconds']:6.1f} s", flush=True)
    summary["total_s"] = round(time.perf_counter() - started + preload_s, 2)
    (folder / "smoke.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [n for n, r in summary["runs"].items() if r["rc"] != 0]
    print(f"{len(names) - len(failed)} of {len(names)} ok in {summary['total_s']:.1f} s"
          + (f"; failed: {', '.join(failed)} (logs in {folder})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
