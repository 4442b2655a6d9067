"""``pipeline trace check``: the eight invariants of docs/design.md §8 on one trace.

Owns :func:`check` and its :class:`CheckReport` (violations with the events involved and why,
plus what the trace did not let a rule observe). The rules themselves live in
:mod:`pipeline.trace.invariants`; invariant 0 is the trace's own well-formedness.
"""

from __future__ import annotations

from typing import Any

import attrs

from pipeline.trace.invariants import RULES, TITLES, Detokenize
from pipeline.trace.load import Trace, TraceSource, load


@attrs.frozen
class Violation:
    """One broken invariant: its number, the events involved, and why."""

    invariant: int
    events: tuple[int, ...]
    why: str

    @property
    def title(self) -> str:
        """The invariant's statement."""
        return TITLES[self.invariant]


@attrs.frozen
class CheckReport:
    """The result of :func:`check` on one trace."""

    trace_id: str
    violations: tuple[Violation, ...]
    notes: tuple[tuple[int, str], ...]

    @property
    def ok(self) -> bool:
        """True when every invariant holds (notes are not failures)."""
        return not self.violations

    @property
    def violated(self) -> frozenset[int]:
        """The numbers of the broken invariants."""
        return frozenset(v.invariant for v in self.violations)

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping (for CI and other tools)."""
        return {"trace_id": self.trace_id, "ok": self.ok,
                "violations": [{"invariant": v.invariant, "title": v.title,
                                "events": list(v.events), "why": v.why}
                               for v in self.violations],
                "notes": [{"invariant": n, "note": note} for n, note in self.notes]}

    def render(self) -> str:
        """A readable report: one line per invariant, then each violation."""
        lines = [f"trace {self.trace_id}"]
        notes = dict(self.notes)
        for number, title in TITLES.items():
            status = "VIOLATED" if number in self.violated else "ok"
            note = f"  ({notes[number]})" if number in notes else ""
            lines.append(f"  [{status:>8}] {number}. {title}{note}")
        for v in self.violations:
            events = ", ".join(f"e{i}" for i in v.events) or "-"
            lines.append(f"invariant {v.invariant} violated at {events}: {v.why}")
        return "\n".join(lines)


def check(source: TraceSource | Trace, *, detokenize: Detokenize | None = None,
          trace_id: str | None = None) -> CheckReport:
    """Check every invariant on the trace in ``source``.

    ``detokenize`` (e.g. ``tokenizer.decode``) lets invariant 5 compare streamed text with
    the selected tokens' text; without it, or at digest level, that rule checks what the
    trace alone shows and says so in a note.

    Example::

        report = check(completion)          # or a JSONL path
        assert report.ok, report.render()
    """
    trace = load(source, trace_id)
    violations: list[Violation] = []
    notes: list[tuple[int, str]] = []
    for number, rule in RULES.items():
        finding = rule(trace, detokenize)
        violations += [Violation(number, events, why) for events, why in finding.problems]
        notes += [(number, note) for note in finding.notes]
    return CheckReport(trace.trace_id, tuple(violations), tuple(notes))
