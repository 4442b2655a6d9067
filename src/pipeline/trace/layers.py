"""The layers of two traces recorded with layer taps (``recording="taps"``): the first step
at which a layer's hidden state differs, and the first layer that differs there.

Owns :func:`first_layer` and its :class:`LayerReport` (every tap of that step as a
:class:`TapDiff`), part of :class:`~pipeline.trace.diff.DiffReport`. Each step's taps are
the hidden states at the position whose logits z_t the step produced, recorded as a digest,
the largest magnitude and the root mean square (:func:`pipeline.recording.tap_record`);
where both traces kept a tap's values (:attr:`~pipeline.contracts.request.Request.tap_tensors`)
the difference itself is measured and held against what the dtypes explain
(:mod:`pipeline.tolerance`). Without values, a changed digest says *that* a layer differs,
and its statistics bound *how much* (the difference is at least |Δ max|x||).

Example::

    found = first_layer(load("a.jsonl"), load("b.jsonl"))
    found.step, found.first              # e.g. 1, "layers.2.mlp"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.tolerance import depth_of, explained, pair_unit
from pipeline.trace.load import Trace


@attrs.frozen
class TapDiff:
    """One tap at one step on both sides: whether its bits agree, each side's statistics,
    and with both sides' values the difference and what rounding explains."""

    name: str
    same: bool
    a: Mapping[str, float]
    b: Mapping[str, float]
    max_diff: float | None = None
    explained: float | None = None

    @property
    def within(self) -> bool | None:
        """Whether the measured difference is within what the dtypes explain (None: not
        measured)."""
        if self.same:
            return True
        if self.max_diff is None or self.explained is None:
            return None
        return self.max_diff <= self.explained

    def render(self) -> str:
        """One line: same bits, or the difference and its verdict, or the statistics."""
        if self.same:
            return f"{self.name}: same bits"
        if self.max_diff is not None and self.explained is not None:
            verdict = "within noise" if self.within else "not explained"
            return (f"{self.name}: differs by {self.max_diff:.2e} (rounding explains "
                    f"{self.explained:.2e}): {verdict}")
        return (f"{self.name}: differs (max |x| {self.a['max_abs']:.4g} vs "
                f"{self.b['max_abs']:.4g}, rms {self.a['rms']:.4g} vs {self.b['rms']:.4g})")

    def to_json(self) -> dict[str, Any]:
        """The tap's comparison as a JSON-ready mapping."""
        return {"name": self.name, "same": self.same, "a": dict(self.a), "b": dict(self.b),
                "max_diff": self.max_diff, "explained": self.explained,
                "within": self.within}


@attrs.frozen
class LayerReport:
    """The first step whose taps differ and every tap there; ``first`` is the first tap, in
    forward order, whose bits differ (``first_beyond``: the first whose measured difference
    exceeds what the dtypes explain, when values were kept)."""

    step: int
    first: str
    taps: tuple[TapDiff, ...]
    dtypes: tuple[str, str]

    @property
    def first_beyond(self) -> TapDiff | None:
        """The first tap whose measured difference is beyond tolerance."""
        return next((t for t in self.taps if t.within is False), None)

    def lines(self) -> list[str]:
        """The report's lines: where the layers first differ, then each tap."""
        beyond = self.first_beyond
        head = f"layers: first differ at step {self.step}, from {self.first}"
        if beyond is not None:
            head += f"; first beyond what the dtypes explain: {beyond.name}"
        return [head, *(f"  {t.render()}" for t in self.taps)]

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping."""
        beyond = self.first_beyond
        return {"step": self.step, "first": self.first,
                "first_beyond": None if beyond is None else beyond.name,
                "dtypes": list(self.dtypes), "taps": [t.to_json() for t in self.taps]}


def taps_at(trace: Trace, t: int) -> Mapping[str, Any] | None:
    """The taps recorded with the logits z_t (None: none recorded)."""
    source = trace.sources().get(t)
    if source is None:
        return None
    taps = source[0].payload.get("taps")
    return taps if isinstance(taps, Mapping) and taps.get("step") == t else None


def first_layer(a: Trace, b: Trace) -> LayerReport | None:
    """The first step whose taps differ, with every tap there (None: neither trace has taps,
    or every step both hold agrees bit for bit)."""
    t = 1
    while True:
        ta, tb = taps_at(a, t), taps_at(b, t)
        if ta is None or tb is None:
            return None
        la = {r["name"]: r for r in ta.get("layers", []) if isinstance(r, Mapping)}
        lb = {r["name"]: r for r in tb.get("layers", []) if isinstance(r, Mapping)}
        names = [n for n in la if n in lb]
        differing = [n for n in names if la[n].get("digest") != lb[n].get("digest")]
        if differing:
            dtypes = (str(ta.get("dtype", "")), str(tb.get("dtype", "")))
            unit = pair_unit(*dtypes)
            return LayerReport(t, differing[0], tuple(_tap(n, la[n], lb[n], unit)
                                                      for n in names), dtypes)
        t += 1


def _tap(name: str, a: Mapping[str, Any], b: Mapping[str, Any], unit: float) -> TapDiff:
    stats_a = {k: float(a.get(k, 0.0)) for k in ("max_abs", "rms")}
    stats_b = {k: float(b.get(k, 0.0)) for k in ("max_abs", "rms")}
    same = a.get("digest") == b.get("digest")
    va, vb = a.get("values"), b.get("values")
    if same or not isinstance(va, list) or not isinstance(vb, list) or len(va) != len(vb):
        return TapDiff(name, same, stats_a, stats_b)
    biggest = max(abs(float(x) - float(y)) for x, y in zip(va, vb))
    return TapDiff(name, same, stats_a, stats_b, biggest,
                   explained(unit, stats_a["max_abs"], depth_of(name), len(va)))
