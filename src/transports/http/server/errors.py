"""The one place where the exception tree becomes HTTP statuses and dialect error bodies.

Owns :func:`classify` (exception → :class:`ErrorInfo`: status, the Anthropic and OpenAI error
types, message, the field it names, structured extras), :func:`error_body`, which writes
that in the dialect's shape, and :func:`stream_error`, the same as a stream's last event::

    OpenAI     {"error": {"message", "type", "param", "code", ...extras}}
    Anthropic  {"type": "error", "error": {"type", "message", ...extras}}

Mapping (the exception tree is drawn in :mod:`pipeline.errors`):

=============================  ======  ==========================  ==========================
exception                      status  OpenAI ``type``             Anthropic ``type``
=============================  ======  ==========================  ==========================
ValidationError (all)          400     invalid_request_error       invalid_request_error
 (LimitExceededError: code ``limit_exceeded`` with ``limit``, ``value``, ``maximum``)
UnknownNameError               400     invalid_request_error       invalid_request_error
TemplateError                  400     invalid_request_error       invalid_request_error
 (the chat template refused this conversation, e.g. its ``raise_exception`` on role order)
AuthenticationError            401     authentication_error        authentication_error
ModelNotFoundError             404     invalid_request_error       not_found_error
TraceNotFoundError             404     invalid_request_error       not_found_error
ResponseNotFoundError          404     invalid_request_error       not_found_error
OverloadedError                429/529 rate_limit_exceeded (429)   overloaded_error (529)
 QueueTimeoutError             503/529 service_unavailable (503)   overloaded_error (529)
 (admitted, it waited in the queue over ``max_queue_wait_s``: code ``queue_timeout``)
ModelLoadingError, EngineClosed 503    service_unavailable         api_error
PayloadTooLargeError           413     invalid_request_error       request_too_large
UnsupportedMediaTypeError      415     invalid_request_error       invalid_request_error
ClientGone                     499     client_closed_request       client_closed_request
anything else                  500     server_error                api_error
=============================  ======  ==========================  ==========================

A refusal a client may retry (over capacity, a queue timeout, a model loading or its engine
restarting) also says when to come back: :func:`retry_headers`, ``Retry-After`` in whole
seconds (HTTP's form) and ``retry-after-ms`` (which the OpenAI and Anthropic SDKs read first);
the app asks the gateway for the figure (:meth:`~transports.http.gateway.admission.Admission.retry_after`).

Two refusals happen below the app, before a request exists to raise anything: a request head
over ``max_header_bytes`` or ``max_headers`` (:func:`head_too_large`, 431, written by
:mod:`transports.http.server.wire`) and a read deadline (408, :mod:`transports.http.server.timeouts`).

Every string of an error body is valid Unicode (a lone surrogate a client sent is written as
its ``\\uXXXX`` escape), so echoing hostile input can never make the error itself fail.
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import attrs

from transports.sse import SSEEvent, encode
from pipeline.errors import (
    ContextWindowError, EngineClosed, InvalidValueError, LimitExceededError, TemplateError,
    UnknownFieldError, UnknownNameError, ValidationError,
)
from transports.http.serving_errors import (
    AuthenticationError, ClientGone, ModelLoadingError, ModelNotFoundError, OverloadedError,
    PayloadTooLargeError, QueueTimeoutError, ResponseNotFoundError, TraceNotFoundError,
    UnsupportedMediaTypeError,
)


class Dialect(enum.Enum):
    """Which API's error shape (and status for overload) a response uses."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


@attrs.frozen
class ErrorInfo:
    """What a client is told about a refused or failed request."""

    status: int
    openai_type: str
    anthropic_type: str
    message: str
    param: str | None = None
    code: str | None = None
    extras: dict[str, Any] = attrs.field(factory=dict)


def _validation(exc: ValidationError) -> ErrorInfo:
    if isinstance(exc, ContextWindowError):
        extras: dict[str, Any] = {"prompt_tokens": exc.prompt_tokens, "limit": exc.limit}
        if exc.requested is not None:
            extras["requested"] = exc.requested
        code = "context_length_exceeded" if exc.requested is None else "max_tokens_exceeded"
        return ErrorInfo(400, "invalid_request_error", "invalid_request_error", str(exc),
                         exc.field, code, extras)
    if isinstance(exc, LimitExceededError):
        return ErrorInfo(400, "invalid_request_error", "invalid_request_error", str(exc),
                         exc.field, "limit_exceeded",
                         {"limit": exc.limit, "value": exc.value, "maximum": exc.maximum})
    param = exc.field if isinstance(exc, (InvalidValueError, UnknownFieldError)) else None
    code = "unknown_field" if isinstance(exc, UnknownFieldError) else "invalid_value"
    return ErrorInfo(400, "invalid_request_error", "invalid_request_error", str(exc), param, code)


def classify(exc: BaseException) -> ErrorInfo:
    """The status and error types for ``exc``; unknown exceptions are a 500."""
    if isinstance(exc, ValidationError):
        return _validation(exc)
    if isinstance(exc, UnknownNameError):
        return ErrorInfo(400, "invalid_request_error", "invalid_request_error", str(exc),
                         exc.kind, "unknown_name")
    if isinstance(exc, TemplateError):
        return ErrorInfo(400, "invalid_request_error", "invalid_request_error",
                         f"the chat template cannot render this request: {exc}",
                         "messages", "template_error")
    if isinstance(exc, AuthenticationError):
        return ErrorInfo(401, "authentication_error", "authentication_error", str(exc),
                         code="invalid_api_key")
    if isinstance(exc, ModelNotFoundError):
        return ErrorInfo(404, "invalid_request_error", "not_found_error", str(exc), "model",
                         "model_not_found", {"served_models": list(exc.served)})
    if isinstance(exc, TraceNotFoundError):
        return ErrorInfo(404, "invalid_request_error", "not_found_error", str(exc),
                         "request_id", "trace_not_found")
    if isinstance(exc, ResponseNotFoundError):
        return ErrorInfo(404, "invalid_request_error", "not_found_error", str(exc),
                         "response_id", "response_not_found")
    if isinstance(exc, QueueTimeoutError):  # admitted, then never started: OpenAI's overload
        return ErrorInfo(503, "service_unavailable", "overloaded_error", str(exc),
                         code="queue_timeout", extras={"waited_s": exc.waited_s})
    if isinstance(exc, OverloadedError):
        return ErrorInfo(429, "rate_limit_exceeded", "overloaded_error", str(exc),
                         code="overloaded")
    if isinstance(exc, UnsupportedMediaTypeError):
        return ErrorInfo(415, "invalid_request_error", "invalid_request_error", str(exc),
                         code="unsupported_media_type")
    if isinstance(exc, PayloadTooLargeError):
        return ErrorInfo(413, "invalid_request_error", "request_too_large", str(exc),
                         code="request_too_large", extras={"limit": exc.limit})
    if isinstance(exc, ClientGone):
        return ErrorInfo(499, "client_closed_request", "client_closed_request", str(exc))
    if isinstance(exc, (ModelLoadingError, EngineClosed)):
        return ErrorInfo(503, "service_unavailable", "api_error", str(exc),
                         code="model_loading" if isinstance(exc, ModelLoadingError) else None)
    return ErrorInfo(500, "server_error", "api_error", "internal server error")


def route_error(status: int, method: str, path: str) -> ErrorInfo:
    """A path no route serves (404) or a method the path does not take (405)."""
    path = path.encode("utf-8", "backslashreplace").decode()[:200]
    if status == 405:
        return ErrorInfo(405, "invalid_request_error", "invalid_request_error",
                         f"{method} is not allowed on {path}", code="method_not_allowed")
    return ErrorInfo(404, "invalid_request_error", "not_found_error",
                     f"no such endpoint: {method} {path}", code="not_found")


def head_too_large(limit: str, value: int, maximum: int, what: str) -> ErrorInfo:
    """A request head over the server's limit ``limit`` (a setting's name): 431, Request
    Header Fields Too Large. ``value`` is what was counted when it was refused (bytes: at
    least that many)."""
    return ErrorInfo(431, "invalid_request_error", "invalid_request_error",
                     f"request header fields too large: {value} {what} exceeds the limit of "
                     f"{maximum} (server setting {limit})", code="header_fields_too_large",
                     extras={"limit": limit, "value": value, "maximum": maximum})


def retry_headers(seconds: float | None) -> dict[str, str]:
    """The headers that tell a refused client to retry after ``seconds`` (none for None):
    ``Retry-After`` rounded up to whole seconds, as HTTP requires, and ``retry-after-ms``,
    the figure to the millisecond, which the OpenAI and Anthropic SDKs prefer."""
    if seconds is None:
        return {}
    return {"retry-after": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1e3))}


def status_for(info: ErrorInfo, dialect: Dialect) -> int:
    """The HTTP status: Anthropic reports overload as 529, as its API does."""
    if dialect is Dialect.ANTHROPIC and info.anthropic_type == "overloaded_error":
        return 529
    return info.status


def _safe(value: Any) -> Any:
    """``value`` with every string made valid Unicode (lone surrogates escaped)."""
    if isinstance(value, str):
        return value if value.isascii() else value.encode("utf-8", "backslashreplace").decode()
    if isinstance(value, dict):
        return {_safe(k): _safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe(v) for v in value]
    return value


def error_body(info: ErrorInfo, dialect: Dialect) -> dict[str, Any]:
    """The JSON error body in ``dialect``'s shape (every string valid Unicode)."""
    return _safe(_body(info, dialect))  # type: ignore[no-any-return]


def stream_error(exc: BaseException, dialect: Dialect) -> bytes:
    """The SSE event that ends a stream failed by ``exc``: the error body of
    :func:`error_body`, as OpenAI's bare ``data:`` line or Anthropic's ``event: error``."""
    body = error_body(classify(exc), dialect)
    return encode(SSEEvent(json.dumps(body), "error" if dialect is Dialect.ANTHROPIC else None))


def _body(info: ErrorInfo, dialect: Dialect) -> dict[str, Any]:
    if dialect is Dialect.ANTHROPIC:
        inner: dict[str, Any] = {"type": info.anthropic_type, "message": info.message}
        if info.param is not None:
            inner["param"] = info.param
        return {"type": "error", "error": {**inner, **info.extras}}
    return {"error": {"message": info.message, "type": info.openai_type, "param": info.param,
                      "code": info.code, **info.extras}}
