"""What the HTTP server writes to its log (docs/design.md §14): the ``pipeline.serve`` loggers.

Owns the server's lines and their wording: where it listens, each model's load (what it is,
its memory, how long it took, the strategy it generates with and the settings given for it)
or failure, and the access log, one line per HTTP request
written by :class:`AccessLog`, an ASGI middleware around the whole app, when the response
has ended (for a stream: after its last event, with the real token counts; for a 4xx, why),
or by :func:`refused` for a request refused below the app (:mod:`transports.http.server.wire`).
Client-chosen text in a line is escaped and cut (:func:`clean`, :func:`quoted`): no request
can end a line or forge one. :func:`configure`
sends these loggers (and uvicorn's warnings and errors) to standard error in one format; the
library itself never configures logging, so an application embedding the server decides.

Loggers: ``pipeline.serve`` (lifecycle, models, errors) and ``pipeline.serve.access``
(requests, at INFO). The lines::

    2025-01-31 12:00:00.123 INFO pipeline.serve: loading model 'tiny' (tiny) on cpu
    2025-01-31 12:00:00.544 INFO pipeline.serve: model 'tiny' ready in 0.42 s: Qwen3MoeForCausalLM, 6.35M parameters (6348864), bfloat16 on cpu, weights 12.1 MiB (12697728 bytes), KV cache 48.0 MiB, window 4096 tokens, 8 slots, strategy autoregressive
    2025-01-31 12:00:00.544 INFO pipeline.serve: model 'tiny' samples by default with temperature 0.7, top_k 40, top_p 0.9, repetition_penalty 1.1 (generation_config.json)
    2025-01-31 12:00:00.903 INFO pipeline.serve: model 'masked' ready in 0.36 s: Qwen3ForCausalLM, 2.8M parameters (2803968), bfloat16 on cpu, weights 5.3 MiB (5607936 bytes), KV cache 48.0 MiB, window 4096 tokens, 8 slots, strategy fast_dllm (steps=4 block_length=8 threshold=0.1)
    2025-01-31 12:00:00.601 INFO pipeline.serve: listening on http://127.0.0.1:8000 (models: tiny)
    2025-01-31 12:00:00.601 INFO pipeline.serve: chat page: http://127.0.0.1:8000/ (OpenAPI description: http://127.0.0.1:8000/openapi.json)
    2025-01-31 12:00:03.002 INFO pipeline.serve.access: POST /v1/chat/completions 200 412.3ms model=tiny prompt_tokens=17 completion_tokens=32 finish=length request_id=chatcmpl-6c1f... client=127.0.0.1:50412
    2025-01-31 12:00:04.310 INFO pipeline.serve.access: POST /v1/messages 400 3.1ms error=invalid_request_error reason="messages[0].role='system': must be 'user' or 'assistant'" request_id=- client=127.0.0.1:50414
    2025-01-31 12:00:05.020 INFO pipeline.serve.access: - - 431 - error=header_fields_too_large reason="request header fields too large: 70012 bytes of request line and header fields exceeds the limit of 65536 (server setting max_header_bytes)" request_id=- client=127.0.0.1:50416
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

import attrs
from starlette.requests import Request as HTTPRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.errors import PipelineError
from pipeline.contracts.model import ModelInfo, human_bytes, human_count
from pipeline.strategy_choice import StrategyChoice
from pipeline.contracts.output import Completion
from transports.http.gateway.models import Flight
from transports.http.server.choices import total_usage

log = logging.getLogger("pipeline.serve")
access_log = logging.getLogger("pipeline.serve.access")
FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
CLIENT_CLOSED = 499
"""nginx's "client closed request": the status of a request whose client left before its
response started (the app answers it so, and the access log writes it whatever the app
answered to nobody); a stream the client leaves keeps the 200 it was sent."""
REASON_CHARS = 160
"""Characters of an error's message an access line keeps."""
ERROR_BODY_BYTES = 16 * 1024
"""Bytes of a 4xx response's body the access log reads for its error (ours are far less)."""
USAGE_WAIT_S = 10.0
"""How long the access line waits for the usage of a generation the client left (its cancel
takes effect at the engine's next step)."""


def configure(level: int | str = logging.INFO, stream: TextIO | None = None) -> None:
    """Write the ``pipeline`` loggers at ``level`` and uvicorn's warnings and errors to
    ``stream`` (standard error), one line per record in :data:`FORMAT`. Call once, from the
    application (``pipeline serve`` does)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    for name, at in (("pipeline", level), ("uvicorn", logging.WARNING)):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(at)
        logger.propagate = False


# --- wording ------------------------------------------------------------------------------


def describe(info: ModelInfo) -> str:
    """What a model is and the memory it holds, as the load line says it."""
    weights = f"weights {human_bytes(info.weight_bytes)} ({info.weight_bytes} bytes)"
    if info.packed_bytes:
        weights += f" + {human_bytes(info.packed_bytes)} packed copies"
    cache = f", KV cache {human_bytes(info.cache_bytes)}" if info.cache_bytes else ""
    return (f"{info.architecture}, {human_count(info.parameters)} parameters "
            f"({info.parameters}), {info.dtype} on {info.device}, {weights}{cache}")


def reason(exc: BaseException) -> str:
    """Why something failed, on one line: our own errors say it themselves; anything else
    names its type."""
    text = str(exc) if isinstance(exc, PipelineError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split()) or type(exc).__name__


def model_loading(name: str, source: str, device: str) -> None:
    """A model starts loading."""
    log.info("loading model %r (%s) on %s", name, source, device)


def model_loaded(name: str, info: ModelInfo | None, seconds: float, window: int,
                 slots: int, strategy: str | None = None,
                 choice: StrategyChoice | None = None) -> None:
    """A model is ready to serve; ``strategy`` is the one it runs (None: not known) and
    ``choice`` what the server was told about it (its settings are written beside it)."""
    what = describe(info) if info is not None else "the backend does not describe its model"
    log.info("model %r ready in %.2f s: %s, window %d tokens, %d slots%s", name, seconds, what,
             window, slots, strategy_words(strategy, choice))


def model_sampling(name: str, summary: str, source: str) -> None:
    """The sampling a request to the model gets for every field it leaves out, and where it
    comes from (the model's own recommendation or the pipeline default)."""
    log.info("model %r samples by default with %s (%s)", name, summary, source)


def strategy_words(strategy: str | None, choice: StrategyChoice | None) -> str:
    """``, strategy fast_dllm (steps=4 block_length=8)`` for the load line: the strategy and
    the settings given for it (the rest are the model's or the strategy's defaults)."""
    if strategy is None:
        return ""
    settings = choice.settings() if choice is not None else ""
    return f", strategy {strategy}" + (f" ({settings})" if settings else "")


def model_failed(name: str, exc: BaseException) -> None:
    """A model could not be loaded: one ERROR line, no traceback for our own errors."""
    log.error("model %r failed to load: %s", name, reason(exc))


def listening(url: str, models: Iterable[str]) -> None:
    """The server accepts connections; the next line says where the chat page is."""
    log.info("listening on %s (models: %s)", url, ", ".join(models))
    page = url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
    log.info("chat page: %s/ (OpenAPI description: %s/openapi.json)", page, page)


def url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# --- the access log -----------------------------------------------------------------------


@attrs.frozen
class Generation:
    """What a request's access line says about the generation it started: the request id
    its response carries (``x-request-id``), its choices' flights in choice order, and
    ``n``, the choices per prompt (so each prompt's tokens count once)."""

    request_id: str
    flights: Sequence[Flight]
    n: int = 1


def record_generation(http: HTTPRequest, request_id: str, flights: Sequence[Flight],
                      n: int = 1) -> None:
    """Tell the access log which generation ``http`` started: its id and its choices, whose
    usage goes in the request's line."""
    http.state.generation = Generation(request_id, tuple(flights), n)


def clean(text: str, limit: int = 200) -> str:
    """Client-chosen text made safe for one log line: no spaces or control characters,
    at most ``limit`` characters."""
    text = repr(text[:limit])[1:-1].replace(" ", "%20")
    return text


def quoted(text: str, limit: int = REASON_CHARS) -> str:
    """Text that may hold client input (an error message echoing a value) as one quoted
    token of a log line: at most ``limit`` characters (then ``...``), every quote, backslash,
    control and non-ASCII character escaped, so no input can end the line or fake a field."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return json.dumps(cut)


def error_fields(body: bytes) -> list[str]:
    """``error=`` and ``reason=`` for a 4xx response's JSON error body, as the client was
    told it (either dialect's shape: the OpenAI ``code``, else the error's ``type``; the
    message); nothing for a body that is not one."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return []
    error = value.get("error") if isinstance(value, dict) else None
    if not isinstance(error, dict):
        return []
    kind = error.get("code") or error.get("type")
    fields = [f"error={clean(kind, 60)}"] if isinstance(kind, str) and kind else []
    message = error.get("message")
    if isinstance(message, str):
        fields.append(f"reason={quoted(message)}")
    return fields


def refused(status: int, error: str, reason: str, client: tuple[str, int] | None) -> None:
    """The access line of a request refused below the app, while its head arrived (no method
    or path known to the app, no latency): ``- - 431 - error=... reason="..."``."""
    access_log.info("- - %d - error=%s reason=%s request_id=- client=%s", status,
                    clean(error, 60), quoted(reason), _client(client))


def _client(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "-"


class AccessLog:
    """ASGI middleware: one ``pipeline.serve.access`` line per HTTP request, once its
    response has ended.

    The line: method, path, status, latency in ms, then ``model=``, ``prompt_tokens=``,
    ``completion_tokens=`` and ``finish=`` for a request that started a generation (its
    real counts, also for a stream or a client that left; for a request of several choices
    the request's usage as its response reports it, each prompt once and the completions
    summed, and the choices' finish reasons joined by commas in choice order),
    ``error=`` and ``reason=`` for a 4xx answer (what its JSON error body told the client:
    the error's code or type, and its message quoted and cut, see :func:`error_fields`; a
    client that left is ``error=client_closed_request``),
    ``request_id=`` (the id its ``x-request-id`` header carries, ``-`` for a request that
    started no generation) and ``client=``. A client that left
    before its response started is logged as 499 whatever the app answered to nobody; an
    exception that escapes the app as the 500 Starlette answers with.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: list[int] = []
        error = bytearray()  # the start of a 4xx answer's body

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not status:
                status.append(CLIENT_CLOSED)  # whatever the app answers now reaches nobody
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            elif (message["type"] == "http.response.body" and status and 400 <= status[0] < 500
                  and len(error) < ERROR_BODY_BYTES):
                error.extend(message.get("body", b"")[:ERROR_BODY_BYTES - len(error)])
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        except BaseException:
            # no waiting on this path (the task may be cancelled): counts known by now only
            await self._line(scope, status[0] if status else 500, start, bytes(error),
                             wait=False)
            raise
        await self._line(scope, status[0] if status else 0, start, bytes(error), wait=True)

    async def _line(self, scope: Scope, status: int, start: float, error: bytes, *,
                    wait: bool) -> None:
        elapsed = time.perf_counter() - start
        if not access_log.isEnabledFor(logging.INFO):
            return
        state: Mapping[str, Any] = scope.get("state") or {}
        generation: Generation | None = state.get("generation")
        fields = []
        if state.get("model"):
            fields.append(f"model={clean(str(state['model']), 80)}")
        request_id = "-"
        if generation is not None:
            request_id = generation.request_id
            completions = await _completions(generation.flights, wait)
            if completions:
                usage = total_usage(completions, generation.n)
                finish = ",".join(c.finish_reason.value for c in completions)
                fields += [f"prompt_tokens={usage.prompt_tokens}",
                           f"completion_tokens={usage.completion_tokens}",
                           f"finish={finish}"]
        if status == CLIENT_CLOSED:
            fields.append("error=client_closed_request")
        elif 400 <= status < 500:
            fields += error_fields(error)
        fields += [f"request_id={request_id}", f"client={_client(scope.get('client'))}"]
        access_log.info("%s %s %s %.1fms %s", scope["method"], clean(scope["path"]),
                        status or "-", elapsed * 1e3, " ".join(fields))


async def _completions(flights: Sequence[Flight], wait: bool) -> list[Completion] | None:
    """Every choice's completion once the request's usage is recorded: waited for at most
    :data:`USAGE_WAIT_S` when ``wait``, else only if already known; ``None`` otherwise."""
    dones = [flight.done for flight in flights]
    if not wait:
        return [done.result() for done in dones] if all(d.done() for d in dones) else None
    try:
        return list(await asyncio.wait_for(asyncio.shield(asyncio.gather(*dones)),
                                           USAGE_WAIT_S))
    except asyncio.TimeoutError:
        return None
