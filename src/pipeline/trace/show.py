"""``pipeline trace show``: a readable timeline of one trace.

Owns :func:`show`: the execution instance that opens the trace (request, artifact digests,
seed, environment, caller's trace context), the phase latencies, then one line per event
with its id, offset, gap to the previous event, component, type and key payload fields; a
token id is followed by its text where it is known (a tokenizer's, or a ``full`` trace's
streamed text: :func:`pipeline.trace.tokens.token_texts`).
"""

from __future__ import annotations

from pipeline.events import Event
from pipeline.trace.load import Trace, TraceSource, load
from pipeline.trace.timeline import describe, summary
from pipeline.trace.tokens import TokenText, token_texts

LABELLED = frozenset({"token.selected", "decode.completed"})
"""Events whose ``token_id`` is output token ``step`` (a decode feeds the token it wrote)."""


def _short(value: object) -> str:
    text = str(value)
    return text[:23] + "…" if text.startswith("sha256:") else text


def _header(trace: Trace) -> list[str]:
    inst = trace.instance
    config = inst.get("generation_config") or {}
    parent = trace.payload("request.accepted").get("traceparent")
    lines = [
        f"trace {trace.trace_id}  ({len(trace.events)} events, recording "
        f"{inst.get('recording', '?')})",
        f"  model {_short(inst.get('model_snapshot'))}  template "
        f"{_short(inst.get('template_version'))}  tokenizer {_short(inst.get('tokenizer_version'))}",
        f"  seed {inst.get('seed')}  temperature {config.get('temperature')}  max_tokens "
        f"{config.get('max_tokens')}  environment {_short(inst.get('environment'))}",
    ]
    if parent:
        lines.append(f"  traceparent trace-id {parent['trace_id']} parent-id {parent['parent_id']}")
    return lines


def _phases(trace: Trace) -> str:
    s = summary(trace)

    def ms(key: str) -> str:
        return "-" if s.get(key) is None else f"{s[key]:.2f} ms"

    rate = s.get("decode_tokens_per_s")
    return (f"  prepare {ms('prepare_ms')} | queue {ms('queue_ms')} | prefill {ms('prefill_ms')}"
            f" ({s['prompt_tokens']} tokens) | first token {ms('first_token_ms')} | "
            f"{s['completion_tokens']} tokens" + (f" at {rate:.0f}/s" if rate else "")
            + f" | total {ms('total_ms')} | finish {s['finish']}")


def _text(event: Event, texts: dict[int, str]) -> str | None:
    """The text of the token ``event`` names, when known."""
    step = event.payload.get("step")
    if event.event_type not in LABELLED or not isinstance(step, int) \
            or not isinstance(event.payload.get("token_id"), int):
        return None
    return texts.get(step)


def show(source: TraceSource | Trace, *, trace_id: str | None = None,
         limit: int | None = None, token_text: TokenText | None = None) -> str:
    """The timeline of the trace in ``source`` as text (at most ``limit`` event lines);
    ``token_text`` (e.g. the tokenizer's) labels token ids with their text, else a ``full``
    trace's streamed text does where a step released exactly its token."""
    trace = load(source, trace_id)
    texts = token_texts(trace, token_text)
    lines = _header(trace) + [_phases(trace), ""]
    t0 = previous = trace.events[0].monotonic_ns
    events = trace.events if limit is None else trace.events[:limit]
    for event in events:
        since, gap = (event.monotonic_ns - t0) / 1e6, (event.monotonic_ns - previous) / 1e6
        previous = event.monotonic_ns
        parent = f"<e{event.parent_event_id}" if event.parent_event_id else ""
        lines.append(f"e{event.event_id:<4} {since:9.3f} ms {gap:+8.3f} {parent:<6} "
                     f"{event.component:<10} {event.event_type:<21} "
                     f"{describe(event, _text(event, texts))}")
    if limit is not None and len(trace.events) > limit:
        lines.append(f"… {len(trace.events) - limit} more events")
    return "\n".join(lines)
