"""Benchmark: HTTP serving under load against the same requests in-process, same run.

Phase 1 (in-process): ``--requests`` chat requests to the embedded default model, at most
``--concurrency`` at a time, each consumed with ``Pipeline.astream`` on one asyncio loop.
Phase 2 (HTTP): the same requests, streamed over ``POST /v1/chat/completions`` from a server
started with ``pipeline serve`` on 127.0.0.1 (a subprocess, so client and server do not share
one interpreter), by a minimal asyncio HTTP/1.1 client (one connection per request; the SSE decoder of
``transports.sse``) with the same concurrency.
Phase 3 (disconnects): ``--disconnects`` streaming requests that each read a random 1–8 chunks
and then drop the connection; afterwards the server's ``/metrics`` must show zero active slots
and an empty queue.

Inter-token latency is measured at the consumer, between consecutive content pieces of one
stream; tokens/s is completion tokens over the phase's wall time. Greedy decoding, so both
phases generate the same tokens (both serve ``--model``). Bounded in count and time; loopback
only. Prints a table and writes ``benchmarks/results/http_load.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/http_load.py [--requests 128] [--concurrency 32]``;
``--smoke``: the same code in seconds on the tiny model (4 requests of 4 tokens, 2 at a time,
one round, 2 disconnects; the server a subprocess on a free port): it checks the script, its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

import httpx
import torch

from pipeline import build
from pipeline.pipe import Pipeline
from transports.http.accounting.usage import read_records
from transports.sse import SSEDecoder, SSEEvent

RESULTS = Path(__file__).parent / "results" / "http_load.json"


def prompts(n: int) -> list[str]:
    topics = ["a list", "a dict", "a generator", "a decorator", "a coroutine", "a module",
              "a class", "an exception"]
    return [f"Question {i}: what is {topics[i % len(topics)]} in Python?" for i in range(n)]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Tally:
    """Gaps between pieces, tokens, errors and wall time of one phase."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.pieces = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.wall = 0.0

    def row(self, name: str) -> dict[str, Any]:
        return {"phase": name, "requests_failed": len(self.errors), "tokens": self.tokens,
                "wall_s": round(self.wall, 3), "tokens_per_s": round(self.tokens / self.wall, 1),
                "tokens_per_piece": round(self.tokens / max(self.pieces, 1), 3),
                "itl_p50_ms": round(quantile(self.gaps, 0.5) * 1e3, 3),
                "itl_p99_ms": round(quantile(self.gaps, 0.99) * 1e3, 3),
                "errors": self.errors[:5]}


async def in_process(pipe: Pipeline, texts: list[str], max_tokens: int, limit: int) -> Tally:
    tally, gate = Tally(), asyncio.Semaphore(limit)

    async def one(text: str) -> None:
        async with gate:
            last = None
            async for delta in pipe.astream(text, max_tokens=max_tokens, temperature=0.0):
                now = time.perf_counter()
                if delta.text and last is not None:
                    tally.gaps.append(now - last)
                if delta.text:
                    last = now
                    tally.pieces += 1
                tally.tokens += len(delta.token_ids)

    start = time.perf_counter()
    await asyncio.gather(*(one(t) for t in texts))
    tally.wall = time.perf_counter() - start
    return tally


async def over_http(url: str, texts: list[str], max_tokens: int, limit: int,
                    drop_after: list[int] | None = None, model: str = "default") -> Tally:
    """``texts`` streamed to the server's ``model`` (the name it serves it under), at most
    ``limit`` at a time; request i dropped after ``drop_after[i]`` pieces when given."""
    tally, gate = Tally(), asyncio.Semaphore(limit)
    port = int(url.rsplit(":", 1)[1])

    async def one(i: int, text: str) -> None:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": text}]}
        async with gate:
            try:
                await stream(port, body, tally, drop_after[i] if drop_after else None)
            except Exception as exc:  # counted: the goal is zero
                tally.errors.append(repr(exc))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))
    tally.wall = time.perf_counter() - start
    return tally


async def sse_events(reader: asyncio.StreamReader) -> AsyncIterator[SSEEvent]:
    """Events of a chunked ``text/event-stream`` body, decoded by ``transports.sse``."""
    decoder = SSEDecoder()
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            break
        data = await reader.readexactly(size + 2)
        for event in decoder.feed(data[:-2]):
            yield event
    for event in decoder.close():
        yield event


async def stream(port: int, body: dict[str, Any], tally: Tally, drop_after: int | None) -> None:
    """One streamed request over a minimal HTTP/1.1 client (asyncio streams): the load
    generator shares the machine's cores, so it should spend as little CPU as it can."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        payload = json.dumps(body).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        status = (await reader.readline()).split()[1]
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if status != b"200" or b"transfer-encoding: chunked" not in headers:
            raise RuntimeError(f"status {status!r}: {await reader.read(300)!r}")
        last, pieces, done = None, 0, False
        async for event in sse_events(reader):
            if event.data == "[DONE]":
                done = True
                break
            chunk = json.loads(event.data)
            if chunk.get("usage"):
                tally.tokens += chunk["usage"]["completion_tokens"]
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                now = time.perf_counter()
                if last is not None:
                    tally.gaps.append(now - last)
                last, pieces = now, pieces + 1
                tally.pieces += 1
                if drop_after is not None and pieces >= drop_after:
                    return  # closing the socket mid-stream
        if not done and drop_after is None:
            raise RuntimeError("stream ended without [DONE]")
    finally:
        writer.close()


def start_server(port: int, data_dir: str, slots: int, threads: int,
                 model: str | None = None) -> subprocess.Popen[bytes]:
    """``pipeline serve`` of ``model`` (None: the default model) on ``port``, once healthy."""
    server = subprocess.Popen(
        [sys.executable, "-m", "transports.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--data-dir", data_dir, "--slots", str(slots), "--max-queue", "512",
         *(["--model", model] if model else [])],
        env={**os.environ, "PIPELINE_API_KEYS": "", "OMP_NUM_THREADS": str(threads)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("server did not become healthy")


def engine_gauges(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("pipeline_active_slots", "pipeline_queue_depth"))}
    return values["pipeline_active_slots"], values["pipeline_queue_depth"]


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (or of ``pid``), from /proc."""
    fields = Path(f"/proc/{pid or 'self'}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def served_model(url: str) -> str:
    """The name the server at ``url`` serves its (first) model under."""
    return str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])


def disconnect_phase(url: str, n: int, limit: int, data_dir: str) -> dict[str, Any]:
    rng = random.Random(0)
    drops = [rng.randint(1, 8) for _ in range(n)]
    tally = asyncio.run(over_http(url, prompts(n), 200, limit, drops, served_model(url)))
    start = time.perf_counter()
    while engine_gauges(url) != (0.0, 0.0):
        if time.perf_counter() - start > 30:
            break
        time.sleep(0.01)
    settle = time.perf_counter() - start
    active, queued = engine_gauges(url)
    time.sleep(0.5)  # let the writer commit the last records
    reasons = [r.finish_reason for r in read_records(Path(data_dir) / "usage.sqlite3")]
    return {"disconnects": n, "client_errors": len(tally.errors), "active_slots_after": active,
            "queue_depth_after": queued, "settled_s": round(settle, 3),
            "cancelled_records": reasons.count("cancelled")}


def run_rounds(args: argparse.Namespace, pipe: Pipeline, url: str, server_pid: int
               ) -> list[dict[str, Any]]:
    """Alternate the two phases ``--rounds`` times, so both see the same machine load."""
    texts, rows = prompts(args.requests), []
    for r in range(args.rounds):
        before = cpu_seconds()
        local = asyncio.run(in_process(pipe, texts, args.max_tokens, args.concurrency))
        rows.append({**local.row("in-process"), "round": r,
                     "cpu_s": round(cpu_seconds() - before, 2)})
        before, server_before = cpu_seconds(), cpu_seconds(server_pid)
        remote = asyncio.run(over_http(url, texts, args.max_tokens, args.concurrency,
                                       model=served_model(url)))
        rows.append({**remote.row("http"), "round": r,
                     "cpu_s": round(cpu_seconds(server_pid) - server_before, 2),
                     "client_cpu_s": round(cpu_seconds() - before, 2)})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, per phase, and the p50 inter-token overhead of HTTP."""
    out: dict[str, Any] = {}
    for phase in ("in-process", "http"):
        mine = [r for r in rows if r["phase"] == phase]
        out[phase] = {k: statistics.median(r[k] for r in mine)
                      for k in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms", "cpu_s")}
        out[phase]["requests_failed"] = sum(r["requests_failed"] for r in mine)
    out["itl_p50_overhead"] = round(out["http"]["itl_p50_ms"] / out["in-process"]["itl_p50_ms"]
                                    - 1, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disconnects", type=int, default=100)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of the model, in both phases (the HTTP client "
                             "needs a core of its own on a small machine)")
    parser.add_argument("--model", default=None,
                        help="what both phases serve (default: the default model)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: 4 requests, 2 at a time, one round")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.requests, args.concurrency, args.max_tokens = "tiny", 4, 2, 4
        args.rounds, args.disconnects = 1, 2
    args.out = args.out or (Path(tempfile.gettempdir()) / "http_load-smoke.json"
                            if args.smoke else RESULTS)
    torch.set_num_threads(args.torch_threads)
    warm = prompts(args.concurrency)
    port, data_dir = free_port(), tempfile.mkdtemp(prefix="http-load-")
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, data_dir, args.concurrency, args.torch_threads, args.model)
    try:
        with build(args.model, options={"num_slots": args.concurrency}) as pipe:
            asyncio.run(in_process(pipe, warm, 4, args.concurrency))
            asyncio.run(over_http(url, warm, 4, args.concurrency, model=served_model(url)))
            rows = run_rounds(args, pipe, url, server.pid)
        drops = disconnect_phase(url, args.disconnects, args.concurrency, data_dir)
    finally:
        server.terminate()
        server.wait(30)
    print(f"{'round':>5} {'phase':<11} {'failed':>6} {'tokens':>7} {'wall s':>7} {'tok/s':>7} "
          f"{'ITL p50 ms':>10} {'ITL p99 ms':>10} {'CPU s':>6}")
    for r in rows:
        print(f"{r['round']:>5} {r['phase']:<11} {r['requests_failed']:>6} {r['tokens']:>7} "
              f"{r['wall_s']:>7} {r['tokens_per_s']:>7} {r['itl_p50_ms']:>10} "
              f"{r['itl_p99_ms']:>10} {r['cpu_s']:>6}")
    med = summary(rows)
    print("medians:", json.dumps(med))
    print(f"HTTP adds {med['itl_p50_overhead'] * 100:+.1f} % to p50 inter-token latency "
          "(goal <= +10 %)")
    print("disconnects:", drops)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "rounds": rows, "medians": med, "disconnects": drops}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
