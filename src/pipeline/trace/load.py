"""Reading traces: one request's events as a :class:`Trace`, with views by step.

Owns :func:`load` / :func:`load_all` (a JSONL file, a ``Completion``, or events) and the
:class:`Trace` value the checker, the differ, the timeline and the exporters read. A JSONL file
may interleave several requests' traces; each is grouped by ``trace_id`` and put in causal
(``event_id``) order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import TraceError
from pipeline.events import Event
from pipeline.contracts.output import Completion
from pipeline.contracts.request import Recording

CONTENT_LEVELS = frozenset(r.value for r in Recording if r.content)
"""The recording levels whose traces hold content (``full`` and ``taps``)."""

TraceSource = str | Path | Completion | Sequence[Event]


@attrs.frozen
class Trace:
    """The events of one request, in causal order (ascending ``event_id``)."""

    events: tuple[Event, ...]
    # Lookup tables built once (the differ asks for each step's events many times).
    _by_type: dict[str, list[Event]] = attrs.field(init=False, eq=False, repr=False)
    _by_step: dict[str, dict[int, Event]] = attrs.field(init=False, eq=False, repr=False,
                                                        factory=dict)
    _sources: dict[int, tuple[Event, int]] | None = attrs.field(init=False, eq=False,
                                                                repr=False, default=None)

    def __attrs_post_init__(self) -> None:
        by_type: dict[str, list[Event]] = {}
        for event in self.events:
            by_type.setdefault(event.event_type, []).append(event)
        object.__setattr__(self, "_by_type", by_type)

    @property
    def trace_id(self) -> str:
        """The request's trace id."""
        return self.events[0].trace_id

    def of(self, event_type: str) -> list[Event]:
        """Every event of ``event_type``, in order."""
        return list(self._by_type.get(event_type, ()))

    def first(self, event_type: str) -> Event | None:
        """The first event of ``event_type``, if any."""
        found = self._by_type.get(event_type)
        return found[0] if found else None

    def payload(self, event_type: str) -> Mapping[str, Any]:
        """The first ``event_type`` event's payload, or an empty mapping."""
        event = self.first(event_type)
        return event.payload if event is not None else {}

    def by_step(self, event_type: str) -> dict[int, Event]:
        """Events of ``event_type`` keyed by their payload's ``step`` (first one wins);
        the mapping is shared, do not modify it."""
        if event_type not in self._by_step:
            out: dict[int, Event] = {}
            for event in self._by_type.get(event_type, ()):
                step = event.payload.get("step")
                if isinstance(step, int) and step not in out:
                    out[step] = event
            self._by_step[event_type] = out
        return self._by_step[event_type]

    def sources(self) -> dict[int, tuple[Event, int]]:
        """For each step t, the event whose logits z_t token t was selected from, and the
        index of z_t among that event's recorded outputs: ``prefill.completed`` for t = 1;
        a ``decode.completed`` at step s that fed n tokens (y_s, then drafts) gave z_{s+1}
        .. z_{s+n}. A position fed again after a rollback takes its logits from the later
        call; the mapping is shared, do not modify it."""
        if self._sources is None:
            out: dict[int, tuple[Event, int]] = {}
            prefill = self.first("prefill.completed")
            if prefill is not None:
                out[1] = (prefill, 0)
            for event in self._by_type.get("decode.completed", ()):
                step = event.payload.get("step")
                if not isinstance(step, int):
                    continue
                offsets = event.payload.get("outputs", [0])
                for i, offset in enumerate(offsets if isinstance(offsets, list) else [0]):
                    if isinstance(offset, int):
                        out[step + 1 + offset] = (event, i)
            object.__setattr__(self, "_sources", out)
        assert self._sources is not None
        return self._sources

    @property
    def finished(self) -> Event | None:
        """The ``generation.finished`` event, if the request ended."""
        return self.first("generation.finished")

    @property
    def holds_content(self) -> bool:
        """Whether the trace records content (text, ids, top-k): a ``full`` or ``taps``
        recording (:attr:`~pipeline.contracts.request.Recording.content`)."""
        return self.instance.get("recording") in CONTENT_LEVELS

    @property
    def instance(self) -> Mapping[str, Any]:
        """The execution instance (``request.normalized``'s payload)."""
        return self.payload("request.normalized")


def fed(event: Event) -> list[int]:
    """The token ids a ``decode.completed`` event fed: y_t, then any drafts."""
    ids = event.payload.get("token_ids")
    if isinstance(ids, list):
        return ids
    token = event.payload.get("token_id")
    return [token] if isinstance(token, int) else []


def _event(data: Any, where: str) -> Event:
    if not isinstance(data, Mapping):
        raise TraceError(f"{where}: an event must be a JSON object")
    try:
        return Event.from_json(data)
    except KeyError as exc:
        raise TraceError(f"{where}: event lacks the field {exc.args[0]!r}") from None


def _read_file(path: Path) -> list[Event]:
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    events = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{number}: not JSON ({exc.msg})") from None
            events.append(_event(data, f"{path}:{number}"))
    if not events:
        raise TraceError(f"{path}: the file holds no events")
    return events


def _events(source: TraceSource) -> list[Event]:
    if isinstance(source, (str, Path)):
        return _read_file(Path(source))
    if isinstance(source, Completion):
        return list(source.trace)
    return list(source)


def group(events: Iterable[Event]) -> list[Trace]:
    """Events split by ``trace_id`` (in order of first appearance), each in causal order."""
    by_id: dict[str, list[Event]] = {}
    for event in events:
        by_id.setdefault(event.trace_id, []).append(event)
    traces = []
    for trace_id, items in by_id.items():
        items.sort(key=lambda e: e.event_id)
        ids = [e.event_id for e in items]
        if len(set(ids)) != len(ids):
            raise TraceError(f"trace {trace_id}: duplicate event ids")
        traces.append(Trace(tuple(items)))
    return traces


def load_all(source: TraceSource) -> list[Trace]:
    """Every trace in ``source`` (a JSONL path, a ``Completion`` or events)."""
    traces = group(_events(source))
    if not traces:
        raise TraceError("no events to read")
    return traces


def load(source: TraceSource | Trace, trace_id: str | None = None) -> Trace:
    """The one trace in ``source`` (or the one called ``trace_id``).

    Raises :class:`~pipeline.errors.TraceError` when the source is unreadable, holds several
    traces and none is named, or lacks the one named.
    """
    if isinstance(source, Trace):
        return source
    traces = load_all(source)
    if trace_id is not None:
        for trace in traces:
            if trace.trace_id == trace_id:
                return trace
        raise TraceError(f"no trace {trace_id!r}; the source holds "
                         + ", ".join(t.trace_id for t in traces))
    if len(traces) > 1:
        raise TraceError("the source holds several traces; name one of: "
                         + ", ".join(t.trace_id for t in traces))
    return traces[0]
