"""Phases of a request's life, derived from its events (for ``show`` and the exporters).

Owns :class:`Phase` and :func:`phases`: the spans between events that bound each phase —
the whole request, prepare (normalize → render → tokenize), queue, prefill, and per step t
``select t`` (logits z_t ready → y_t selected) and ``decode t`` (y_t selected → written into
the cache) — plus :func:`summary` (latencies) and :func:`describe` (one line per event).
Durations use ``monotonic_ns``; the causal order is ``event_id``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.events import Event
from pipeline.trace.load import Trace

SUMMARY_KEYS = ("step", "seq", "slot", "token_id", "cache_len", "tokens", "start", "bytes",
                "final", "candidates", "processors", "reason", "detail", "state", "seed",
                "token_ids", "proposed", "accepted", "rejected", "positions", "write",
                "block", "iteration", "time", "length",
                "call_id", "name", "decision", "policy", "outcome", "error", "why")


@attrs.frozen
class Phase:
    """A named span of the request, on a track, between two events."""

    name: str
    track: str
    start: Event
    end: Event

    @property
    def duration_ns(self) -> int:
        """Length in nanoseconds (never negative)."""
        return max(self.end.monotonic_ns - self.start.monotonic_ns, 0)


def _span(name: str, track: str, start: Event | None, end: Event | None) -> list[Phase]:
    return [] if start is None or end is None else [Phase(name, track, start, end)]


def phases(trace: Trace) -> list[Phase]:
    """The request's phases in start order."""
    first, last = trace.events[0], trace.events[-1]
    out = _span("request", "request", first, last)
    out += _span("prepare", "phase", first, trace.first("input.tokenized"))
    out += _span("queue", "phase", trace.first("input.tokenized"), trace.first("prefill.started"))
    out += _span("prefill", "phase", trace.first("prefill.started"),
                 trace.first("prefill.completed"))
    decoded = trace.by_step("decode.completed")
    sources = trace.sources()
    for t, selected in sorted(trace.by_step("token.selected").items()):
        source = sources.get(t)
        out += _span(f"select {t}", "select", None if source is None else source[0], selected)
        out += _span(f"decode {t}", "decode", selected, decoded.get(t))
    return sorted(out, key=lambda p: (p.start.event_id, p.track != "request"))


def _ms(start: Event | None, end: Event | None) -> float | None:
    if start is None or end is None:
        return None
    return (end.monotonic_ns - start.monotonic_ns) / 1e6


def summary(trace: Trace) -> dict[str, Any]:
    """Latencies in milliseconds and counts: queue, prefill, TTFT, decode rate, total."""
    accepted = trace.events[0]
    selected = sorted(trace.by_step("token.selected").items())
    first_delta = next((d for d in trace.of("stream.delta") if d.payload.get("bytes")), None)
    end = trace.finished
    out: dict[str, Any] = {
        "prepare_ms": _ms(accepted, trace.first("input.tokenized")),
        "queue_ms": _ms(trace.first("input.tokenized"), trace.first("prefill.started")),
        "prefill_ms": _ms(trace.first("prefill.started"), trace.first("prefill.completed")),
        "first_token_ms": _ms(accepted, selected[0][1]) if selected else None,
        "first_bytes_ms": _ms(accepted, first_delta),
        "total_ms": _ms(accepted, trace.events[-1]),
        "prompt_tokens": trace.payload("input.tokenized").get("tokens"),
        "completion_tokens": len(selected),
        "finish": None if end is None else end.payload.get("reason"),
    }
    if len(selected) > 1:
        span = _ms(selected[0][1], selected[-1][1]) or 0.0
        out["decode_tokens_per_s"] = (len(selected) - 1) / (span / 1e3) if span else None
    return out


def _value(value: Any) -> str:
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:15] + "…"
    return repr(value) if isinstance(value, str) else str(value)


def describe(event: Event, text: str | None = None) -> str:
    """The payload fields that matter on a timeline, as ``key=value`` pairs; ``text``, the
    text of the event's ``token_id`` when known, follows the id."""
    p: Mapping[str, Any] = event.payload
    parts = [f"{k}={_value(p[k])}" for k in SUMMARY_KEYS if k in p and p[k] is not None]
    if text is not None and "token_id" in p:
        at = parts.index(f"token_id={_value(p['token_id'])}") + 1
        parts.insert(at, f"text={text!r}")
    if "text" in p and event.event_type == "stream.delta":
        parts.append(f"text={p['text']!r}")
    if isinstance(p.get("logits"), Mapping):
        parts.append(f"z={_value(p['logits'].get('digest'))}")
    if isinstance(p.get("processed"), Mapping):
        parts.append(f"p={_value(p['processed'].get('digest'))}"
                     f" candidates={p['processed'].get('candidates')}")
    if "draw" in p and p["draw"] is not None:
        parts.append(f"u={p['draw']:.6f}")
    return " ".join(parts)
