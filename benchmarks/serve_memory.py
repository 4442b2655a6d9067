"""Benchmark: resident memory of ``pipeline serve`` under traffic of varied shapes.

Starts ``pipeline serve`` (a subprocess on 127.0.0.1) on a model, sends ``--warmup`` requests,
then ``--requests`` more in waves: each wave is 1–16 concurrent chat requests (a batch size
drawn at random), each with a prompt of 1–``--max-prompt`` words (about as many tokens) and 1–8
new tokens, so the engine sees many distinct batch sizes and prefill chunk lengths. The
server's resident set (``VmRSS`` of ``/proc/PID/status``) is read after the warm-up and at each
checkpoint; the figure that matters is the growth after warm-up, and whether it levels off.
Answers are counted by status (0: the connection failed, counted rather than ending the run).
``--env KEY=VALUE`` (repeatable) sets the server's environment, to compare settings in one
sitting. Loopback only, bounded in count. Prints a table and writes
``benchmarks/results/serve_memory-<model>[-invariant=<mode>].json`` (``--out``), rewritten
with the rows so far at each checkpoint.

``--batch-invariant on|off`` is passed to the server (``auto``, the default: its own choice, on
for a CPU); the two modes meet different row counts in their matrix products.

Run: ``.venv/bin/python benchmarks/serve_memory.py --model tiny [--requests 3000]``;
``--smoke``: the same code in seconds on the tiny model (2 warm-up requests, then 6 in
checkpoints of 2, prompts of at most 8 words): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).parent / "results"
WORDS = ("river stone light paper garden window music silver orange winter market bridge "
         "cloud engine forest letter mirror planet signal thunder valley yellow anchor "
         "basket candle dragon feather harbor island jungle kettle ladder meadow").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start(model: str, port: int, data: str, max_context: int, invariant: str,
          env: dict[str, str]) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "transports.cli", "serve", "--host", "127.0.0.1", "--port",
            str(port), "--data-dir", data, "--slots", "16", "--max-queue", "64",
            "--max-context", str(max_context), "--batch-invariant", invariant]
    if model != "default":
        args += ["--model", model]
    return subprocess.Popen(args, env={**os.environ, "PIPELINE_API_KEYS": "", **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def one(client: httpx.Client, url: str, rng: random.Random, max_prompt: int) -> int:
    words = rng.randint(1, max_prompt)
    body = {"model": client.headers["x-served-model"], "temperature": 0, "max_tokens": rng.randint(1, 8),
            "messages": [{"role": "user",
                          "content": " ".join(rng.choice(WORDS) for _ in range(words))}]}
    try:
        return client.post(f"{url}/v1/chat/completions", json=body, timeout=300).status_code
    except httpx.TransportError:  # counted (as status 0) rather than ending the run
        return 0


def send(url: str, n: int, rng: random.Random, max_prompt: int,
         pool: concurrent.futures.ThreadPoolExecutor, client: httpx.Client) -> dict[int, int]:
    statuses: dict[int, int] = {}
    sent = 0
    while sent < n:
        batch = min(rng.randint(1, 16), n - sent)
        seeds = [rng.random() for _ in range(batch)]
        futures = [pool.submit(one, client, url, random.Random(s), max_prompt) for s in seeds]
        for f in futures:
            status = f.result()
            statuses[status] = statuses.get(status, 0) + 1
        sent += batch
    return statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--checkpoints", default="500,1000,2000,3000")
    parser.add_argument("--max-prompt", type=int, default=380)
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--batch-invariant", choices=("auto", "on", "off"), default="auto",
                        help="the server's --batch-invariant (auto: on, on a CPU)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default results/serve_memory-<model>[-<env>].json; "
                             "with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: a handful of short requests")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.warmup, args.requests, args.checkpoints = "tiny", 2, 6, "2,4,6"
        args.max_prompt, args.max_context = 8, 256
    env = dict(item.split("=", 1) for item in args.env)
    checkpoints = [c for c in map(int, args.checkpoints.split(",")) if c <= args.requests]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    tag = "-".join(f"{k}={v}" for k, v in sorted(env.items()))
    mode = "" if args.batch_invariant == "auto" else f"-invariant={args.batch_invariant}"
    name = f"serve_memory-{Path(args.model).name}{mode}{'-' + tag if tag else ''}"
    out = args.out or (Path(tempfile.gettempdir()) / f"{name}-smoke.json" if args.smoke
                       else RESULTS / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as data:
        server = start(args.model, port, data, args.max_context, args.batch_invariant, env)
        try:
            wait_ready(url, server)
            loaded = rss_mb(server.pid)
            served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            with concurrent.futures.ThreadPoolExecutor(16) as pool, \
                    httpx.Client(headers={"x-served-model": served}) as client:
                started = time.perf_counter()
                statuses = send(url, args.warmup, rng, args.max_prompt, pool, client)
                base = rss_mb(server.pid)
                rows.append({"requests": 0, "rss_mb": round(base, 1), "growth_mb": 0.0})
                done = 0
                for checkpoint in checkpoints:
                    for k, v in send(url, checkpoint - done, rng, args.max_prompt, pool,
                                     client).items():
                        statuses[k] = statuses.get(k, 0) + v
                    done = checkpoint
                    now = rss_mb(server.pid)
                    rows.append({"requests": done, "rss_mb": round(now, 1),
                                 "growth_mb": round(now - base, 1)})
                    print(f"{done:>6} requests  RSS {now:8.1f} MB  growth {now - base:7.1f} MB",
                          flush=True)
                    out.write_text(json.dumps({"partial": True, "rows": rows}, indent=2))
                wall = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(30)
    result = {"model": args.model, "batch_invariant": args.batch_invariant, "env": env, "max_context": args.max_context,
              "max_prompt_words": args.max_prompt, "warmup": args.warmup,
              "rss_loaded_mb": round(loaded, 1), "rows": rows, "statuses": statuses,
              "wall_s": round(wall, 1), "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
    print(f"\nmodel {args.model}, --batch-invariant {args.batch_invariant}, env {env or '(none)'}; loaded {loaded:.1f} MB, "
          f"after {args.warmup} warm-up requests {rows[0]['rss_mb']} MB; statuses {statuses}; "
          f"{wall:.0f} s; load {' '.join(result['loadavg'])}")
    print(f"{'requests':>8} {'RSS MB':>9} {'growth MB':>10}")
    for row in rows:
        print(f"{row['requests']:>8} {row['rss_mb']:>9} {row['growth_mb']:>10}")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
