"""The committed tokens of a trace in words: each step's text, each token's probabilities,
and the first step where two runs committed different tokens.

Owns :func:`token_texts` (each step's token as text: from a tokenizer where one is given, else
from a ``full`` trace's streamed text where one step released exactly one token),
:func:`raw_probability` (the model's own probability of a token: the softmax of the raw
logits, readable from a ``full`` trace's top-k and ``logsumexp``), :func:`processed_probability`
(after the sampling settings: the processed top-k, else the token's recorded logprob), and
:func:`first_token`, whose :class:`FirstToken` is the part of a
:class:`~pipeline.trace.diff.DiffReport` a reader looks for first: how many tokens the answers
share and what each run chose where they part (:class:`TokenSide`). A digest-level trace
holds the token ids only; :attr:`FirstToken.missing` says what is missing and how to record it.

Example::

    found = first_token(load("a.jsonl"), load("b.jsonl"))
    found.step, found.agree_tokens      # e.g. 49, 48
    found.a.text, found.a.raw_prob      # e.g. " Paris", 0.41 (full traces)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from pipeline.errors import TraceError
from pipeline.events import Event
from pipeline.trace.load import Trace
from pipeline.trace.products import processed_at, raw_logits_at

TokenText = Callable[[int], str | None]
"""A token id's text (e.g. a tokenizer's ``token_bytes`` as text), or None when unknown."""

RECORD_FULL = ("record with --record full (pipeline run, pipeline chat) or the "
               "x-pipeline-recording: full header (the server)")
"""How to get a trace that holds the tokens' text and probabilities."""


def token_texts(trace: Trace, token_text: TokenText | None = None) -> dict[int, str]:
    """Each step's committed token as text, by step: ``token_text(id)`` where it gives one;
    else the streamed text of a ``full`` trace where a step released exactly its own token
    (a step whose text was held back, e.g. half a character or a possible stop string, has
    none)."""
    end = trace.finished.event_id if trace.finished is not None else None
    texts: dict[int, str] = {}
    for delta in trace.of("stream.delta"):
        p = delta.payload
        if (end is None or delta.event_id < end) and p.get("tokens") == 1 \
                and isinstance(p.get("text"), str) and isinstance(p.get("step"), int):
            texts[p["step"]] = p["text"]
    if token_text is not None:
        for t, event in trace.by_step("token.selected").items():
            token = event.payload.get("token_id")
            text = token_text(token) if isinstance(token, int) else None
            if text is not None:
                texts[t] = text
    return texts


def raw_probability(trace: Trace, t: int, token: int) -> tuple[float | None, float | None]:
    """The model's own probability of ``token`` at step t (softmax of the raw logits z_t),
    and, when the token is not among the recorded top-k, a bound on it (the k-th's
    probability). ``(None, None)`` when the trace holds no top-k with its ``logsumexp``."""
    record = raw_logits_at(trace, t) or {}
    top, lse = record.get("top"), record.get("logsumexp")
    if not isinstance(top, list) or not top or not isinstance(lse, (int, float)):
        return None, None
    probs = {int(row[0]): math.exp(float(row[1]) - float(lse)) for row in top}
    if token in probs:
        return probs[token], None
    return None, min(probs.values())


def processed_probability(selected: Event, token: int) -> tuple[float | None, float | None]:
    """The probability of ``token`` after the sampling settings (temperature, top-p, ...) at
    the step ``selected`` records, and a bound on it when the token is outside the recorded
    top-k: from the processed distribution's top-k (``full``; 0 for a token the settings
    removed, when every candidate is in the top-k), else the selected token's own logprob
    where one was recorded (a request that asked for logprobs)."""
    p = selected.payload
    if p.get("token_id") == token and isinstance(p.get("logprob"), (int, float)):
        exact: float | None = math.exp(float(p["logprob"]))
    else:
        exact = None
    record: Mapping[str, Any] = processed_at(selected) or {}
    top = record.get("top")
    if not isinstance(top, list) or not top:
        return exact, None
    for row in top:
        if int(row[0]) == token:
            return float(row[2]), None
    if record.get("candidates") == len(top):
        return 0.0, None
    return exact, None if exact is not None else min(float(row[2]) for row in top)


@attrs.frozen
class TokenSide:
    """What one run committed at the first step where the runs differ."""

    token_id: int
    text: str | None
    """The token's text (None when neither a tokenizer nor the trace gives it)."""
    raw_prob: float | None
    """The model's own probability (softmax of its raw logits); None when not recorded."""
    processed_prob: float | None
    """The probability after the sampling settings, which the token was drawn from."""
    raw_prob_at_most: float | None = None
    """A bound on ``raw_prob`` when the token was outside the recorded top-k."""
    processed_prob_at_most: float | None = None
    """A bound on ``processed_prob`` when the token was outside the recorded top-k."""

    def to_json(self) -> dict[str, Any]:
        """``{"token_id", "text", "raw_prob", "processed_prob", "raw_prob_at_most",
        "processed_prob_at_most"}``."""
        return attrs.asdict(self)

    def render(self) -> str:
        """E.g. ``"Paris" (token 7042; p=0.41 raw, 0.63 after sampling settings)``."""
        name = json.dumps(self.text, ensure_ascii=False) if self.text is not None \
            else f"token {self.token_id}"
        ident = f"token {self.token_id}; " if self.text is not None else ""
        return f"{name} ({ident}{self._probabilities()})"

    def _probabilities(self) -> str:
        raw = _value(self.raw_prob, self.raw_prob_at_most)
        after = _value(self.processed_prob, self.processed_prob_at_most)
        outside = " (outside the recorded top-k)" if "≤" in f"{raw}{after}" else ""
        if raw is None and after is None:
            return "probabilities not recorded"
        if raw is None:
            return f"p{after} after sampling settings{outside}; raw not recorded"
        if after is None:
            return f"p{raw} raw{outside}; not recorded after sampling settings"
        return f"p{raw} raw, {after.lstrip('=')} after sampling settings{outside}"

    @property
    def unrecorded(self) -> tuple[str, ...]:
        """What the trace did not record about this token: ``text``, ``raw``, ``processed``."""
        return tuple(name for name, absent in (
            ("text", self.text is None),
            ("raw", self.raw_prob is None and self.raw_prob_at_most is None),
            ("processed", self.processed_prob is None and self.processed_prob_at_most is None))
            if absent)


def _value(exact: float | None, bound: float | None) -> str | None:
    """``=0.41``, ``≤0.01`` (a bound), or None when neither is known."""
    if exact is not None:
        return f"={_p(exact)}"
    if bound is not None:
        return f"≤{_p(bound)}"
    return None


def _p(value: float) -> str:
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.1g}"


@attrs.frozen
class FirstToken:
    """The first step whose committed token differs between runs A and B (or where only
    one of them committed a token: the other had ended)."""

    step: int
    agree_tokens: int
    """How many tokens the answers share before ``step`` (``step - 1``)."""
    a: TokenSide | None
    """Run A's token at ``step``; None when run A had ended."""
    b: TokenSide | None
    ended: str | None = None
    """The finish reason of the run that had ended (None when both committed a token)."""
    missing: str | None = None
    """What the traces lack to say the tokens' text and probabilities, and how to get it."""

    def to_json(self) -> dict[str, Any]:
        """``{"step", "agree_tokens", "a", "b", "ended", "missing"}``; a side is null when
        that run had ended."""
        return {"step": self.step, "agree_tokens": self.agree_tokens,
                "a": None if self.a is None else self.a.to_json(),
                "b": None if self.b is None else self.b.to_json(),
                "ended": self.ended, "missing": self.missing}

    def render(self) -> str:
        """One line: how long the answers agree, then what each chose."""
        agree = f"the answers agree for {_tokens(self.agree_tokens)}"
        if self.a is None or self.b is None:
            name, other, side = ("A", "B", self.b) if self.a is None else ("B", "A", self.a)
            assert side is not None
            return (f"{agree}; then run {name} ended ({self.ended}) and run {other} went on: "
                    f"at step {self.step} {other} {side.render()}")
        return (f"{agree}; first different token at step {self.step}: "
                f"A {self.a.render()} vs B {self.b.render()}")


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _side(trace: Trace, t: int, event: Event | None, texts: Mapping[int, str]
          ) -> TokenSide | None:
    if event is None:
        return None
    token = event.payload.get("token_id")
    if not isinstance(token, int):
        raise TraceError(f"trace {trace.trace_id}: token.selected at step {t} has no token_id")
    raw, bound = raw_probability(trace, t, token)
    after, after_bound = processed_probability(event, token)
    return TokenSide(token, texts.get(t), raw, after, bound, after_bound)


def _missing(traces: tuple[Trace, Trace], *sides: TokenSide | None) -> str | None:
    """What the sides lack, as a sentence with the way to get it: a ``full`` trace for the
    probabilities (and the text), a tokenizer for the text of a ``full`` trace's step that
    released no text of its own."""
    lacks = {name for side in sides if side is not None for name in side.unrecorded}
    if not lacks:
        return None
    words = [w for name, w in (("text", "text"), ("raw", "raw probabilities"), (
        "processed", "probabilities after the sampling settings")) if name in lacks]
    listed = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    if not all(trace.holds_content for trace in traces):
        how = f": {RECORD_FULL}"
    elif lacks == {"text"}:
        how = ": their tokenizer gives it (name the model: --model)"
    else:
        how = ""
    return f"the traces do not hold the tokens' {listed}{how}"


def first_token(a: Trace, b: Trace, token_text: TokenText | None = None,
                token_text_b: TokenText | None = None) -> FirstToken | None:
    """The first step whose committed tokens differ (None when the runs committed the same
    tokens throughout). ``token_text`` labels run A's ids (and B's, unless ``token_text_b``
    does); without one, :func:`token_texts` reads a ``full`` trace's streamed text."""
    sa, sb = a.by_step("token.selected"), b.by_step("token.selected")
    for t in range(1, max(len(sa), len(sb)) + 1):
        ea, eb = sa.get(t), sb.get(t)
        if ea is not None and eb is not None and \
                ea.payload.get("token_id") == eb.payload.get("token_id"):
            continue
        side_a = _side(a, t, ea, token_texts(a, token_text))
        side_b = _side(b, t, eb, token_texts(b, token_text_b or token_text))
        ended = _reason(a if ea is None else b) if None in (ea, eb) else None
        return FirstToken(t, t - 1, side_a, side_b, ended, _missing((a, b), side_a, side_b))
    return None


def _reason(trace: Trace) -> str:
    end = trace.finished
    return "unfinished" if end is None else str(end.payload.get("reason"))
