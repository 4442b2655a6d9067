"""Benchmark: how fast a server with its engine in a child process recovers from the child's death.

A real server (uvicorn on 127.0.0.1, the server's own configuration) serves ``--model``
(default: the embedded SmolLM2 GGUF) with ``ServerConfig(engine_process=True)`` and
``restart_delay_s=0`` (``pipeline serve --engine-process`` waits ``--restart-delay``, 1 s by
default, before it starts the fresh process: add it to the last column). Each round:

1. ``--streams`` streamed requests (half OpenAI chat, half Anthropic messages; requests never
   stop at end-of-sequence, so all are still running) are read until each has sent text;
2. the engine process gets SIGKILL;
3. measured from the kill: the first and the last stream's error event, and the first
   request answered 200 by the fresh process (a one-token chat request sent every 20 ms).

Prints a table (one row per round), writes ``benchmarks/results/engine_restart.json``
(``--out``). Run: ``.venv/bin/python benchmarks/engine_restart.py [--rounds 3]``; ``--smoke``:
the tiny model, one round of two streams: it checks the script, its figures mean little.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from pipeline.runtime.parent import ProcessEngine
from pipeline.runtime.wire import EngineRecipe
from pipeline.pipe import Pipeline
from transports.http import Gateway, ServerConfig, create_app
from transports.http.server.timeouts import uvicorn_config

NO_EOS = {"stoppers": ["max_tokens", "stop_strings", "deadline"], "replace_stoppers": True}


def builder(folder: Path | None, cfg: ServerConfig) -> Pipeline:
    """The server's engine-process path, with requests that do not stop at end-of-sequence."""
    return ProcessEngine.start(EngineRecipe(folder, cfg.backend_options(), dict(NO_EOS))
                               ).pipeline()


def stream(url: str, openai: bool, i: int, begun: threading.Event) -> float:
    """Read one streamed request to its end; when its error event arrived (0: none)."""
    path = "/v1/chat/completions" if openai else "/v1/messages"
    body = {"model": "default", "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": f"Tell me story number {i}."}]}
    with httpx.Client(timeout=120) as client, client.stream("POST", url + path, json=body) as r:
        for line in r.iter_lines():
            if '"text"' in line or '"content"' in line:
                begun.set()
            if "event: error" in line or line.startswith('data: {"error"'):
                return time.monotonic()
    return 0.0


def served(url: str) -> float:
    """Send a one-token request every 20 ms until one is answered 200; when it was."""
    body = {"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=120) as client:
        while True:
            if client.post(f"{url}/v1/chat/completions", json=body).status_code == 200:
                return time.monotonic()
            time.sleep(0.02)


def round_(url: str, gateway: Gateway, streams: int) -> dict[str, Any]:
    engine = gateway.models["default"].pipeline.engine  # type: ignore[union-attr]
    assert isinstance(engine, ProcessEngine)
    begun = [threading.Event() for _ in range(streams)]
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(stream, url, i % 2 == 0, i, begun[i]) for i in range(streams)]
        if not all(b.wait(120) for b in begun):
            raise SystemExit("a stream never started")
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        errors = [f.result(timeout=120) for f in futures]
    health = httpx.get(f"{url}/health").json()["models"]["default"]
    back = served(url)
    if not all(errors):
        raise SystemExit("a stream ended without an error event")
    return {"first_error_s": min(errors) - killed, "last_error_s": max(errors) - killed,
            "served_s": back - killed, "health_after_errors": health}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the embedded "
                                                      "SmolLM2 GGUF)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny model, one round of two streams: checks the script")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "engine_restart.json")
    args = parser.parse_args()
    if args.smoke:
        from pipeline.model_paths import TINY_MODEL_DIR

        args.model, args.rounds, args.streams = str(TINY_MODEL_DIR), 1, 2
    with open("/proc/loadavg") as fh:
        load_before = fh.read().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(models={"default": Path(args.model) if args.model else None},
                              data_dir=Path(tmp), num_slots=max(4, args.streams),
                              restart_delay_s=0.0)
        gateway = Gateway(config, builder)
        gateway.loader.load(wait=True)
        server = uvicorn.Server(uvicorn_config(create_app(gateway), "127.0.0.1", 0, "error",
                                               config.timeouts, "httptools"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            rows = [round_(url, gateway, args.streams) for _ in range(args.rounds)]
        finally:
            server.should_exit = True
            thread.join(30)
            gateway.close()
    with open("/proc/loadavg") as fh:
        load_after = fh.read().split()[:3]
    print(f"{'round':>5} {'first error':>12} {'last error':>11} {'served again':>13} health")
    for i, r in enumerate(rows):
        print(f"{i:5} {r['first_error_s'] * 1e3:10.1f}ms {r['last_error_s'] * 1e3:9.1f}ms "
              f"{r['served_s']:12.2f}s {r['health_after_errors']}")
    print(f"median served again {statistics.median(r['served_s'] for r in rows):.2f} s; "
          f"load before {' '.join(load_before)}, after {' '.join(load_after)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "tiny" if args.smoke else args.model or "smollm2",
                                    "smoke": args.smoke, "streams": args.streams,
                                    "load_before": load_before, "load_after": load_after,
                                    "rounds": rows}, indent=2))


if __name__ == "__main__":
    main()
