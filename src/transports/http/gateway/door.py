"""What is decided about a request before its body is parsed, and how refusals are logged.

Owns the three cheap steps a request meets at the door:

* :func:`check_media_type`: a body must be JSON: ``Content-Type: application/json`` (any
  parameters, such as ``charset``), a ``+json`` type, or none at all (a client that sends no
  type, as ``urllib`` and raw sockets do, means JSON here); anything else is a 415 before a
  byte is read: ``text/plain``, and ``application/x-www-form-urlencoded``, which is what
  ``curl -d`` sends unless told ``-H 'Content-Type: application/json'`` (or ``--json``);
* :func:`peek_models`: the names a raw generation body may give as its ``model``, found
  without parsing it, for the gateway's pre-check
  (:meth:`~transports.http.gateway.admission.Admission.precheck`: a model at capacity refuses the
  request before its JSON is parsed and its prompt rendered, which cost milliseconds of CPU
  each, the CPU the admitted requests need under overload);
* :class:`Refusals`: refused requests (over capacity, a queue wait over its bound, a model
  loading or restarting) are counted, and the log gets one WARNING line per burst of them,
  ``refused N requests in the last S s: ...``, instead of one line each;
* when a refused client should come back (the ``Retry-After`` of
  :func:`~transports.http.server.errors.retry_headers`): :class:`Pace` measures the places a model
  gives back per second, :func:`place_wait_s` turns that and the queue ahead into a wait,
  :func:`restart_wait_s` estimates a restarting engine's return, and :func:`bounded_wait_s`
  keeps every figure within ``[RETRY_MIN_S, RETRY_MAX_S]``.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable

from transports.http.serving_errors import (
    ModelLoadingError, OverloadedError, UnsupportedMediaTypeError,
)

log = logging.getLogger("pipeline.serve")

MODEL_KEY = b'"model"'
_MODEL_VALUE = re.compile(rb'\s*:\s*"([^"\\]{1,256})"')
MAX_PEEKS = 16
"""Occurrences of ``"model"`` :func:`peek_models` looks at; a body with more gets no
pre-check (the exact check still holds)."""
QUEUE_TIMEOUT = "queue timeout"
"""How the engine's error begins for a request that waited longer than its queue limit
(``RuntimeLimits.queue_timeout_s``, the server's ``max_queue_wait_s``) without a slot."""
REFUSAL_WINDOW_S = 10.0
"""How long a burst of refusals is counted before its log line is written."""
RETRY_MIN_S = 1.0
"""The shortest wait a refusal asks for: ``Retry-After`` counts whole seconds, and the OpenAI
SDK ignores a wait of 0 (it falls back to its own backoff)."""
RETRY_MAX_S = 10.0
"""The longest wait a refusal asks for. The OpenAI SDK honours a server's wait up to 120 s and
does not retry at all past that; the Anthropic SDK honours any positive wait. A client told
at most 10 s comes back soon enough to be told a fresher figure."""
LOADING_WAIT_S = 5.0
"""The wait asked of a client refused while a model loads for the first time: nothing about
this model's load time is measured yet, so a fixed figure."""
PACE_WINDOW = 64
"""Finished requests :class:`Pace` remembers."""


def check_media_type(content_type: str | None) -> None:
    """Raise :class:`UnsupportedMediaTypeError` unless ``content_type`` (the header's value;
    None when absent) says JSON or says nothing."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media in ("", "application/json") or (media.startswith("application/")
                                             and media.endswith("+json")):
        return
    raise UnsupportedMediaTypeError(content_type)


def peek_models(raw: bytes) -> frozenset[str]:
    """Every string value of a ``"model"`` key in ``raw``, at any depth, found without
    parsing (empty when there are more than :data:`MAX_PEEKS` occurrences, or none). The
    body's own ``model`` is among them when the body is valid JSON with a plain (unescaped)
    ``"model"`` key; a ``"model"`` inside a JSON string has its quotes escaped and is not
    found."""
    names: set[str] = set()
    start = raw.find(MODEL_KEY)
    for _ in range(MAX_PEEKS):
        if start < 0:
            return frozenset(names)
        match = _MODEL_VALUE.match(raw, start + len(MODEL_KEY))
        if match is not None:
            try:
                names.add(match.group(1).decode())
            except UnicodeDecodeError:
                pass
        start = raw.find(MODEL_KEY, start + len(MODEL_KEY))
    return frozenset(names) if start < 0 else frozenset()


def queue_timed_out(error: str | None) -> bool:
    """True when a completion's ``error`` says it waited past its queue limit."""
    return error is not None and error.startswith(QUEUE_TIMEOUT)


def refusal_reason(exc: BaseException) -> str | None:
    """What :class:`Refusals` counts ``exc`` as, or None when it is no refusal."""
    if isinstance(exc, OverloadedError):
        return exc.reason
    if isinstance(exc, ModelLoadingError):
        return ("model failed to load" if exc.failed else "engine restarting"
                if exc.restarting else "model loading")
    return None


def bounded_wait_s(seconds: float) -> float:
    """``seconds`` within ``[RETRY_MIN_S, RETRY_MAX_S]``."""
    return min(max(seconds, RETRY_MIN_S), RETRY_MAX_S)


def place_wait_s(ahead: int, rate_per_s: float | None) -> float:
    """The wait asked of a client refused because its model is full: the time the requests
    waiting now, and the client's own, take to get a slot at the rate places are given back
    (``ahead / rate_per_s``): what a request admitted now would have waited in the queue
    anyway, so coming back then costs the client no latency, and the server's CPU is spent
    on the admitted instead of on refusing the same client again and again. With no rate
    measured yet, the shortest wait (by then there is one). Bounded by
    :func:`bounded_wait_s`."""
    if rate_per_s is None or rate_per_s <= 0:
        return RETRY_MIN_S
    return bounded_wait_s(ahead / rate_per_s)


def restart_wait_s(delay_s: float, stopped_s_ago: float, start_s: float | None) -> float:
    """The wait asked while a stopped engine is replaced: what is left of the restart delay
    (``delay_s``, the engine stopped ``stopped_s_ago``) plus ``start_s``, how long starting
    an engine took last time it was measured (None: not measured). Bounded by
    :func:`bounded_wait_s`."""
    return bounded_wait_s(max(delay_s - stopped_s_ago, 0.0) + (start_s or 0.0))


class Pace:
    """The rate at which a model gives admission places back, over its last
    :data:`PACE_WINDOW` finished requests (any end: done, cancelled, failed).

    :meth:`tick` is called on the engine thread as each request ends, :meth:`rate` on the
    event loop; both are a few operations on a bounded deque, whose single appends and reads
    are atomic, so no lock is taken (a rate read a tick early is as good an estimate).
    ``clock`` is injectable for tests.
    """

    def __init__(self, window: int = PACE_WINDOW,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._ends: collections.deque[float] = collections.deque(maxlen=window)

    def tick(self) -> None:
        """One request ended now."""
        self._ends.append(self._clock())

    def rate(self) -> float | None:
        """Requests ended per second, from the oldest remembered end until now (a model that
        stopped finishing anything shows a falling rate); None before two have ended."""
        ends = self._ends
        count = len(ends)
        if count < 2:
            return None
        span = self._clock() - ends[0]
        return (count - 1) / span if span > 0 else None


class Refusals:
    """Refused requests counted per reason, one WARNING line per burst.

    The first refusal after a quiet spell opens a burst; :meth:`flush`, which the caller has
    run ``window_s`` later (the app: ``loop.call_later``), writes the burst's line and closes
    it. While refusals go on, that is one line every ``window_s``. Call from one thread (the
    app: the event loop). ``clock`` is injectable for tests.
    """

    def __init__(self, window_s: float = REFUSAL_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._counts: collections.Counter[str] = collections.Counter()
        self._since: float | None = None

    def count(self, reason: str) -> bool:
        """Count one refusal; True when it opened a burst (run :meth:`flush` ``window_s``
        from now)."""
        opened = self._since is None
        if opened:
            self._since = self._clock()
        self._counts[reason] += 1
        return opened

    def flush(self) -> None:
        """Write the open burst's line, if any, and close it."""
        if self._since is None:
            return
        total = sum(self._counts.values())
        reasons = "; ".join(f"{n} {reason}" for reason, n in self._counts.most_common())
        log.warning("refused %d request%s in the last %.1f s: %s", total,
                    "" if total == 1 else "s", self._clock() - self._since, reasons)
        self._counts.clear()
        self._since = None
