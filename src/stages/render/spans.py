"""Control/content spans of a rendered chat template: placeholders, markers, span recovery.

Owns the steps :class:`~stages.render.hf_template.HFChatTemplateRenderer` uses to label its
text. A *caller string* is any string value in the message and tool mappings, except the
values of ``role`` and ``type`` keys; template kwargs belong to the application and render as
control. Spans are found in three steps:

1. protect: each special-token string inside a caller string (``<|im_end|>``) is replaced by
   a private-use placeholder character that occurs nowhere in the inputs
   (:func:`free_chars`, :func:`map_caller`);
2. locate: the template is rendered a second time with each caller string's non-blank core
   between an opening marker of its own and a closing marker (private-use characters,
   :func:`wrap`). Where the two outputs agree (their common prefix and suffix, markers
   removed), each marker pair is an exact CONTENT span (:func:`marked_spans`). Strings left
   over (the template split, sliced or tested them, which strands or moves their markers)
   are searched for where the outputs differ, in order, exact, stripped or JSON-escaped
   (:func:`searched_spans`). No span covers a special token the template wrote itself
   (:func:`subtract`);
3. restore: each placeholder becomes its special-token string again, inside a CONTENT span
   whatever step 2 found (:func:`assemble`). So a caller's ``<|im_end|>`` is always content.

Only special tokens are protected: non-special added tokens (Qwen's ``<think>``,
``<tool_response>``) stay visible to templates, which split and test on them. A template that
inspects a special-token string inside caller text (``'<|im_end|>' in content``, ``upper``)
sees a placeholder instead; that is the one way the text can differ from transformers'.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pipeline.errors import TemplateError
from pipeline.contracts.text import Span, SpanKind

_NOT_CALLER_KEYS = frozenset({"role", "type"})
_PRIVATE_USE = range(0x100000, 0x10FFFE)  # Supplementary Private Use Area-B
# Markers all come from that area: one character class over the whole area finds them in
# linear time (a class listing each of N markers costs O(N) per character, which made a
# render of many caller strings quadratic).
_MARKER_AREA = re.compile("[\U00100000-\U0010FFFD]")


# --- caller strings and markers -----------------------------------------------------------


def map_caller(value: Any, fn: Callable[[str], str], key: object = None) -> Any:
    """A plain copy of ``value`` with ``fn`` applied to every caller string."""
    if isinstance(value, str):
        return value if key in _NOT_CALLER_KEYS else fn(value)
    if isinstance(value, Mapping):
        return {k: map_caller(v, fn, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_caller(v, fn, key) for v in value)
    return value


def caller_strings(value: Any, key: object = None) -> Iterator[str]:
    """Every caller string in ``value``, in order."""
    if isinstance(value, str):
        if key not in _NOT_CALLER_KEYS:
            yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from caller_strings(v, k)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from caller_strings(v, key)


def free_chars(used: set[str], count: int) -> list[str]:
    """``count`` private-use characters not in ``used``; TemplateError if too few are left."""
    chars = list(itertools.islice((chr(c) for c in _PRIVATE_USE if chr(c) not in used), count))
    if len(chars) < count:
        raise TemplateError("no free private-use characters left to mark caller text")
    return chars


def wrap(text: str, open_: str, close: str) -> str:
    """``text`` with its non-blank core between ``open_`` and ``close`` (blank: unchanged)."""
    core = text.strip()
    if not core:
        return text
    lead = text.index(core)
    return f"{text[:lead]}{open_}{core}{close}{text[lead + len(core):]}"


# --- span recovery ------------------------------------------------------------------------


def _unmark(wrapped: str, opens: Mapping[str, int], close: str
            ) -> tuple[str, list[tuple[int, int | None]]]:
    """``wrapped`` without markers, and each marker's position there with its probe index
    (``None`` for the closing marker)."""
    parts, marks, last, at = [], [], 0, 0
    for m in _MARKER_AREA.finditer(wrapped):
        if m.group() != close and m.group() not in opens:
            continue  # a private-use character of the template's own, not a marker
        parts.append(wrapped[last:m.start()])
        at, last = at + m.start() - last, m.end()
        marks.append((at, opens.get(m.group())))
    parts.append(wrapped[last:])
    return "".join(parts), marks


def _differing(a: str, b: str) -> tuple[int, int]:
    """Lengths of the common prefix and (not overlapping it) common suffix of ``a``, ``b``."""
    head = len(os.path.commonprefix([a, b]))
    room = min(len(a), len(b)) - head
    tail = len(os.path.commonprefix([a[::-1][:room], b[::-1][:room]]))
    return head, tail


def marked_spans(wrapped: str, plain: str, opens: Mapping[str, int], close: str
                 ) -> tuple[list[tuple[int, int]], set[int], tuple[int, int]]:
    """Content spans of ``plain`` from the marker pairs of ``wrapped`` that lie where the two
    renders agree, the probes they resolve, and the stretch of ``plain`` where they differ."""
    stripped, marks = _unmark(wrapped, opens, close)
    head, tail = _differing(stripped, plain)
    shift, suffix = len(plain) - len(stripped), len(stripped) - tail
    spans, resolved = [], set()
    for (p, probe), (q, after) in zip(marks, marks[1:]):
        if probe is None or after is not None:
            continue
        if q <= head or p >= suffix:
            resolved.add(probe)
            offset = 0 if q <= head else shift
            spans += [(p + offset, q + offset)] if q > p else []
    return spans, resolved, (head, len(plain) - tail)


def _variants(probe: str) -> list[str]:
    forms = [probe, probe.strip("\n"), probe.strip()]
    forms += [json.dumps(f, ensure_ascii=False)[1:-1] for f in forms]
    return [f for i, f in enumerate(forms) if f and f not in forms[:i]]


def _find(text: str, probe: str, start: int, stop: int, claimed: list[tuple[int, int]]
          ) -> tuple[int, int] | None:
    for form in _variants(probe):
        at = text.find(form, start, stop)
        while at >= 0:
            end = at + len(form)
            if not any(s < end and at < e for s, e in claimed):
                return at, end
            at = text.find(form, at + 1, stop)
    return None


def searched_spans(text: str, probes: Sequence[str], region: tuple[int, int],
                   claimed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Best-effort content spans inside ``region``: probes in order, each first looked for
    after the previous hit, never overlapping ``claimed``."""
    lo, hi = region
    found = list(claimed)
    cursor = lo
    for probe in probes:
        hit = _find(text, probe, cursor, hi, found)
        if hit is not None:
            cursor = hit[1]
        elif (hit := _find(text, probe, lo, hi, found)) is None:
            continue
        found.append(hit)
    return found[len(claimed):]


def subtract(spans: Sequence[tuple[int, int]], holes: Sequence[tuple[int, int]]
             ) -> list[tuple[int, int]]:
    """``spans`` with the sorted, disjoint ``holes`` cut out. Each span visits only the holes
    that overlap it (found by bisection), so many spans and holes cost O((n + m) log m)."""
    ends = [he for _, he in holes]
    out = []
    for s, e in spans:
        i = bisect.bisect_right(ends, s)  # the first hole ending after s
        while i < len(holes) and holes[i][0] < e:
            hs, he = holes[i]
            if s < hs:
                out.append((s, hs))
            s = max(s, he)
            i += 1
        if s < e:
            out.append((s, e))
    return out


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(e, merged[-1][1]))
        else:
            merged.append((s, e))
    return merged


def assemble(text: str, content: list[tuple[int, int]], restore: Mapping[str, str]
             ) -> tuple[str, tuple[Span, ...]]:
    """Put special-token strings back (each inside content) and build the span partition."""
    pattern = re.compile("|".join(map(re.escape, restore)) or "(?!)")
    forced = [(m.start(), m.end()) for m in pattern.finditer(text)] if restore else []
    pieces: list[tuple[str, SpanKind]] = []
    at = 0
    for s, e in _merge(content + forced):
        pieces += [(text[at:s], SpanKind.CONTROL), (text[s:e], SpanKind.CONTENT)]
        at = e
    pieces.append((text[at:], SpanKind.CONTROL))
    out: list[str] = []
    spans: list[Span] = []
    pos = 0
    for piece, kind in pieces:
        piece = pattern.sub(lambda m: restore[m.group()], piece) if restore else piece
        if not piece:
            continue
        if spans and spans[-1].kind is kind:
            spans[-1] = Span(spans[-1].start, pos + len(piece), kind)
        else:
            spans.append(Span(pos, pos + len(piece), kind))
        out.append(piece)
        pos += len(piece)
    return "".join(out), tuple(spans)

