"""``pipeline trace export --format svg``: a picture of one request's timeline.

Owns :func:`to_svg`: one row per track (prepare/queue/prefill, select t, decode t), a bar per
phase scaled to wall time, a tick per streamed delta, and a millisecond axis. Plain SVG text,
no plotting library.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from pipeline.trace.load import Trace, TraceSource, load
from pipeline.trace.timeline import phases, summary

ROWS = ("phase", "select", "decode", "stream")
COLORS = {"prepare": "#8da0cb", "queue": "#bbbbbb", "prefill": "#fc8d62", "select": "#66c2a5",
          "decode": "#e78ac3", "stream": "#333333"}
WIDTH, LEFT, ROW_H, TOP = 960, 90, 34, 48


def _color(name: str) -> str:
    return COLORS.get(name.split(" ")[0], "#999999")


def to_svg(source: TraceSource | Trace, *, trace_id: str | None = None) -> str:
    """The timeline of the trace in ``source`` as an SVG document."""
    trace = load(source, trace_id)
    t0, t1 = trace.events[0].monotonic_ns, trace.events[-1].monotonic_ns
    scale = (WIDTH - LEFT - 20) / max(t1 - t0, 1)

    def x(ns: int) -> float:
        return LEFT + (ns - t0) * scale

    height = TOP + ROW_H * len(ROWS) + 40
    s = summary(trace)
    title = (f"{trace.trace_id}: {s['prompt_tokens']} prompt tokens, {s['completion_tokens']} "
             f"tokens, finish {s['finish']}, {s['total_ms']:.1f} ms")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="10" y="20" font-size="13">{escape(title)}</text>']
    for row, name in enumerate(ROWS):
        out.append(f'<text x="10" y="{TOP + row * ROW_H + 20}">{name}</text>')
    for n, (name, color) in enumerate(COLORS.items()):
        out.append(f'<rect x="{LEFT + n * 110}" y="28" width="10" height="10" fill="{color}"/>'
                   f'<text x="{LEFT + n * 110 + 14}" y="37">{name}</text>')
    for phase in phases(trace):
        if phase.track == "request":
            continue
        row = ROWS.index(phase.track)
        left, w = x(phase.start.monotonic_ns), max(phase.duration_ns * scale, 1.0)
        out.append(f'<rect x="{left:.1f}" y="{TOP + row * ROW_H + 6}" width="{w:.1f}" '
                   f'height="{ROW_H - 12}" fill="{_color(phase.name)}" stroke="white">'
                   f'<title>{escape(phase.name)}: {phase.duration_ns / 1e6:.3f} ms</title></rect>')
        if w > 70:  # wide enough to name inside the bar
            out.append(f'<text x="{left + 4:.1f}" y="{TOP + row * ROW_H + 21}">'
                       f'{escape(phase.name)} {phase.duration_ns / 1e6:.1f} ms</text>')
    row_y = TOP + ROWS.index("stream") * ROW_H
    for delta in trace.of("stream.delta"):
        px = x(delta.monotonic_ns)
        out.append(f'<line x1="{px:.1f}" y1="{row_y + 6}" x2="{px:.1f}" y2="{row_y + ROW_H - 6}" '
                   f'stroke="{COLORS["stream"]}"><title>delta {delta.payload.get("seq")}'
                   f'</title></line>')
    axis_y = TOP + ROW_H * len(ROWS) + 10
    total_ms = (t1 - t0) / 1e6
    for i in range(6):
        ms = total_ms * i / 5
        px = LEFT + (WIDTH - LEFT - 20) * i / 5
        out.append(f'<line x1="{px:.1f}" y1="{axis_y - 4}" x2="{px:.1f}" y2="{axis_y}" '
                   f'stroke="black"/><text x="{px:.1f}" y="{axis_y + 14}" '
                   f'text-anchor="middle">{ms:.1f} ms</text>')
    out.append("</svg>")
    return "\n".join(out)
