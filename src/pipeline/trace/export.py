"""``pipeline trace export``: traces as Chrome trace-event JSON (Perfetto) or OpenTelemetry spans.

Owns :func:`to_perfetto` (the JSON object format that Perfetto and ``chrome://tracing`` open:
one process per request, a thread per track, complete events for phases and instant events
for every trace event with its payload as args) and :func:`export_otel` (a root span per
request with a child span per phase and the trace's events as span events, handed to an
OpenTelemetry tracer; needs the ``otel`` extra). When the request carried a W3C
``traceparent``, both keep its trace id, and the OTel root span is its child.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.events import Event
from pipeline.trace.load import Trace, TraceSource, load_all
from pipeline.trace.timeline import phases
from pipeline.contracts.output import Completion

TRACKS = ("request", "phase", "select", "decode")


def _traces(source: TraceSource | Trace | Sequence[Trace]) -> list[Trace]:
    if isinstance(source, Trace):
        return [source]
    if isinstance(source, (str, Path, Completion)):
        return load_all(source)
    items = list(source)
    traces = [t for t in items if isinstance(t, Trace)]
    if traces:
        return traces
    return load_all([e for e in items if isinstance(e, Event)])


def _us(event: Event, t0: int) -> float:
    return (event.monotonic_ns - t0) / 1e3


def _perfetto_one(trace: Trace, pid: int, t0: int) -> list[dict[str, Any]]:
    components = sorted({e.component for e in trace.events})
    tids = {name: n for n, name in enumerate(TRACKS + tuple(components), 1)}
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": trace.trace_id}}]
    out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for name, tid in tids.items()]
    context = _context(trace)
    for phase in phases(trace):
        args = {"from": f"e{phase.start.event_id} {phase.start.event_type}",
                "to": f"e{phase.end.event_id} {phase.end.event_type}"}
        if phase.track == "request":
            args.update(context)
        out.append({"name": phase.name, "cat": phase.track, "ph": "X", "pid": pid,
                    "tid": tids[phase.track], "ts": _us(phase.start, t0),
                    "dur": phase.duration_ns / 1e3, "args": args})
    for event in trace.events:
        out.append({"name": event.event_type, "cat": event.component, "ph": "i", "s": "t",
                    "pid": pid, "tid": tids[event.component], "ts": _us(event, t0),
                    "args": {"event_id": event.event_id, "parent": event.parent_event_id,
                             **dict(event.payload)}})
    return out


def _context(trace: Trace) -> dict[str, Any]:
    """Ids that join this trace to others: ours, and the caller's W3C trace context."""
    out: dict[str, Any] = {"trace_id": trace.trace_id}
    parent = trace.payload("request.accepted").get("traceparent")
    if isinstance(parent, Mapping):
        out["w3c_trace_id"] = parent["trace_id"]
        out["w3c_parent_id"] = parent["parent_id"]
    return out


def to_perfetto(source: TraceSource | Trace | Sequence[Trace]) -> dict[str, Any]:
    """Chrome trace-event JSON (object form) for one or more traces; ``ts`` in µs."""
    traces = _traces(source)
    t0 = min(t.events[0].monotonic_ns for t in traces)
    events: list[dict[str, Any]] = []
    for pid, trace in enumerate(traces, 1):
        events += _perfetto_one(trace, pid, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"traces": [_context(t) for t in traces]}}


def _epoch(trace: Trace) -> int:
    """Offset from ``monotonic_ns`` to Unix ns, from ``request.accepted``'s anchor."""
    first = trace.events[0]
    anchor = first.payload.get("unix_ns")
    if isinstance(anchor, int):
        return anchor - first.monotonic_ns
    return time.time_ns() - time.monotonic_ns()  # same boot: good enough for latency views


def _attributes(payload: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalar payload fields as OTel attributes (nested mappings flattened with dots)."""
    out: dict[str, Any] = {}
    for key, value in payload.items():
        if isinstance(value, Mapping):
            out.update(_attributes(value, f"{prefix}{key}."))
        elif isinstance(value, (str, bool, int, float)):
            out[f"{prefix}{key}"] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int, float))
                                                      for v in value):
            out[f"{prefix}{key}"] = list(value)
    return out


def export_otel(source: TraceSource | Trace | Sequence[Trace], tracer: Any = None) -> None:
    """Emit each trace as OpenTelemetry spans on ``tracer`` (default: the global one).

    The root span ``pipeline.request`` covers the request; each phase is a child span; every
    trace event is a span event. Needs ``opentelemetry-api`` (the ``otel`` extra).
    """
    from opentelemetry import trace as otel

    tracer = tracer or otel.get_tracer("pipeline.trace")
    for trace in _traces(source):
        _export_one(trace, tracer, otel)


def _export_one(trace: Trace, tracer: Any, otel: Any) -> None:
    offset = _epoch(trace)
    parent_ctx = None
    parent = trace.payload("request.accepted").get("traceparent")
    if isinstance(parent, Mapping):
        remote = otel.SpanContext(int(parent["trace_id"], 16), int(parent["parent_id"], 16),
                                  is_remote=True,
                                  trace_flags=otel.TraceFlags(int(parent["flags"], 16)))
        parent_ctx = otel.set_span_in_context(otel.NonRecordingSpan(remote))
    first, last = trace.events[0], trace.events[-1]
    end = trace.finished
    attributes = {"pipeline.trace_id": trace.trace_id,
                  **_attributes(trace.instance, "pipeline.instance."),
                  **({"pipeline.finish_reason": str(end.payload.get("reason"))} if end else {})}
    root = tracer.start_span("pipeline.request", context=parent_ctx, attributes=attributes,
                             start_time=first.monotonic_ns + offset)
    inner = otel.set_span_in_context(root)
    for phase in phases(trace):
        if phase.track == "request":
            continue
        span = tracer.start_span(f"pipeline.{phase.name}", context=inner,
                                 start_time=phase.start.monotonic_ns + offset)
        span.end(end_time=phase.end.monotonic_ns + offset)
    for event in trace.events:
        root.add_event(event.event_type, attributes={
            "event_id": event.event_id, "component": event.component,
            **_attributes(event.payload)}, timestamp=event.monotonic_ns + offset)
    root.end(end_time=last.monotonic_ns + offset)
