"""Benchmark: what each trace durability level costs, per event, per decode step, per tool call.

The levels are :data:`pipeline.events.DURABILITY` (``none``, ``flush``, ``fsync-boundary``,
``fsync``), each a :class:`~pipeline.events.JsonlSink` writing to a file on the disk
under ``--dir`` (a tmpfs would make every fsync free); :class:`~pipeline.events.MemorySink`
is the peer that writes nothing. Measured in one run, the levels interleaved round by round
(starting at a different one each round) so each sees the same load:

- **per event**: re-emitting the events of a real trace of the tiny model (digest recording:
  what ``pipeline run --trace`` writes) through each sink, µs per event;
- **per decode step**: the same per-event cost times the trace's events per decode step,
  against the decode step's own time in that trace (what the model and the engine spend);
- **per tool call**: the four events of a call crossing the boundary (validated,
  authorized, committed, executed), against the tool ledger's own two fsynced records per
  call (claim and outcome) on the same disk, measured in the same rounds: the cost that
  exactly-once already pays.

A figure is the median over rounds. Prints a table, writes
``benchmarks/results/trace_durability.json`` (``--out``).

Run: ``.venv/bin/python benchmarks/trace_durability.py [--rounds 7] [--events 4000]``;
``--smoke``: the same code in seconds (one round, 200 events, 5 tool calls, an 8-token trace,
files in the system's temporary folder): it checks the script, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline import build
from pipeline.events import DURABILITY, Event, EventSink, JsonlSink, MemorySink
from pipeline.tools import Entry, JsonlLedger

RESULTS = Path(__file__).parent / "results" / "trace_durability.json"
QUESTION = "Why is the sky usually blue?"
PEERS = ("memory", *DURABILITY)


def real_trace(tokens: int) -> tuple[list[Event], float]:
    """A tiny-model generation's events and its decode step time (seconds)."""
    sink = MemorySink()
    with build("tiny", sinks=[sink]) as pipe:
        pipe.generate(QUESTION, max_tokens=8, temperature=0)  # warm up
        done = pipe.generate(QUESTION, max_tokens=tokens, temperature=0, ignore_eos=True)
    events = [e for e in sink.events if e.trace_id == done.request_id]
    selected = [e.monotonic_ns for e in events if e.event_type == "token.selected"]
    return events, (selected[-1] - selected[0]) / (len(selected) - 1) / 1e9


def boundary_events(n: int) -> list[Event]:
    """``n`` tool calls' boundary transitions, as the boundary emits them."""
    out = []
    for i in range(n):
        for j, kind in enumerate(("validated", "authorized", "committed", "executed")):
            out.append(Event("t", 4 * i + j + 1, None, "tools", "tool." + kind,
                             time.monotonic_ns(), {"call_id": f"c{i}", "name": "add",
                                                   "key": f"k{i}", "result_digest": "x"}))
    return out


def make_sink(name: str, folder: Path) -> EventSink:
    if name == "memory":
        return MemorySink()
    return JsonlSink(folder / f"{name}-{time.monotonic_ns()}.jsonl", durability=name)


def per_event_us(name: str, events: Sequence[Event], folder: Path) -> float:
    sink = make_sink(name, folder)
    start = time.perf_counter()
    for event in events:
        sink.emit(event)
    sink.close()  # part of the cost: "none" pays its writes here
    return (time.perf_counter() - start) / len(events) * 1e6


def ledger_us_per_call(calls: int, folder: Path) -> float:
    ledger = JsonlLedger(folder / f"ledger-{time.monotonic_ns()}.jsonl")
    start = time.perf_counter()
    for i in range(calls):
        committed = Entry(f"k{i}", "committed", f"c{i}", "add", "{}")
        ledger.claim(committed)
        ledger.record(Entry(f"k{i}", "executed", f"c{i}", "add", "{}", 5))
    ledger.close()
    return (time.perf_counter() - start) / calls * 1e6


def interleaved(rounds: int, names: Sequence[str], measure: Callable[[str], float]
                ) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in [*names[r % len(names):], *names[:r % len(names)]]:
            out[name].append(measure(name))
    return out


def measure(rounds: int, n_events: int, calls: int, tokens: int, folder: Path
            ) -> dict[str, Any]:
    trace, step_s = real_trace(tokens)
    steps = sum(e.event_type == "token.selected" for e in trace)
    corpus = (trace * (n_events // len(trace) + 1))[:n_events]
    tools = boundary_events(calls)
    event_us = interleaved(rounds, PEERS, lambda name: per_event_us(name, corpus, folder))
    call_us = interleaved(rounds, (*PEERS, "ledger"), lambda name: ledger_us_per_call(
        calls, folder) if name == "ledger" else per_event_us(name, tools, folder) * 4)
    ledger_us = statistics.median(call_us["ledger"])
    none_us = statistics.median(event_us["none"])
    per_step = len(trace) / steps
    rows = {}
    for name in PEERS:
        e_us, c_us = statistics.median(event_us[name]), statistics.median(call_us[name])
        rows[name] = {"us_per_event": e_us, "event_ratio_to_none": e_us / none_us,
                      "us_per_step": e_us * per_step,
                      "step_share": e_us * per_step / (step_s * 1e6), "us_per_tool_call": c_us,
                      "tool_call_ratio_to_ledger": c_us / ledger_us,
                      "rounds_us_per_event": event_us[name],
                      "rounds_us_per_tool_call": call_us[name]}
    return {"levels": rows, "events_per_step": per_step, "decode_step_us": step_s * 1e6,
            "ledger_us_per_call": ledger_us, "rounds_ledger_us_per_call": call_us["ledger"],
            "events": n_events, "calls": calls,
            "rounds": rounds, "machine": platform.platform(), "folder_fs": _fs(folder)}


def _fs(folder: Path) -> str:
    """The filesystem type of ``folder``'s mount (Linux; else unknown)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(folder.resolve())
    best = max((m for m in mounts if resolved.startswith(m[1])), key=lambda m: len(m[1]),
               default=None)
    return best[2] if best else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the trace files go (a real disk, not a tmpfs; default "
                             "benchmarks/results, with --smoke the temporary folder)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: one round, 200 events, 5 calls, an 8-token trace")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.events, args.calls, args.tokens = 1, 200, 5, 8
    args.dir = args.dir or (Path(tempfile.gettempdir()) if args.smoke else RESULTS.parent)
    out = args.out or (Path(tempfile.gettempdir()) / "trace_durability-smoke.json"
                       if args.smoke else RESULTS)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        data = measure(args.rounds, args.events, args.calls, args.tokens, Path(tmp))
    print(f"{data['events_per_step']:.2f} events per decode step; decode step "
          f"{data['decode_step_us']:.0f} µs; ledger {data['ledger_us_per_call']:.0f} µs per "
          f"call ({data['folder_fs']})\n")
    print("| sink | µs / event | ratio to none | µs / decode step | share of a step "
          "| µs / tool call | ratio to the ledger's |")
    print("|---|---|---|---|---|---|---|")
    for name, row in data["levels"].items():
        print(f"| {name} | {row['us_per_event']:.2f} | {row['event_ratio_to_none']:.3f} | "
              f"{row['us_per_step']:.1f} | "
              f"{row['step_share'] * 100:.2f} % | {row['us_per_tool_call']:.0f} | "
              f"{row['tool_call_ratio_to_ledger']:.2f} |")
    data["smoke"] = args.smoke
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
