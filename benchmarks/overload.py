"""Benchmark: a server's completed requests and latency at its admission limit and far past it.

A server (``pipeline serve`` in a subprocess, its default limits: 8 slots and 64 queue places
per model unless ``--slots``/``--max-queue`` say otherwise) serves ``--model``. Closed-loop
clients (a minimal asyncio HTTP/1.1 client, one connection per request, so the load generator
spends little CPU) each send a non-streamed chat request of ``--max-tokens`` tokens, wait for
its answer, and send the next; a refused request (429, 503, 529) is sent again after the
wait its ``retry-after-ms`` or ``Retry-After`` header asks for, read as the OpenAI and
Anthropic SDKs read them (milliseconds first; a wait in (0, 120] s is honoured), else after
``--backoff`` seconds (0.5 s by default, the SDKs' first retry delay); with
``--ignore-retry-after`` always after ``--backoff``, as a client that reads no header (and as
every client did before the server sent one). Two phases per round, each ``--seconds`` long after ``--warmup`` seconds:

* ``limit``: as many clients as the server admits (slots + queue places): none is refused;
* ``overload``: ``--clients`` clients (200): the rest are refused, again and again.

For each phase: completed requests per second, the median and p90 latency of the requests
answered 200 (sent to answered, queueing included), refusals per second, the median wait the
refusals asked for, and the CPU seconds
per second of the server (from ``/proc``) and of the clients, which share its cores. The
ratios overload / limit of the rate and of the median are what the server must keep near 1
(goal: rate >= 0.8x, median <= 2x). The server's log is
counted too: ERROR lines and refusal summary lines. The machine's ``/proc/loadavg`` before and
after is recorded: other work on it shifts every figure. Last, in this process, the CPU
milliseconds the app itself spends on one refusal (the ASGI app called directly with a full
model: no socket, no uvicorn), a figure other load barely moves.

Prints a table and writes ``benchmarks/results/overload.json`` (``--out``). Run:
``.venv/bin/python benchmarks/overload.py [--model tiny] [--rounds 2] [--seconds 30]``;
``--smoke``: the tiny model, 2 slots and 2 queue places, 8 clients, one short round: it checks
the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).parent / "results" / "overload.json"
REFUSED = {429, 503, 529}
SDK_MAX_RETRY_AFTER_S = 120.0
"""The longest server-asked wait the OpenAI SDK honours (it does not retry past it)."""


def loadavg() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Phase:
    """What the clients of one phase saw inside its measured window."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.latencies: list[float] = []
        self.refused = 0
        self.asked: list[float] = []  # the waits the refusals asked for
        self.errors: list[str] = []

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end

    def row(self, name: str, clients: int, server_cpu_s: float,
            client_cpu_s: float) -> dict[str, Any]:
        seconds = self.end - self.start
        ordered = sorted(self.latencies)
        p90 = ordered[int(0.9 * (len(ordered) - 1))] if ordered else float("nan")
        return {"phase": name, "clients": clients, "seconds": round(seconds, 2),
                "completed": len(ordered), "completed_per_s": round(len(ordered) / seconds, 2),
                "median_s": round(statistics.median(ordered), 3) if ordered else None,
                "p90_s": round(p90, 3), "refused": self.refused,
                "refused_per_s": round(self.refused / seconds, 1),
                "asked_wait_s": (round(statistics.median(self.asked), 3) if self.asked
                                 else None),
                "server_cpu_per_s": round(server_cpu_s / seconds, 2),
                "client_cpu_per_s": round(client_cpu_s / seconds, 2),
                "errors": len(self.errors), "error_examples": self.errors[:3]}


async def ask(port: int, payload: bytes) -> tuple[int, float | None]:
    """One request; its status once the whole answer arrived, and the wait its headers ask
    for (:func:`asked_wait`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        answer = await reader.read()  # Connection: close: the answer ends with the connection
    finally:
        writer.close()
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(head[0].split()[1]), asked_wait(headers)


def asked_wait(headers: dict[str, str]) -> float | None:
    """The wait a response asks for, read as the OpenAI SDK reads it: ``retry-after-ms``
    first, then ``Retry-After`` in seconds; None when neither parses or the wait is outside
    (0, 120] s, where the SDK falls back to its own backoff (or, past 120 s, gives up)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            wait = float(headers[name]) * scale
        except (KeyError, ValueError):
            continue
        return wait if 0 < wait <= SDK_MAX_RETRY_AFTER_S else None
    return None


async def client(i: int, port: int, model: str, max_tokens: int, backoff: float,
                 honour: bool, phase: Phase) -> None:
    """Send requests one after the other until cancelled; count those inside the window. A
    refused one is sent again after the wait it asked for (``honour``), else ``backoff``."""
    n = 0
    while True:
        n += 1
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Client {i}, question {n}: what "
                                                         "is a Python generator?"}]}
        sent = time.monotonic()
        try:
            status, asked = await ask(port, json.dumps(body).encode())
        except (OSError, ValueError, IndexError) as exc:
            if phase.inside(time.monotonic()):
                phase.errors.append(repr(exc))
            await asyncio.sleep(backoff)
            continue
        now = time.monotonic()
        if status == 200:
            if phase.inside(now):
                phase.latencies.append(now - sent)
        elif status in REFUSED:
            if phase.inside(now):
                phase.refused += 1
                if asked is not None:
                    phase.asked.append(asked)
            await asyncio.sleep(asked if honour and asked is not None else backoff)
        elif phase.inside(now):
            phase.errors.append(f"status {status}")


async def run_phase(port: int, pid: int, model: str, clients: int,
                    args: argparse.Namespace) -> tuple[Phase, float, float]:
    """``clients`` clients for ``warmup + seconds``; the phase, and the server's and the
    clients' CPU seconds inside the measured window (they share the machine)."""
    start = time.monotonic() + args.warmup
    phase = Phase(start, start + args.seconds)
    honour = not args.ignore_retry_after
    tasks = [asyncio.create_task(client(i, port, model, args.max_tokens, args.backoff, honour,
                                        phase))
             for i in range(clients)]
    await asyncio.sleep(args.warmup)
    cpu_before, mine_before = cpu_seconds(pid), time.process_time()
    await asyncio.sleep(args.seconds)
    cpu, mine = cpu_seconds(pid) - cpu_before, time.process_time() - mine_before
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return phase, cpu, mine


def app_refusal_ms(n: int) -> float:
    """CPU milliseconds the app spends on one refusal of a one-line chat request to a full
    model (the tiny model; the ASGI app called directly, so no socket or uvicorn work counts:
    the cost the server's own code adds per refusal)."""
    from pipeline.model_paths import TINY_MODEL_DIR
    from transports.http import Gateway, ServerConfig, create_app

    body = json.dumps({"model": "default", "max_tokens": 16, "messages": [
        {"role": "user", "content": "Client 3, question 4: what is a Python generator?"}]}
        ).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
             "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    statuses: list[int] = []

    async def refused() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)  # no disconnect while the app answers
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(scope, receive, send)

    async def many(count: int) -> None:
        for _ in range(count):
            await refused()

    with tempfile.TemporaryDirectory() as tmp:
        gateway = Gateway(ServerConfig(models={"default": TINY_MODEL_DIR}, data_dir=Path(tmp),
                                       num_slots=1, max_queue=0))
        gateway.loader.load(wait=True)
        app = create_app(gateway)
        served = gateway.models["default"]
        served.inflight = 1  # its one place taken: the app sees a full model
        try:
            asyncio.run(many(20))  # warm
            start = time.process_time()
            asyncio.run(many(n))
            cost = (time.process_time() - start) / n * 1e3
        finally:
            served.inflight = 0
            gateway.close()
    if set(statuses) != {429}:
        raise RuntimeError(f"expected refusals, got statuses {sorted(set(statuses))}")
    return round(cost, 3)


def drained(url: str, timeout: float = 120.0) -> None:
    """Wait until the server runs and queues nothing (the cancelled clients' requests end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauges = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                  if line.startswith(("pipeline_active_slots", "pipeline_queue_depth"))]
        if all(float(line.rsplit(" ", 1)[1]) == 0 for line in gauges):
            return
        time.sleep(0.2)
    raise RuntimeError("the server did not drain")


def start_server(args: argparse.Namespace, port: int, data_dir: str,
                 log: Any) -> subprocess.Popen[bytes]:
    """``pipeline serve`` on ``port`` with the benchmark's limits, once healthy."""
    server = subprocess.Popen(
        [sys.executable, "-m", "transports.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--data-dir", data_dir, "--slots", str(args.slots), "--max-queue",
         str(args.max_queue), *(["--model", args.model] if args.model else []),
         *args.server_args],
        env={**os.environ, "PIPELINE_API_KEYS": "", "OMP_NUM_THREADS": str(args.torch_threads)},
        stderr=log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.kill()
    raise RuntimeError("the server did not become healthy")


def log_counts(text: str) -> dict[str, int]:
    """The server log's ERROR lines and refusal summary lines."""
    lines = text.splitlines()
    return {"error_lines": sum(" ERROR " in line for line in lines),
            "refusal_summary_lines": sum("refused" in line and " WARNING " in line
                                         for line in lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="what the server serves (default: the "
                                                      "default model)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--clients", type=int, default=200, help="clients of the overload phase")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--backoff", type=float, default=0.5,
                        help="seconds a refused client waits before it sends again, when the "
                             "refusal asks for no wait (or --ignore-retry-after)")
    parser.add_argument("--ignore-retry-after", action="store_true",
                        help="refused clients wait --backoff whatever the refusal asks for")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured per phase")
    parser.add_argument("--warmup", type=float, default=10.0, help="unmeasured, per phase")
    parser.add_argument("--rounds", type=int, default=2,
                        help="limit and overload phases alternate this many times")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--app-refusals", type=int, default=2000,
                        help="refusals the app is timed on in process (CPU ms per refusal)")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="the rest of the command line goes to pipeline serve")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS})")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, 2 + 2 places, 8 clients, one 2 s round")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.slots, args.max_queue, args.clients = "tiny", 2, 2, 8
        args.max_tokens, args.seconds, args.warmup, args.rounds = 4, 2.0, 0.5, 1
        args.app_refusals = 50
    args.out = args.out or (Path(tempfile.gettempdir()) / "overload-smoke.json"
                            if args.smoke else RESULTS)
    load_before = loadavg()
    port, data_dir = free_port(), tempfile.mkdtemp(prefix="overload-")
    url = f"http://127.0.0.1:{port}"
    log_path = Path(data_dir) / "server.log"
    rows: list[dict[str, Any]] = []
    with open(log_path, "wb") as log:
        server = start_server(args, port, data_dir, log)
        try:
            model = str(httpx.get(f"{url}/v1/models").json()["data"][0]["id"])
            limit = args.slots + args.max_queue
            for r in range(args.rounds):
                for name, clients in (("limit", limit), ("overload", args.clients)):
                    phase, cpu, mine = asyncio.run(run_phase(port, server.pid, model, clients,
                                                             args))
                    rows.append({"round": r, **phase.row(name, clients, cpu, mine)})
                    drained(url)
        finally:
            server.terminate()
            server.wait(30)
    load_after = loadavg()
    summary_app = app_refusal_ms(args.app_refusals)
    logged = log_counts(log_path.read_text(errors="replace"))
    print(f"{'round':>5} {'phase':<9} {'clients':>7} {'done/s':>7} {'median s':>9} "
          f"{'p90 s':>7} {'refused/s':>9} {'asked s':>7} {'server CPU/s':>12} "
          f"{'client CPU/s':>12} {'errors':>6}")
    for x in rows:
        print(f"{x['round']:>5} {x['phase']:<9} {x['clients']:>7} {x['completed_per_s']:>7} "
              f"{x['median_s']!s:>9} {x['p90_s']:>7} {x['refused_per_s']:>9} "
              f"{x['asked_wait_s']!s:>7} {x['server_cpu_per_s']:>12} "
              f"{x['client_cpu_per_s']:>12} {x['errors']:>6}")
    summary: dict[str, Any] = {}
    for name in ("limit", "overload"):
        same = [x for x in rows if x["phase"] == name]
        summary[name] = {k: statistics.median(x[k] for x in same if x[k] is not None)
                         if any(x[k] is not None for x in same) else None
                         for k in ("completed_per_s", "median_s", "refused_per_s",
                                   "asked_wait_s", "server_cpu_per_s")}
    lim, over = summary["limit"], summary["overload"]
    summary["rate_ratio"] = (round(over["completed_per_s"] / lim["completed_per_s"], 3)
                             if lim["completed_per_s"] else None)
    summary["median_ratio"] = (round(over["median_s"] / lim["median_s"], 3)
                               if lim["median_s"] and over["median_s"] else None)
    # the server's CPU a refusal costs: the overload phase's CPU less what its completions
    # cost at the limit, per refusal (a rough figure: other load on the machine moves it)
    per_done = lim["server_cpu_per_s"] / lim["completed_per_s"] if lim["completed_per_s"] else 0
    summary["app_cpu_ms_per_refusal"] = summary_app
    summary["server_cpu_ms_per_refusal"] = (
        round(1e3 * (over["server_cpu_per_s"] - over["completed_per_s"] * per_done)
              / over["refused_per_s"], 2) if over["refused_per_s"] else None)
    retry = ("ignored Retry-After (waited --backoff)" if args.ignore_retry_after
             else "honoured Retry-After")
    print(f"refused clients {retry}; overload / limit: completed rate x{summary['rate_ratio']} (goal >= 0.8), median "
          f"latency x{summary['median_ratio']} (goal <= 2); a refusal: {summary_app} ms of CPU "
          f"in the app, about {summary['server_cpu_ms_per_refusal']} ms in the server; "
          f"server log: {logged}; load "
          f"{' '.join(load_before)} before, {' '.join(load_after)} after")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": args.model or "default", "smoke": args.smoke,
        "machine": platform.platform(), "cpus": os.cpu_count(),
        "load_before": load_before, "load_after": load_after, "rows": rows,
        "summary": summary, "server_log": logged}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
