"""``pipeline.trace``: tooling over event traces (docs/design.md §7–9).

Owns the public face of the trace tools, each usable from tests and from ``pipeline trace``:

- :func:`load` / :func:`load_all` — a JSONL file, a ``Completion`` or events → :class:`Trace`
- :func:`check` — the eight invariants of docs/design.md §8 (:class:`CheckReport`)
- :func:`diff` — the first step where two runs' committed tokens differ, the first divergence
  of any level and their shared reproducibility level (:class:`DiffReport`)
- :func:`show` — a readable timeline
- :func:`to_perfetto`, :func:`to_svg`, :func:`export_otel` — exports
- :class:`CheckingSink` — live checking: every trace checked as its request ends
"""

from pipeline.trace.check import CheckReport, Violation, check
from pipeline.trace.diff import DiffReport, diff
from pipeline.trace.export import export_otel, to_perfetto
from pipeline.trace.live import CheckingSink
from pipeline.trace.load import Trace, load, load_all
from pipeline.trace.products import LEVELS, Divergence
from pipeline.trace.show import show
from pipeline.trace.svg import to_svg

__all__ = [
    "LEVELS", "CheckReport", "CheckingSink", "DiffReport", "Divergence", "Trace", "Violation", "check", "diff",
    "export_otel", "load", "load_all", "show", "to_perfetto", "to_svg",
]
