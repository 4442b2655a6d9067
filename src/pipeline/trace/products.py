"""The data products of a trace as the differ compares them (docs/design.md §9).

Owns :data:`LEVELS` (the reproducibility levels, lowest first), the lookups of each step's
raw and processed logits records, the comparison of two logits records (bitwise by digest, or
within a tolerance on their recorded top-k), how a run's ending at a step is classified, the
external effects of a run, the :class:`Divergence` value, and :func:`shown` (short printing of values and digests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.events import Event, digest_json
from pipeline.trace.load import Trace, fed

LEVELS = ("none", "input", "model", "selection", "system")
"""Reproducibility levels; a divergence at one level means the runs share the one below."""



@attrs.frozen
class Divergence:
    """The first data product that differs: where, both sides, and a word on why."""

    product: str
    level: str
    step: int | None
    a: Any
    b: Any
    detail: str = ""


ENDINGS = {"cancelled": ("cancellation", "system"), "deadline": ("deadline", "system"),
           "error": ("failure", "system"), "unfinished": ("truncated trace", "system")}
"""Endings decided outside the decode state (the environment's doing); any other is a stop."""


def raw_logits_at(trace: Trace, t: int) -> Mapping[str, Any] | None:
    """The record of z_t: from ``prefill.completed`` (t = 1), ``decode.completed(t-1)``, or
    the verifying call whose outputs include position t (speculative decoding)."""
    source = trace.sources().get(t)
    if source is None:
        return None
    event, index = source
    block = event.payload.get("block_logits")
    if isinstance(block, list) and index < len(block):
        record = block[index]
    else:
        record = event.payload.get("logits") if index == 0 else None
    return record if isinstance(record, Mapping) else None


def cache_after(trace: Trace, t: int) -> Any:
    """The cache length right after y_t was written (m + t when the trace is sound): by the
    call that fed it as its pending token, by a verifying call that fed it as a draft
    that was then accepted, or by the call that wrote its finished block. None for a token never written, and for the token a finished
    run ended at (the token that stops a run need not enter the model)."""
    end = trace.finished
    if end is not None and end.payload.get("completion_tokens") == t:
        return None
    event = trace.by_step("decode.completed").get(t)
    if event is None:
        source = trace.sources().get(t)
        if source is None or source[0].event_type != "decode.completed":
            return None
        event = source[0]
    if event.payload.get("write") is False:   # a pass over a block: the block's write has t
        event = _writer(trace, t)
        if event is None:
            return None
    s, ids, length = event.payload.get("step"), fed(event), event.payload.get("cache_len")
    if s == t:
        return length - len(ids) + 1 if isinstance(length, int) else length
    if not isinstance(s, int) or not isinstance(length, int) or not 0 < t - s < len(ids):
        return None
    return length - len(ids) + (t - s) + 1


def _writer(trace: Trace, t: int) -> Event | None:
    """The last writing call whose fed positions include y_t (an iterative strategy writes
    a finished block in one call after its passes, which do not write)."""
    found = None
    for event in trace.of("decode.completed"):
        s = event.payload.get("step")
        if event.payload.get("write") is not False and isinstance(s, int) \
                and s <= t < s + len(fed(event)):
            found = event
    return found


def processed_at(selected: Event) -> Mapping[str, Any] | None:
    """The record of the processed distribution token t was selected from."""
    value = selected.payload.get("processed")
    return value if isinstance(value, Mapping) else None


def logits_equal(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None, atol: float
                 ) -> tuple[bool, str]:
    """Whether two logits records agree, and a line that explains the answer."""
    if a is None and b is None:
        return True, ""
    if a is None or b is None:
        return False, "only one run recorded this product"
    if a.get("digest") == b.get("digest") and a.get("candidates") == b.get("candidates"):
        return True, ""
    if "top" not in a or "top" not in b:
        return False, "digests differ (record at full to see values)"
    biggest = max(_top_gap(a["top"], b["top"]), _top_gap(b["top"], a["top"]))
    explain = f"max |Δ| over the top-{len(a['top'])} = {biggest:.3g}; " + _moved(a, b)
    if atol > 0 and biggest <= atol and a.get("candidates") == b.get("candidates"):
        return True, f"within atol={atol:g}: {explain}"
    return False, explain


def _top_gap(x: list[list[float]], y: list[list[float]]) -> float:
    """The largest difference that ``x``'s top-k proves between the two rows: for a token in
    both lists, the difference of its values; for one missing from ``y``'s list, how far it
    lies above ``y``'s cut (it can be no larger there than ``y``'s k-th value)."""
    other = {int(t[0]): float(t[1]) for t in y}
    cut = min(other.values(), default=float("-inf"))
    gaps = [abs(float(t[1]) - other[int(t[0])]) if int(t[0]) in other
            else max(float(t[1]) - cut, 0.0) for t in x]
    return max(gaps, default=0.0)


def _moved(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The top candidates of both sides, with probabilities where recorded."""
    def fmt(top: list[list[float]]) -> str:
        return ", ".join(f"{int(x[0])}:{x[-1]:.3g}" for x in top[:3])

    what = "p" if len(a["top"][0]) == 3 else "logit"
    extra = ""
    if "candidates" in a:
        extra = f"; candidates {a['candidates']} vs {b.get('candidates')}"
    return f"top {what} A [{fmt(a['top'])}] vs B [{fmt(b['top'])}]{extra}"


def _ended(trace: Trace, t: int, before: bool) -> str | None:
    """The finish reason if the run ended at step t (``before``: ended before step t)."""
    end = trace.finished
    if end is None:
        return "unfinished" if before else None
    n = end.payload.get("completion_tokens")
    if not isinstance(n, int):
        return None
    hit = n < t if before else n == t
    return str(end.payload.get("reason")) if hit else None


def ending(a: Trace, b: Trace, t: int, both_selected: bool = False) -> Divergence | None:
    """A divergence when exactly one run ended at step t (or they ended differently)."""
    ra, rb = _ended(a, t, not both_selected), _ended(b, t, not both_selected)
    if ra == rb:
        return None
    # An environment ending (cancel, deadline, failure) names the product over a stop.
    reason = rb if ra is None or (ra not in ENDINGS and rb in ENDINGS) else ra
    product, level = ENDINGS.get(str(reason), ("stop", "selection"))
    side = "A" if reason == ra else "B"
    went_on = "went on" if None in (ra, rb) else "ended differently"
    return Divergence(product, level, t, ra or "continued", rb or "continued",
                      f"run {side} ended ({reason}) at step {t}; the other {went_on}")


IDENTITY_KEYS = ("call_id", "key")
"""Tool-event fields that name a call rather than say what it did: call ids derive from the
request id and idempotency keys from the run's, so two runs that did the same differ there."""


def external_effects(trace: Trace) -> list[tuple[str, str]]:
    """The tool events (type and payload digest, without the call's identity) of a run, in
    order."""
    return [(e.event_type, digest_json({k: v for k, v in e.payload.items()
                                        if k not in IDENTITY_KEYS}))
            for e in trace.events if e.event_type.startswith("tool.")]


def shown(value: Any, limit: int = 160) -> str:
    """A short printable form of a product's value."""
    if isinstance(value, Mapping) and "digest" in value:
        text = str(value["digest"])[:19] + "…"
        if "top" in value:
            text += " top " + ", ".join(f"{int(x[0])}:{x[1]:.4g}" for x in value["top"][:4])
        return text
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit] + "…"
