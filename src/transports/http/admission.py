"""What is decided about a request before its body is parsed, and how refusals are logged.

Owns the three cheap steps a request meets at the door:

* :func:`check_media_type`: a body must be JSON: ``Content-Type: application/json`` (any
  parameters, such as ``charset``), a ``+json`` type, or none at all (a client that sends no
  type, as ``urllib`` and raw sockets do, means JSON here); anything else is a 415 before a
  byte is read: ``text/plain``, and ``application/x-www-form-urlencoded``, which is what
  ``curl -d`` sends unless told ``-H 'Content-Type: application/json'`` (or ``--json``);
* :func:`peek_models`: the names a raw generation body may give as its ``model``, found
  without parsing it, for the gateway's pre-check
  (:meth:`~transports.http.gateway.Gateway.precheck`: a model at capacity refuses the
  request before its JSON is parsed and its prompt rendered, which cost milliseconds of CPU
  each, the CPU the admitted requests need under overload);
* :class:`Refusals`: refused requests (over capacity, a queue wait over its bound, a model
  loading or restarting) are counted, and the log gets one WARNING line per burst of them,
  ``refused N requests in the last S s: ...``, instead of one line each.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Callable

from pipeline.errors import ModelLoadingError, OverloadedError, UnsupportedMediaTypeError

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
