"""The ASGI application: routes, the request flow, and streaming with disconnect → cancel.

Owns :func:`create_app` (a Starlette app over a :class:`~transports.http.gateway.gateway.Gateway`) and
the flow every generation takes: key → body (declared JSON or undeclared, else 415; at most
``max_body_bytes``, else 413) → the capacity pre-check on the raw body (a request whose
model is full is refused before it is parsed:
:mod:`transports.http.gateway.door`) → JSON checked at the door (depth, Unicode, size limits)
and dialect parse → model →
``traceparent`` → the request's choices prepared, fitted and admitted together
(:mod:`transports.http.server.generation`) → stream (their deltas interleaved by choice) or wait for
all of them. Everything after reading the body that costs in proportion to the input runs on
the bounded pool of :mod:`transports.http.server.work` and stops when the client leaves. Errors
anywhere before the first byte become the dialect's error response through
:mod:`transports.http.server.errors`, the only place that maps them; refusals (over capacity, a
queue wait over ``max_queue_wait_s``, a model loading or restarting) are logged as one
summary line per burst, other 5xx one ERROR line each; a refusal the client may retry says
when, in ``Retry-After`` and ``retry-after-ms``
(:meth:`~transports.http.gateway.admission.Admission.retry_after`). A streaming client that
disconnects cancels its request (Starlette cancels the body iterator; its ``finally`` cancels
every choice's handle, and the engine frees the slots at its next step); a non-streaming one
is watched for ``http.disconnect`` the same way. A client whose body never fully arrives (it
left, or a read deadline of :mod:`transports.http.server.timeouts` cut it off) is counted as 499,
nginx's "client closed request", not as a server error.

``POST /v1/responses`` takes the same flow: :mod:`transports.http.dialects.responses` turns its
body into the chat request it amounts to and brings a :class:`~transports.http.server.generation.Form`
that answers in the Responses shape; ``GET`` and ``DELETE /v1/responses/{id}`` read and
forget a stored response (:class:`~transports.http.dialects.responses_output.Conversations`), for a
key that made it. ``POST /v1/embeddings``
(:mod:`transports.http.dialects.embeddings`) runs its forwards on the engine's thread.

Every generation response carries its request id (the body's ``id``) in ``x-request-id``;
``GET /traces/{id}`` returns that request's trace as JSONL to a key that made it, every
choice's trace when it asked for several, and ``GET /traces/{id}-{k}`` choice ``k``'s alone
(:mod:`transports.http.accounting.traces`). ``GET /`` is the web chat page
(:mod:`transports.http.page.page`), which needs no key to load. The whole app runs inside the
access log's middleware (:class:`~transports.http.accounting.logs.AccessLog`), told which generation a
request started (its request id and every choice's flight) so that its one line carries the
request's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import PurePath
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.routing import Route

from pipeline.engine import ENGINE_DOWN
from pipeline.errors import EngineClosed, InvalidValueError, LimitExceededError, PipelineError
from transports.http.serving_errors import (
    ModelNotFoundError, PayloadTooLargeError, QueueTimeoutError, failure_class,
)
from pipeline.engine.handle import RequestHandle
from pipeline.pipe import Pipeline
from pipeline.contracts.transport import Transport
from pipeline.contracts.output import Completion, Delta
from transports.http.dialects import (
    anthropic as anthropic_api, completions as completions_api, embeddings as embeddings_api,
    openai as openai_api, responses as responses_api, responses_output,
)
from transports.http.server import generation
from transports.http.gateway.door import (
    Refusals, check_media_type, peek_models, queue_timed_out, refusal_reason,
)
from transports.http.server.choices import merged
from transports.http.dialects.common import (
    Parsed, ServerDefaults, StreamEncoder, traceparent, with_model_defaults,
)
from transports.http.server.errors import (
    Dialect, classify, error_body, retry_headers, route_error, status_for, stream_error,
)
from transports.http.dialects.fields import Obj, check, parse_json
from transports.http.gateway.gateway import Gateway
from transports.http.gateway.models import UNMENDABLE, ModelState, ServedModel
from transports.http.server.health import operator_health, public_health
from transports.http.server.generation import Started
from transports.http.accounting.logs import CLIENT_CLOSED, AccessLog, record_generation
from transports.http.accounting.metrics import CONTENT_TYPE
from transports.http.dialects.openapi import openapi_document
from transports.http.accounting.inspector import RECORDING_HEADER, TraceViews, with_recording
from transports.http.page.page import MEDIA_TYPE as HTML, ChatPage, asset_handler
from transports.http.accounting.traces import MEDIA_TYPE as JSONL
from transports.http.server.work import Checkpoint, Workers, disconnected
from transports.sse import encode_comment

log = logging.getLogger("pipeline.serve")
Handler = Callable[[HTTPRequest], Awaitable[Response]]
KEEP_ALIVE = encode_comment("keep-alive")


def _error(exc: BaseException, dialect: Dialect,
           retry_after_s: float | None = None) -> JSONResponse:
    """``exc`` as the dialect's error response; ``retry_after_s``: when the client may send
    again (the ``Retry-After`` headers), None for no such headers."""
    info = classify(exc)
    # every 5xx but a refusal is logged (the body tells the client nothing useful); refusals
    # are counted into one line per burst (admission.Refusals)
    if info.status >= 500 and refusal_reason(exc) is None:
        log.error("%d: %s", info.status, exc, exc_info=not isinstance(exc, PipelineError))
    return JSONResponse(error_body(info, dialect), status_for(info, dialect),
                        headers=retry_headers(retry_after_s))


ENGINE_DOWN_CLASSES = {"stalled": "its step stalled", "unresponsive": "it stopped responding",
                       "rank_lost": "it lost a rank of its parallel group"}
"""What a client whose request the engine's stop ended is told of why, by failure class."""


def _failed(completion: Completion, served: ServedModel, wait_s: float | None) -> Exception:
    """What a failed completion is raised as: the overload error when it waited in the queue
    over ``wait_s`` (the server's bound), a 503 the client may retry when the engine as a
    whole went down under it, else a 500."""
    error = completion.error
    if queue_timed_out(error):
        return QueueTimeoutError(served.name, wait_s or completion.timings.queued_s)
    if error is not None and error.startswith(ENGINE_DOWN):  # no detail leaks: the log has it
        why = ENGINE_DOWN_CLASSES.get(failure_class(error[len(ENGINE_DOWN) + 2:]), "it failed")
        then = ("a fresh one is starting: retry the request" if served.mendable else UNMENDABLE)
        return EngineClosed(f"generation failed: the model's engine stopped ({why}); {then}")
    return RuntimeError(f"generation failed: {completion.error}")


class Server:
    """The routes' handlers over one gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.page = ChatPage.load()
        c = gateway.config
        self.defaults = ServerDefaults(c.default_max_tokens, c.reasoning_budget_tokens)
        self.limits = c.limits
        self.work = Workers(c.work_threads, c.work_queue)
        self.conversations = responses_output.Conversations()
        self.refusals = Refusals()

    def refused(self, exc: BaseException) -> None:
        """Count ``exc`` into the refusals' summary when it is a refusal (event loop only);
        the burst it opens is written :data:`~transports.http.gateway.door.REFUSAL_WINDOW_S`
        later."""
        reason = refusal_reason(exc)
        if reason is not None and self.refusals.count(reason):
            asyncio.get_running_loop().call_later(self.refusals.window_s, self.refusals.flush)

    # --- the shared front of every authenticated endpoint ----------------------------------

    def endpoint(self, name: str, dialect: Dialect,
                 body: Callable[[HTTPRequest], Awaitable[Response]]) -> Handler:
        """Wrap ``body`` with the key check (the keys' fingerprints go to ``http.state.keys``),
        the error mapping and request counting."""

        async def handler(http: HTTPRequest) -> Response:
            try:
                http.state.keys = self.gateway.keys.authenticate(
                    http.headers.getlist("authorization"), http.headers.getlist("x-api-key"))
                response = await body(http)
            except ClientDisconnect:
                # nobody is left to answer, and it is no fault of ours: no 500, no traceback
                response = Response(status_code=CLIENT_CLOSED)
            except Exception as exc:
                self.refused(exc)
                retry_s = self.gateway.admission.retry_after(exc, getattr(http.state, "model", None))
                response = _error(exc, dialect, retry_s)
            self.gateway.metrics.request(getattr(http.state, "model", ""), name,
                                         response.status_code)
            return response

        return handler

    async def _read(self, http: HTTPRequest) -> bytes:
        """The body, refused with a 415 unless it is declared JSON (or not declared at all)
        and with a 413 as soon as it is known to exceed the limit."""
        check_media_type(http.headers.get("content-type"))
        limit = self.limits.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise InvalidValueError("Content-Length", declared, "must be a byte count")
            if int(declared) > limit:
                raise PayloadTooLargeError(int(declared), limit)
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLargeError(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    def _door(self, raw: bytes) -> Any:
        """Parsed JSON that passed the door's checks: depth, Unicode, size limits."""
        value = parse_json(raw, self.limits.max_json_depth)
        self.limits.check(value)
        return value

    async def _parsed(self, http: HTTPRequest, parse: Callable[[Any], Parsed]) -> Parsed:
        raw = await self._read(http)
        return await self.work.run(http, lambda _: parse(self._door(raw)))

    async def _admissible(self, http: HTTPRequest) -> bytes:
        """A generation request's body, refused before it is parsed when every model it may
        name is at capacity (:meth:`~transports.http.gateway.admission.Admission.precheck`)."""
        raw = await self._read(http)
        names = peek_models(raw)
        served = [name for name in names if name in self.gateway.models]
        if len(served) == 1:  # metrics count the refusal under the model's served name
            http.state.model = served[0]
        self.gateway.admission.precheck(names)
        return raw

    async def _generation(self, http: HTTPRequest, parse: Callable[[Any], Parsed]) -> Parsed:
        raw = await self._admissible(http)
        return await self.work.run(http, lambda _: parse(self._door(raw)))

    def _served(self, http: HTTPRequest, parsed: Parsed) -> ServedModel:
        http.state.model = parsed.model
        return self.gateway.model(parsed.model)

    # --- generation --------------------------------------------------------------------------

    async def chat(self, http: HTTPRequest) -> Response:
        """``POST /v1/chat/completions``."""
        parsed = await self._generation(
            http, lambda body: openai_api.parse_chat(body, self.defaults))
        return await self._generate(http, parsed, Dialect.OPENAI, "chat.completions")

    async def messages(self, http: HTTPRequest) -> Response:
        """``POST /v1/messages``."""
        parsed = await self._generation(
            http, lambda body: anthropic_api.parse_messages(body, self.defaults))
        return await self._generate(http, parsed, Dialect.ANTHROPIC, "messages")

    async def completions(self, http: HTTPRequest) -> Response:
        """``POST /v1/completions``."""
        parsed = await self._generation(
            http, lambda body: completions_api.parse_completions(body, self.defaults))
        return await self._generate(http, parsed, Dialect.OPENAI, "completions")

    async def responses(self, http: HTTPRequest) -> Response:
        """``POST /v1/responses``: translated to the chat flow, answered in its own form."""
        raw, keys = await self._admissible(http), http.state.keys
        asked = await self.work.run(http, lambda _: responses_api.parse_responses(
            self._door(raw), self.defaults, self.limits, self.conversations, keys))
        return await self._generate(http, asked.parsed, Dialect.OPENAI, "responses",
                                    asked.form)

    async def stored_response(self, http: HTTPRequest) -> Response:
        """``GET /v1/responses/{response_id}``: a stored response object, for a key that made
        it (404 for any other, as for an unknown, deleted or dropped id)."""
        responses_output.check_retrieve_query(http.query_params.multi_items())
        response_id = http.path_params["response_id"]
        return JSONResponse(self.conversations.response(response_id, http.state.keys))

    async def delete_response(self, http: HTTPRequest) -> Response:
        """``DELETE /v1/responses/{response_id}``: forget a stored response (its object and
        its conversation), for a key that made it; OpenAI's deletion object."""
        response_id = http.path_params["response_id"]
        self.conversations.delete(response_id, http.state.keys)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def embeddings(self, http: HTTPRequest) -> Response:
        """``POST /v1/embeddings`` (the forwards run on the engine's thread)."""
        raw = await self._read(http)
        ask = await self.work.run(
            http, lambda _: embeddings_api.parse_embeddings(self._door(raw), self.limits))
        served = self._served_name(http, ask.model)
        inputs = await self.work.run(
            http, lambda check: embeddings_api.token_inputs(self.gateway, served, ask, check))
        vectors = await embeddings_api.embed(http, served, inputs)
        return JSONResponse(embeddings_api.embeddings_body(ask, inputs, vectors))

    async def _generate(self, http: HTTPRequest, parsed: Parsed, dialect: Dialect,
                        endpoint: str, form: generation.Form | None = None) -> Response:
        served = self._served(http, parsed)
        parsed = with_model_defaults(parsed, served.pipe.defaults)  # what the body left out
        meta = {**parsed.request.client_metadata,
                **traceparent(http.headers.get("traceparent"))}
        request = attrs.evolve(parsed.request, client_metadata=meta)
        recording = http.headers.get(RECORDING_HEADER)  # the page's inspector asks for full
        parsed = attrs.evolve(parsed, request=with_recording(request, recording))
        loop = asyncio.get_running_loop()
        owners: frozenset[str] = http.state.keys
        started = await self.work.run(
            http, lambda checkpoint: generation.start(self.gateway, served, parsed, dialect,
                                                      endpoint, loop, checkpoint, owners),
            orphan=Started.cancel)
        parsed = attrs.evolve(parsed, thinking=started.thinking)
        # the request's id: its response's ``id``, its usage row and its traces' key
        request_id = {"x-request-id": parsed.request.request_id}
        record_generation(http, parsed.request.request_id, started.flights, parsed.n)
        if parsed.stream:
            # The generator's own ``finally`` cancels when the client leaves; the background
            # task cancels too when the stream never started (a disconnect seen first).
            return StreamingResponse(self._stream(served, started, parsed, dialect, form),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **request_id},
                                     background=BackgroundTask(started.cancel))
        completions = await self._wait(http, started)
        failed = next((c for c in completions if c.error is not None), None)
        if failed is not None:
            raise _failed(failed, served, self.gateway.config.max_queue_wait_s)
        body = (form.answer(served, parsed, started, completions) if form is not None
                else generation.answer(served, parsed, dialect, started, completions))
        return JSONResponse(body, headers=request_id)

    async def _wait(self, http: HTTPRequest, started: Started) -> list[Completion]:
        """Every choice's completion; a client that disconnects first cancels them."""
        watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected(http))
        done = asyncio.gather(*(f.done for f in started.flights))
        try:
            await asyncio.wait({done, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not done.done():
                started.cancel()
            watcher.cancel()
        return list(await done)

    async def _stream(self, served: ServedModel, started: Started, parsed: Parsed,
                      dialect: Dialect, form: generation.Form | None = None
                      ) -> AsyncIterator[bytes]:
        own = form.encoder(served, parsed, started) if form is not None else None
        encoder = own if own is not None else generation.encoder(served, parsed, dialect,
                                                                 started)
        opening = encoder.start()
        if opening:
            yield opening
        histogram = self.gateway.metrics.inter_token.labels(served.name)
        handles = [f.handle for f in started.flights]
        try:
            async for chunk in self._stream_deltas(handles, served.pipe.stages.async_transport,
                                                   encoder, parsed, dialect, histogram):
                yield chunk
        finally:  # the client left mid-stream: cancel, and free the admission places now
            if not all(h.done() for h in handles):
                started.cancel()
        completions = await asyncio.gather(*(f.done for f in started.flights))
        failed = next((c for c in completions if c.error is not None), None)
        if failed is not None:
            exc = _failed(failed, served, self.gateway.config.max_queue_wait_s)
            self.refused(exc)
            yield own.fail(exc) if own is not None else stream_error(exc, dialect)
            return
        yield encoder.end(completions)

    async def _stream_deltas(self, handles: list[RequestHandle],
                             transport: Transport[AsyncIterator[Delta]], encoder: StreamEncoder,
                             parsed: Parsed, dialect: Dialect,
                             histogram: Any) -> AsyncIterator[bytes]:
        """The stream's chunks while its choices produce deltas (pings while idle); each
        delta's typed parts are the engine's (:attr:`~pipeline.contracts.output.Delta.parts`)."""
        last: dict[int, float] = {}
        async for item in merged(handles, self.gateway.config.ping_interval_s, transport):
            if item is None:  # idle (queued): keep the connection alive
                yield anthropic_api.PING if dialect is Dialect.ANTHROPIC else KEEP_ALIVE
                continue
            index, delta = item
            now = time.perf_counter()
            if index in last:
                histogram.observe(now - last[index])
            last[index] = now
            # a raw completion is text as it came
            parts = list(delta.parts) if parsed.raw is None else []
            chunk = encoder.delta(index, parts, delta)
            if chunk:
                yield chunk

    # --- counting and tokens -----------------------------------------------------------------

    async def count_tokens(self, http: HTTPRequest) -> Response:
        """``POST /v1/messages/count_tokens``."""
        parsed = await self._parsed(
            http, lambda body: anthropic_api.parse_messages(body, self.defaults, counting=True))
        pipe = self._served(http, parsed).pipe
        count = await self.work.run(http, lambda _: pipe.count_tokens(parsed.request))
        return JSONResponse({"input_tokens": count})

    async def tokenize(self, http: HTTPRequest) -> Response:
        """``POST /tokenize``: ``{model, prompt | messages (+ tools, tool_choice)}`` → token
        ids."""
        raw = await self._read(http)
        return JSONResponse(await self.work.run(http, lambda check: self._tokens(http, raw,
                                                                                 check)))

    def _tokens(self, http: HTTPRequest, raw: bytes, checkpoint: Checkpoint) -> dict[str, Any]:
        body = Obj(self._door(raw), "body")
        model = body.need("model", "string")
        served = self._served_name(http, model)
        pipe = served.pipe
        if body.has("messages"):
            chat = {"model": model, "messages": body.value["messages"],
                    **{k: body.value[k] for k in ("tools", "tool_choice") if body.has(k)}}
            parsed = openai_api.parse_chat(chat, self.defaults)
            add = body.get("add_generation_prompt", "boolean", True)
            body.done()
            request = attrs.evolve(parsed.request,
                                   template_kwargs={"add_generation_prompt": add})
            checkpoint()
            ids = pipe.tokenize(request).input_ids
        else:
            prompt = body.need("prompt", "string")
            body.done()
            tokenizer = pipe.stages.tokenizer
            assert tokenizer is not None
            ids = tuple(tokenizer.encode_text(prompt))
        return {"tokens": list(ids), "count": len(ids),
                "max_model_len": self.gateway.window_fit.window(served)}

    async def detokenize(self, http: HTTPRequest) -> Response:
        """``POST /detokenize``: ``{model, tokens}`` → text."""
        raw = await self._read(http)
        return JSONResponse(await self.work.run(http, lambda _: self._text(http, raw)))

    def _text(self, http: HTTPRequest, raw: bytes) -> dict[str, Any]:
        body = Obj(self._door(raw), "body")
        served = self._served_name(http, body.need("model", "string"))
        tokenizer = served.pipe.stages.tokenizer
        assert tokenizer is not None
        vocab, window = tokenizer.vocab_size, self.gateway.window_fit.window(served)
        tokens = body.need("tokens", "array")
        if len(tokens) > window:  # the answer grows with each id's text: bound it
            raise LimitExceededError("tokens", "max_model_len", len(tokens), window,
                                     "token ids")
        ids = []
        for path, token in body.items("tokens", required=True):
            check(path, token, "integer")
            if not 0 <= token < vocab:
                raise InvalidValueError(path, token, f"outside the vocabulary (size {vocab})")
            ids.append(token)
        body.done()
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    def _served_name(self, http: HTTPRequest, name: str) -> ServedModel:
        http.state.model = name
        return self.gateway.model(name)

    # --- listings and health -----------------------------------------------------------------

    async def models(self, http: HTTPRequest) -> Response:
        """``GET /v1/models``."""
        data = [self._model_object(name) for name in self.gateway.models]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, http: HTTPRequest) -> Response:
        """``GET /v1/models/{model}``: one served model (404 naming the served ones)."""
        name = http.path_params["model"]
        http.state.model = name
        if name not in self.gateway.models:
            raise ModelNotFoundError(name, self.gateway.models)
        return JSONResponse(self._model_object(name))

    def _model_object(self, name: str) -> dict[str, Any]:
        """OpenAI's model object, plus ``state``, and, once loaded, what the model is:
        ``display_name`` (its file or folder, which a served name such as ``default`` does
        not say) and ``description`` (architecture, parameters, dtype, device)."""
        served = self.gateway.models[name]
        state = ("restarting" if served.state is ModelState.READY and served.engine_failure
                 else served.state.value)
        pipe = served.pipeline
        info = pipe.model_info() if pipe is not None else None
        return {"id": name, "object": "model", "created": 0, "owned_by": "pipeline",
                "state": state, "display_name": display_name(pipe),
                "description": info.summary() if info is not None else None}

    async def health(self, http: HTTPRequest) -> Response:
        """``GET /health`` (no key needed): each model's state and, for what is down, a class
        of reason only (:func:`~transports.http.server.health.public_health`)."""
        body, code = public_health(self.gateway)
        return JSONResponse(body, code)

    async def health_details(self, http: HTTPRequest) -> Response:
        """``GET /health/details`` (behind the keys): the same with why each worker is down,
        and restart counts (:func:`~transports.http.server.health.operator_health`)."""
        body, code = operator_health(self.gateway)
        return JSONResponse(body, code)

    async def metrics(self, http: HTTPRequest) -> Response:
        """``GET /metrics`` in the Prometheus text format."""
        return Response(self.gateway.metrics.render(), media_type=CONTENT_TYPE)

    async def trace(self, http: HTTPRequest) -> Response:
        """``GET /traces/{request_id}``: a finished request's trace as JSONL, for a key that
        made it (404 for any other, as for an unknown or evicted id)."""
        request_id = http.path_params["request_id"]
        keys: frozenset[str] = http.state.keys
        body = await self.work.run(http, lambda _: self.gateway.traces.jsonl(request_id, keys))
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in request_id)
        return Response(body, media_type=JSONL, headers={
            "content-disposition": f'attachment; filename="{name}.jsonl"',
            "cache-control": "no-store"})

    async def chat_page(self, http: HTTPRequest) -> Response:
        """``GET /`` (and ``HEAD /``): the web chat page (no key needed)."""
        return Response(self.page.body, media_type=HTML, headers=self.page.headers)

    async def openapi(self, http: HTTPRequest) -> Response:
        """``GET /openapi.json``: this server's OpenAPI document (no key needed)."""
        return JSONResponse(openapi_document(list(self.gateway.models), self.limits.max_n))


def display_name(pipe: Pipeline | None) -> str | None:
    """What a loaded model is called where it came from: a GGUF file's name without
    ``.gguf`` (``SmolLM2-135M-Instruct.Q4_1``), a Hugging Face cache snapshot's repository
    (``org/name``), else its folder's name; None before it is loaded or when unknown."""
    where = pipe.description.get("model") if pipe is not None else None
    if not where:
        return None
    path = PurePath(str(where))
    if path.suffix.lower() == ".gguf":
        return path.stem
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def create_app(gateway: Gateway) -> Starlette:
    """The Starlette app serving ``gateway``'s models; closing the app closes the gateway."""
    s = Server(gateway)
    views = TraceViews(gateway, s.work)
    oa, an = Dialect.OPENAI, Dialect.ANTHROPIC
    routes = [
        Route("/v1/chat/completions", s.endpoint("chat.completions", oa, s.chat),
              methods=["POST"]),
        Route("/v1/completions", s.endpoint("completions", oa, s.completions),
              methods=["POST"]),
        Route("/v1/responses", s.endpoint("responses", oa, s.responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", s.endpoint("responses", oa, s.stored_response),
              methods=["GET"]),
        Route("/v1/responses/{response_id}", s.endpoint("responses", oa, s.delete_response),
              methods=["DELETE"]),
        Route("/v1/embeddings", s.endpoint("embeddings", oa, s.embeddings), methods=["POST"]),
        Route("/v1/messages", s.endpoint("messages", an, s.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", s.endpoint("count_tokens", an, s.count_tokens),
              methods=["POST"]),
        Route("/tokenize", s.endpoint("tokenize", oa, s.tokenize), methods=["POST"]),
        Route("/detokenize", s.endpoint("detokenize", oa, s.detokenize), methods=["POST"]),
        Route("/v1/models", s.endpoint("models", oa, s.models), methods=["GET"]),
        Route("/v1/models/{model}", s.endpoint("models", oa, s.model), methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/health/details", s.endpoint("health", oa, s.health_details), methods=["GET"]),
        Route("/metrics", s.metrics, methods=["GET"]),
        Route("/openapi.json", s.openapi, methods=["GET"]),
        Route("/traces/{request_id}", s.endpoint("traces", oa, s.trace), methods=["GET"]),
        Route("/traces/{request_id}/inspect", s.endpoint("traces", oa, views.inspect),
              methods=["GET"]),
        Route("/traces/{a}/diff/{b}", s.endpoint("traces", oa, views.diff), methods=["GET"]),
        Route("/web/{name}", asset_handler(s.page), methods=["GET"]),
        Route("/", s.chat_page, methods=["GET"]),  # Starlette adds HEAD to a GET route
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        s.work.close()
        await asyncio.to_thread(gateway.close)

    return Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(AccessLog)],
                     exception_handlers={404: _no_route, 405: _no_route})


async def _no_route(http: HTTPRequest, exc: Exception) -> Response:
    """404 and 405 for paths and methods no route serves, as JSON in the dialect's shape
    (``/v1/messages...`` is Anthropic's, everything else OpenAI's)."""
    dialect = Dialect.ANTHROPIC if http.url.path.startswith("/v1/messages") else Dialect.OPENAI
    status = int(getattr(exc, "status_code", 404))
    info = route_error(status, http.method, http.url.path)
    headers = dict(getattr(exc, "headers", None) or {})
    return JSONResponse(error_body(info, dialect), status, headers=headers)
