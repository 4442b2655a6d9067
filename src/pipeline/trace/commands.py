"""The ``pipeline trace`` subcommands: ``show``, ``check``, ``diff``, ``export``.

Owns their argument parsing and printing; each calls the :mod:`pipeline.trace` function of the
same name. Exit status: ``check`` 0 when every invariant holds, 1 otherwise; ``diff`` 0 when
the runs do not diverge, 1 when they do; 2 for an unreadable trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.trace.check import check
from pipeline.trace.diff import diff
from pipeline.trace.export import export_otel, to_perfetto
from pipeline.trace.invariants import Detokenize
from pipeline.trace.load import Trace, load, load_all
from pipeline.trace.show import show
from pipeline.trace.svg import to_svg


def _detokenizer(trace: Trace, model: str | None) -> tuple[Detokenize | None, str]:
    """``tokenizer.decode`` of the model folder (default: the embedded model), used only when
    its digest is the trace's tokenizer artifact."""
    from pipeline.model_paths import TINY_MODEL_DIR
    from pipeline.registry import BuildContext, Registry

    folder = Path(model) if model else TINY_MODEL_DIR
    if not (folder / "tokenizer.json").exists():
        return None, f"no tokenizer.json in {folder}"
    tokenizer = Registry().create("tokenizer", "hf", BuildContext(model_dir=folder))
    if tokenizer.digest != trace.instance.get("tokenizer_version"):
        return None, f"the tokenizer in {folder} is not the one this trace used"
    return (lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))), ""


def _show(args: argparse.Namespace) -> int:
    for trace in _selected(args.file, args.trace_id):
        print(show(trace, limit=args.limit))
        print()
    return 0


def _check(args: argparse.Namespace) -> int:
    status = 0
    for trace in _selected(args.file, args.trace_id):
        detokenize, why = _detokenizer(trace, args.model)
        report = check(trace, detokenize=detokenize)
        if args.json:
            print(json.dumps({**report.to_json(), "tokenizer_note": why or None}, default=str))
        else:
            print(report.render())
            if why:
                print(f"note: {why}; invariant 5 compared digests only")
        status = status or (0 if report.ok else 1)
    return status


def _diff(args: argparse.Namespace) -> int:
    report = diff(load(args.a, args.trace_id_a), load(args.b, args.trace_id_b), atol=args.atol)
    print(json.dumps(report.to_json(), default=str) if args.json else report.render())
    return 0 if report.divergence is None else 1


def _export(args: argparse.Namespace) -> int:
    traces = _selected(args.file, args.trace_id)
    if args.format == "otel":
        return _export_otel(traces)
    if args.format == "svg":
        text = to_svg(traces[0])
    else:
        text = json.dumps(to_perfetto(traces), default=str)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _export_otel(traces: list[Trace]) -> int:
    """Spans through the OpenTelemetry SDK's console exporter (JSON on stdout)."""
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        print("the otel format needs the optional extra: pip install 'explicit-pipeline[otel]'",
              file=sys.stderr)
        return 2
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stdout)))
    export_otel(traces, provider.get_tracer("pipeline.trace"))
    provider.shutdown()
    return 0


def _selected(path: str, trace_id: str | None) -> list[Trace]:
    return [load(path, trace_id)] if trace_id else load_all(path)


def add_parser(sub: Any) -> None:
    """Add ``trace`` and its subcommands to the ``pipeline`` parser's subparsers."""
    trace = sub.add_parser("trace", help="inspect, check, diff and export event traces")
    cmds = trace.add_subparsers(dest="trace_command", required=True)
    p = cmds.add_parser("show", help="a readable timeline")
    p.add_argument("file", help="a JSONL trace file (pipeline run --trace, GET /traces/{id})")
    p.add_argument("--trace-id",
                   help="the trace to use when the file holds several (default: the only one)")
    p.add_argument("--limit", type=int, default=None, help="at most this many event lines")
    p.set_defaults(run=_guard(_show))
    p = cmds.add_parser("check", help="check the eight invariants (exit 1 if any is violated)")
    p.add_argument("file", help="a JSONL trace file (pipeline run --trace, GET /traces/{id})")
    p.add_argument("--trace-id",
                   help="the trace to use when the file holds several (default: the only one)")
    p.add_argument("--model", help="model folder whose tokenizer detokenizes (default: the "
                   "embedded model, when the trace used its tokenizer)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_guard(_check))
    p = cmds.add_parser("diff", help="first divergence and shared reproducibility level")
    p.add_argument("a", help="the first JSONL trace file")
    p.add_argument("b", help="the second JSONL trace file")
    p.add_argument("--atol", type=float, default=0.0,
                   help="tolerance for raw logits (needs full traces); default bitwise")
    p.add_argument("--trace-id-a", help="the trace of file a to compare (when it holds several)")
    p.add_argument("--trace-id-b", help="the trace of file b to compare (when it holds several)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_guard(_diff))
    p = cmds.add_parser("export", help="Perfetto JSON, an SVG timeline, or OpenTelemetry spans")
    p.add_argument("file", help="a JSONL trace file (pipeline run --trace, GET /traces/{id})")
    p.add_argument("--format", choices=("perfetto", "svg", "otel"), default="perfetto",
                   help="perfetto (Chrome trace JSON), svg (a timeline) or otel (spans through the "
                        "OpenTelemetry SDK's console exporter, on standard output)")
    p.add_argument("--trace-id",
                   help="the trace to use when the file holds several (default: the only one)")
    p.add_argument("-o", "--output", help="where to write perfetto or svg (default: standard output)")
    p.set_defaults(run=_guard(_export))


Command = Callable[[argparse.Namespace], int]


def _guard(fn: Command) -> Command:
    """``fn`` with the library's errors printed (exit status 2) instead of raised."""
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except PipelineError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return run


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.trace.commands``: the same commands without the ``trace`` prefix."""
    parser = argparse.ArgumentParser(prog="pipeline")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["trace", *(sys.argv[1:] if argv is None else argv)])
    return int(args.run(args))
