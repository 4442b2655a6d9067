"""The chat page's inspector over kept traces: one request's steps and timeline, and the
first divergence between two requests.

Owns :class:`TraceViews` (the handlers of ``GET /traces/{request_id}/inspect`` and
``GET /traces/{a}/diff/{b}``), :func:`inspection`, :func:`comparison`, :func:`check_id` and
:func:`with_recording` (the ``x-pipeline-recording`` request header, which asks for a trace
at :attr:`~pipeline.contracts.request.Recording.FULL`: the raw and processed logits' top-k per step).

Both views read a trace through :class:`~transports.http.accounting.traces.TraceStore` with the caller's
key fingerprints, so they obey the rule of ``GET /traces/{request_id}``: a trace made with
another key is the same 404 as an unknown one. Each names exactly one trace: a request of
several choices is named by a choice's id (``{id}-{k}``). Token ids are labelled with the text
of the served model whose snapshot and tokenizer the trace declares (``null`` when no served
model matches any more).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import attrs
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from pipeline.errors import InvalidValueError, TraceError
from pipeline.events import Event
from pipeline.contracts.text import Tokenizer
from pipeline.trace.diff import diff, order_at
from pipeline.trace.load import Trace, group
from pipeline.trace.products import processed_at, raw_logits_at
from pipeline.trace.timeline import phases, summary
from pipeline.trace.tokens import processed_probability, raw_probability
from pipeline.contracts.output import token_text
from pipeline.contracts.request import Recording, Request
from transports.http.gateway.gateway import Gateway
from transports.http.server.work import Workers

RECORDING_HEADER = "x-pipeline-recording"
MAX_ID = 128
_ID = re.compile(rf"[A-Za-z0-9_.-]{{1,{MAX_ID}}}")


def check_id(field: str, value: str) -> str:
    """``value`` when it can be a request id (1 to 128 letters, digits, ``-``, ``_``, ``.``),
    else :class:`InvalidValueError` (a 400) naming ``field``."""
    if not _ID.fullmatch(value):
        raise InvalidValueError(field, value, f"a request id is 1 to {MAX_ID} letters, "
                                "digits, '-', '_' or '.' (a response's x-request-id)")
    return value


def with_recording(request: Request, value: str | None) -> Request:
    """``request`` at the recording level the ``x-pipeline-recording`` header asks for
    (``digest``, ``full`` or ``taps``; absent: as it is); any other value is a 400."""
    if value is None:
        return request
    if value not in {r.value for r in Recording}:
        raise InvalidValueError(RECORDING_HEADER, value, "must be 'digest', 'full' or 'taps'")
    return attrs.evolve(request, recording=Recording(value))


def one_trace(jsonl: bytes, request_id: str) -> Trace:
    """The one trace in ``jsonl`` (a kept request's); a request of several choices is a 400
    that says how to name one."""
    events = [Event.from_json(json.loads(line)) for line in jsonl.splitlines() if line]
    traces = group(events)
    if len(traces) != 1:
        raise InvalidValueError("request_id", request_id,
                                f"holds the traces of {len(traces)} choices: name one, as "
                                f"{request_id}-0")
    return traces[0]


# --- what the page shows ---------------------------------------------------------------------


def _labeller(tokenizer: Tokenizer | None) -> Callable[[int], str | None]:
    def text(token_id: int) -> str | None:
        if tokenizer is None:
            return None
        try:
            return token_text(tokenizer.token_bytes(token_id))
        except (InvalidValueError, IndexError, KeyError, ValueError):
            return None
    return text


def _step(trace: Trace, t: int, selected: Event, text: Callable[[int], str | None]
          ) -> dict[str, Any]:
    """Step t: the token with its probabilities (``raw_prob``, the model's own, and
    ``processed_prob``, after the sampling settings; each ``_at_most`` a bound instead for a
    token outside the recorded top-k: :mod:`pipeline.trace.tokens`), the raw logits' (each with its
    probability) and the processed distribution's top-k (``full`` traces only), and the
    processors applied."""
    p = selected.payload
    raw = raw_logits_at(trace, t) or {}
    processed = processed_at(selected) or {}
    token = int(p["token_id"])
    lse = raw.get("logsumexp")
    raw_top = [{"token_id": int(i), "text": text(int(i)), "logit": v,
                "prob": None if lse is None else math.exp(v - lse)}
               for i, v in raw.get("top", [])]
    processed_top = [{"token_id": int(i), "text": text(int(i)), "score": s, "prob": pr}
                     for i, s, pr in processed.get("top", [])]
    raw_prob, raw_at_most = raw_probability(trace, t, token)
    after, after_at_most = processed_probability(selected, token)
    return {
        "step": t, "token_id": token, "text": text(token), "logprob": p.get("logprob"),
        "raw_prob": raw_prob, "raw_prob_at_most": raw_at_most,
        "processed_prob": after, "processed_prob_at_most": after_at_most,
        "candidates": processed.get("candidates"), "draw": p.get("draw"),
        "processors": order_at(trace, t), "raw": raw_top, "processed": processed_top,
    }


def _phases(trace: Trace) -> list[dict[str, Any]]:
    origin = trace.events[0].monotonic_ns
    return [{"name": ph.name, "track": ph.track,
             "start_ms": (ph.start.monotonic_ns - origin) / 1e6,
             "duration_ms": ph.duration_ns / 1e6} for ph in phases(trace)]


def _endings(trace: Trace) -> list[dict[str, Any]]:
    """Where the request stopped and why (its ``generation.finished``)."""
    end = trace.finished
    if end is None:
        return []
    at = (end.monotonic_ns - trace.events[0].monotonic_ns) / 1e6
    return [{"at_ms": at, "reason": end.payload.get("reason"),
             "detail": end.payload.get("detail")}]


def inspection(trace: Trace, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """What the inspector shows of one trace, as JSON: each step's token with its raw and
    processed probability and top-k (empty below ``full``; see :func:`_step`), the
    declared and applied processor orders, and the timeline (phases in milliseconds from the
    request's acceptance, latencies, ending)."""
    text = _labeller(tokenizer)
    steps = [_step(trace, t, e, text) for t, e in sorted(trace.by_step("token.selected").items())]
    return {
        "trace_id": trace.trace_id,
        "recording": trace.instance.get("recording"), "content": trace.holds_content,
        "processor_chain": trace.instance.get("processor_chain"),
        "processors": trace.payload("selection.configured").get("processors"),
        "steps": steps,
        "timeline": {"phases": _phases(trace), "summary": summary(trace),
                     "stops": _endings(trace)},
    }


def comparison(a: Trace, b: Trace, tokenizer: Tokenizer | None = None,
               tokenizer_b: Tokenizer | None = None) -> dict[str, Any]:
    """The diff report (:meth:`~pipeline.trace.diff.DiffReport.to_json`: the first divergent
    product, its level and step, the shared reproducibility level, the declared differences,
    and ``first_token``: the first step whose committed tokens differ, with each run's token,
    text and raw and processed probabilities), plus ``first_token_step`` (that step alone, for
    older pages) and the report as text. Each run's tokenizer (None: not served any more)
    labels its token ids with text, else its ``full`` trace's streamed text does."""
    report = diff(a, b, token_text=_labeller(tokenizer), token_text_b=_labeller(tokenizer_b))
    found = report.first_token
    return {"a": a.trace_id, "b": b.trace_id, **report.to_json(),
            "first_token_step": None if found is None else found.step,
            "text": report.render()}


# --- the handlers ----------------------------------------------------------------------------


class TraceViews:
    """The inspector's endpoints over a gateway's kept traces (each behind the app's key
    check, which puts the caller's key fingerprints in ``http.state.keys``)."""

    def __init__(self, gateway: Gateway, work: Workers) -> None:
        self.gateway = gateway
        self.work = work

    def _trace(self, request_id: str, keys: frozenset[str]) -> Trace:
        return one_trace(self.gateway.traces.jsonl(request_id, keys), request_id)

    def _tokenizer(self, trace: Trace) -> Tokenizer | None:
        """The tokenizer of the served model the trace ran on (by snapshot and tokenizer)."""
        snapshot = trace.instance.get("model_snapshot")
        version = trace.instance.get("tokenizer_version")
        for pipe in self.gateway.pipelines().values():
            tokenizer = pipe.stages.tokenizer
            if (tokenizer is not None and pipe.model_snapshot == snapshot
                    and tokenizer.digest == version):
                return tokenizer
        return None

    async def inspect(self, http: HTTPRequest) -> Response:
        """``GET /traces/{request_id}/inspect``: :func:`inspection` of one kept trace."""
        request_id = check_id("request_id", http.path_params["request_id"])
        keys: frozenset[str] = http.state.keys

        def job(_: object) -> dict[str, Any]:
            trace = self._trace(request_id, keys)
            return inspection(trace, self._tokenizer(trace))

        return JSONResponse(await self.work.run(http, job), headers={"cache-control": "no-store"})

    async def diff(self, http: HTTPRequest) -> Response:
        """``GET /traces/{a}/diff/{b}``: :func:`comparison` of two kept traces, both readable
        with the caller's key."""
        ids = [check_id(name, http.path_params[name]) for name in ("a", "b")]
        keys: frozenset[str] = http.state.keys

        def job(_: object) -> dict[str, Any]:
            a, b = (self._trace(i, keys) for i in ids)
            try:
                return comparison(a, b, self._tokenizer(a), self._tokenizer(b))
            except TraceError as exc:
                raise InvalidValueError("traces", ids, f"cannot be compared: {exc}") from exc

        return JSONResponse(await self.work.run(http, job), headers={"cache-control": "no-store"})

