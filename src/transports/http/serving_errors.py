"""The serving side of the exception tree: what the HTTP server refuses or gives up on.

Every class here is a :class:`ServingError`, a :class:`~pipeline.errors.PipelineError` that
the library itself never raises; :mod:`transports.http.server.errors` maps them, with the
library's own, to statuses and dialect error bodies. Also owns :func:`failure_class`, the
reason class a stopped engine's failure is told to strangers as.

::

    ServingError                           the HTTP gateway refused a request
    ├── AuthenticationError                  missing or wrong API key
    ├── ModelNotFoundError                   no served model has that name
    ├── TraceNotFoundError                   no kept trace for that request id (and key)
    ├── ResponseNotFoundError                no stored response with that id (and key)
    ├── OverloadedError                      concurrency and queue are full
    │   └── QueueTimeoutError                  an admitted request waited too long
    ├── ModelLoadingError                    the model is still loading (or restarting)
    ├── PayloadTooLargeError                 the request body exceeds the size limit
    ├── UnsupportedMediaTypeError            the request body is not declared JSON
    └── ClientGone                           the client disconnected; work for it stopped
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeline.errors import PipelineError, brief


class ServingError(PipelineError):
    """The serving gateway refused a request before it reached a pipeline."""


class AuthenticationError(ServingError):
    """The request carried no API key, or a key the server does not accept."""


class ModelNotFoundError(ServingError, LookupError):
    """No served model is called ``model``; ``served`` lists the names that are."""

    def __init__(self, model: str, served: Iterable[str]) -> None:
        self.model = model
        self.served = tuple(sorted(served))
        super().__init__(f"model {model!r} is not served here; served models: "
                         f"{', '.join(self.served) or '(none)'}")


class ResponseNotFoundError(ServingError, LookupError):
    """The server keeps no response ``response_id`` for this caller: unknown, stored with
    ``store`` false, deleted, dropped as the oldest of ``kept``, or made with another API key
    (deliberately indistinguishable)."""

    def __init__(self, response_id: str, kept: int) -> None:
        self.response_id = response_id
        self.kept = kept
        super().__init__(f"no response {brief(response_id)} is stored here for this key "
                         f"(unknown, stored with store=false, deleted, made with another key, "
                         f"or dropped: the last {kept} are kept)")


class TraceNotFoundError(ServingError, LookupError):
    """The server keeps no trace of ``request_id`` for this caller: unknown, evicted, still
    running, or made with another API key (deliberately indistinguishable)."""

    def __init__(self, request_id: str, kept: int) -> None:
        self.request_id = request_id
        self.kept = kept
        why = (f"traces are kept for the last {kept} finished requests, each for the API key "
               "that made it" if kept else "this server keeps no traces (keep_traces is 0)")
        super().__init__(f"no trace of request {brief(request_id)}: {why}")


class OverloadedError(ServingError):
    """Every concurrency slot and queue place is taken; try again later. ``reason`` is what
    the server's summary of refusals counts it as."""

    def __init__(self, message: str, reason: str = "over capacity") -> None:
        self.reason = reason
        super().__init__(message)


class QueueTimeoutError(OverloadedError):
    """An admitted request waited in its model's queue longer than the server's bound
    (``waited_s``) without getting a slot; it was never started."""

    def __init__(self, model: str, waited_s: float) -> None:
        self.model = model
        self.waited_s = waited_s
        super().__init__(f"model {model!r} is overloaded: the request waited {waited_s:g} s "
                         "in its queue without getting a slot (server setting "
                         "max_queue_wait_s); retry later",
                         reason=f"waited over {waited_s:g} s in the queue")


class ModelLoadingError(ServingError):
    """The model exists but is still loading (or failed to load: ``failed`` is then set; or
    its engine stopped and is being restarted: ``restarting`` is then the reason). The
    message names only the reason's class (:func:`failure_class`): it goes to every client
    refused meanwhile, and the reason itself may describe another client's request."""

    def __init__(self, model: str, failed: str | None = None,
                 restarting: str | None = None) -> None:
        self.model = model
        self.failed = failed
        self.restarting = restarting
        state = (f"failed to load: {failed}" if failed else
                 f"has an engine that stopped ({failure_class(restarting)}); a fresh one is "
                 "starting" if restarting else "is still loading")
        super().__init__(f"model {model!r} {state}")


def failure_class(why: str) -> str:
    """The class of an engine's failure ``why``: what a client other than the one it hit,
    or a stranger asking ``/health``, may be told of it — ``stalled``, ``unresponsive``,
    ``rank_lost`` or ``engine_stopped``."""
    if why.startswith("stalled: the engine process"):  # alive, but not taking up its work
        return "unresponsive"
    if why.startswith("stalled"):
        return "stalled"
    if "parallel group" in why or why.startswith("rank "):
        return "rank_lost"
    return "engine_stopped"


class UnsupportedMediaTypeError(ServingError):
    """A request body whose ``Content-Type`` is not JSON (the server reads JSON only)."""

    def __init__(self, content_type: str) -> None:
        self.content_type = content_type
        super().__init__(f"Content-Type {brief(content_type)} is not JSON: send the body as "
                         "JSON with Content-Type: application/json (curl: --json, or -H "
                         "'Content-Type: application/json'; -d alone sends "
                         "application/x-www-form-urlencoded)")


class PayloadTooLargeError(ServingError):
    """The request body has ``size`` bytes (at least), over the server's ``limit``."""

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"request body of {size} bytes exceeds the limit of {limit} bytes "
                         "(server setting max_body_bytes)")


class ClientGone(ServingError):
    """The client disconnected before its answer was ready; the work for it was stopped."""
