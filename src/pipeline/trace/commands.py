"""The ``pipeline trace`` subcommands: ``show``, ``check``, ``diff``, ``export``.

Owns their argument parsing and printing; each calls the :mod:`pipeline.trace` function of the
same name, and :class:`Tokenizers`, which finds the tokenizer a trace used (``--model``'s, or
a shipped model's with the trace's tokenizer digest) to give token ids their text. Exit status: ``check`` 0 when every invariant holds, 1 otherwise; ``diff`` 0 when
the runs do not diverge, 1 when they do; 2 for an unreadable trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import PipelineError
from pipeline.trace.check import check
from pipeline.trace.diff import diff
from pipeline.trace.export import export_otel, to_perfetto
from pipeline.trace.invariants import Detokenize
from pipeline.trace.load import Trace, load, load_all
from pipeline.trace.show import show
from pipeline.trace.svg import to_svg
from pipeline.trace.tokens import TokenText
from pipeline.contracts.output import token_text

if TYPE_CHECKING:  # it imports torch: `pipeline run` and `chat` build this parser before torch
    from pipeline.contracts.text import Tokenizer


SHIPPED = ("smollm2", "tiny")
"""The models whose tokenizers label a trace when no ``--model`` is given: the default model
(``build()``'s), then the tiny one inside the package; each is used only for a trace whose
``tokenizer_version`` is its digest."""


class Tokenizers:
    """The tokenizer of each trace a command reads, found by the trace's ``tokenizer_version``
    among ``--model``'s or else the shipped models' (:data:`SHIPPED`), each loaded once."""

    def __init__(self, model: str | None) -> None:
        self.model = model
        self._loaded: dict[str, Tokenizer | None] = {}

    def _load(self, name: str) -> Tokenizer | None:
        from pipeline.tokenizing import load_tokenizer

        if name not in self._loaded:
            try:
                self._loaded[name] = load_tokenizer(name)[0]
            except PipelineError:   # not installed, or no tokenizer: it cannot be this one
                if name == self.model:
                    raise
                self._loaded[name] = None
        return self._loaded[name]

    def find(self, trace: Trace) -> tuple[Tokenizer | None, str]:
        """The trace's tokenizer, or None and why none was found."""
        version = trace.instance.get("tokenizer_version")
        for name in (self.model,) if self.model else SHIPPED:
            tokenizer = self._load(name)
            if tokenizer is not None and tokenizer.digest == version:
                return tokenizer, ""
        if self.model:
            return None, f"the tokenizer of {self.model} is not the one this trace used"
        return None, (f"none of the shipped models ({', '.join(SHIPPED)}) has the tokenizer "
                      "this trace used: name its model with --model")

    def text(self, trace: Trace) -> TokenText | None:
        """A token id's text with the trace's tokenizer (None when it is not found)."""
        tokenizer = self.find(trace)[0]
        if tokenizer is None:
            return None
        found = tokenizer

        def label(token_id: int) -> str | None:
            try:
                return token_text(found.token_bytes(token_id))
            except (PipelineError, IndexError, KeyError, ValueError):
                return None
        return label

    def detokenizer(self, trace: Trace) -> tuple[Detokenize | None, str]:
        """``decode`` with the trace's tokenizer for invariant 5, which reads text only in a
        ``full`` trace (a digest-level trace needs no tokenizer: no note)."""
        if not trace.holds_content:
            return None, ""
        tokenizer, why = self.find(trace)
        if tokenizer is None:
            return None, why
        found = tokenizer
        return (lambda ids: str(found.decode(ids, skip_special_tokens=True))), ""


def _show(args: argparse.Namespace) -> int:
    tokenizers = Tokenizers(args.model)
    for trace in _selected(args.file, args.trace_id):
        print(show(trace, limit=args.limit, token_text=tokenizers.text(trace)))
        print()
    return 0


def _check(args: argparse.Namespace) -> int:
    status = 0
    tokenizers = Tokenizers(args.model)
    for trace in _selected(args.file, args.trace_id):
        detokenize, why = tokenizers.detokenizer(trace)
        report = check(trace, detokenize=detokenize)
        if args.json:
            print(json.dumps({**report.to_json(), "tokenizer_note": why or None}, default=str))
        else:
            print(report.render())
            if why:
                print(f"note: no tokenizer for invariant 5: {why}")
        status = status or (0 if report.ok else 1)
    return status


def _diff(args: argparse.Namespace) -> int:
    a, b = load(args.a, args.trace_id_a), load(args.b, args.trace_id_b)
    tokenizers = Tokenizers(args.model)
    report = diff(a, b, atol=args.atol, token_text=tokenizers.text(a),
                  token_text_b=tokenizers.text(b))
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
    p.add_argument("--model", help="model (folder, GGUF file or name) whose tokenizer gives "
                   "token ids their text (default: the default model's or the tiny one's, "
                   "whichever the trace used)")
    p.set_defaults(run=_guard(_show))
    p = cmds.add_parser("check", help="check the eight invariants (exit 1 if any is violated)")
    p.add_argument("file", help="a JSONL trace file (pipeline run --trace, GET /traces/{id})")
    p.add_argument("--trace-id",
                   help="the trace to use when the file holds several (default: the only one)")
    p.add_argument("--model", help="model (folder, GGUF file or name) whose tokenizer "
                   "detokenizes a full trace for invariant 5 (default: the default model's or "
                   "the tiny one's, whichever the trace used)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_guard(_check))
    p = cmds.add_parser("diff", help="where the answers' tokens first differ, the earliest "
                        "internal difference and the shared reproducibility level")
    p.add_argument("a", help="the first JSONL trace file")
    p.add_argument("b", help="the second JSONL trace file")
    p.add_argument("--atol", type=float, default=0.0,
                   help="tolerance for raw logits (needs full traces); default bitwise")
    p.add_argument("--trace-id-a", help="the trace of file a to compare (when it holds several)")
    p.add_argument("--trace-id-b", help="the trace of file b to compare (when it holds several)")
    p.add_argument("--model", help="model (folder, GGUF file or name) whose tokenizer gives "
                   "token ids their text (default: the default model's or the tiny one's, "
                   "whichever the trace used)")
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
