"""The ``pipeline`` command: ``plugins``, ``count``, ``demo``, ``trace``.

Owns argument parsing and printing only; every command calls the library's public API.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from pipeline.registry import Registry
from pipeline.trace.cli import add_parser as add_trace_parser


def _plugins(args: argparse.Namespace) -> int:
    registry = Registry()
    rows = sorted(registry.components(), key=lambda c: (c.kind, c.name))
    width = max((len(c.name) for c in rows), default=4)
    kind = ""
    for comp in rows:
        if comp.kind != kind:
            kind = comp.kind
            print(f"{kind}:")
        print(f"  {comp.name:<{width}}  {comp.summary}  [{comp.plugin}]")
    return 0


def _count(args: argparse.Namespace) -> int:
    from pipeline.builder import build

    with build(args.tokenizer) as pipe:
        print(pipe.count_tokens(args.text))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Stream the default model's answer, then print a run summary."""
    from pipeline.builder import build

    with build(args.model) as pipe:
        start = time.perf_counter()
        handle = pipe.submit(args.question, max_tokens=args.max_tokens, temperature=0.0)
        for delta in handle.deltas():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        done = handle.result()
        elapsed = time.perf_counter() - start
    print()
    ttft = done.timings.first_token_s or 0.0
    decode_s = max(elapsed - ttft, 1e-9)
    rate = max(done.usage.completion_tokens - 1, 0) / decode_s
    print(f"ttft {ttft * 1e3:.1f} ms | {rate:.0f} tokens/s | finish {done.finish_reason.value}"
          f" | {len(done.trace)} trace events")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipeline`` console script."""
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plugins", help="list registered components").set_defaults(run=_plugins)
    count = sub.add_parser("count", help="count the tokens of a user message exactly")
    count.add_argument("--tokenizer", required=True, help="folder with tokenizer.json")
    count.add_argument("text")
    count.set_defaults(run=_count)
    demo = sub.add_parser("demo", help="stream an answer and print a run summary")
    demo.add_argument("--model", default=None, help="model folder (default: the embedded one)")
    demo.add_argument("--question", default="Why is the sky usually blue? Answer in one sentence.")
    demo.add_argument("--max-tokens", type=int, default=80)
    demo.set_defaults(run=_demo)
    add_trace_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
