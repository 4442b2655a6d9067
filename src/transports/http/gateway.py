"""The gateway duties between an HTTP request and a pipeline (DESIGN §12).

Owns :class:`Gateway`: API-key checks (constant time), the served models and their loading
state (503 while loading), routing by name (404 listing the served names), window arithmetic
(a fast upper bound first, the exact count only near the limit; clamp or refuse ``max_tokens``),
admission control (at most ``num_slots`` running and ``max_queue`` waiting per model, then
:class:`~pipeline.errors.OverloadedError`), and the end of every request: its usage record
committed durably, its admission place given back, its metrics counted.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from pipeline.builder import build
from pipeline.errors import (
    AuthenticationError, ContextWindowError, ModelLoadingError, ModelNotFoundError,
    OverloadedError,
)
from pipeline.handle import RequestHandle
from pipeline.pipe import Pipeline
from pipeline.types import Completion, Request
from transports.http.config import ServerConfig
from transports.http.metrics import Metrics
from transports.http.output import opens_thinking
from transports.http.usage import UsageRecord, UsageStore

Builder = Callable[[Path | None, ServerConfig], Pipeline]


def default_builder(folder: Path | None, config: ServerConfig) -> Pipeline:
    """``build()`` for a folder (None: the embedded model) with the server's slot count."""
    options: dict[str, object] = {"num_slots": config.num_slots}
    if config.max_context is not None:
        options["max_context"] = config.max_context
    return build(folder, options=options)


def token_upper_bound(text: str) -> int:
    """An upper bound on the token count of ``text`` by character class, without tokenizing.

    A byte-level BPE token covers at least one UTF-8 byte, so the count is at most the byte
    length: 1 per ASCII character, 2 below U+0800, 3 below U+10000, else 4. (A tokenizer with
    tokens that cover no input byte, like SentencePiece's dummy prefix, can exceed it by a few;
    the pipeline's own window check and the engine's context-full stop still hold then.)
    """
    return len(text.encode("utf-8", "surrogatepass"))


class ModelState(enum.Enum):
    """Where a served model is in its life."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


class ServedModel:
    """One served model: its pipeline once loaded, and its admission counter."""

    def __init__(self, name: str, folder: Path | None) -> None:
        self.name = name
        self.folder = folder
        self.state = ModelState.LOADING
        self.pipeline: Pipeline | None = None
        self.error: str | None = None
        self.inflight = 0
        self.lock = threading.Lock()

    @property
    def pipe(self) -> Pipeline:
        """The pipeline; raises :class:`ModelLoadingError` until it is ready."""
        if self.pipeline is None or self.state is not ModelState.READY:
            raise ModelLoadingError(self.name, self.error)
        return self.pipeline

    @property
    def max_context(self) -> int:
        """The backend's window in tokens."""
        engine = self.pipe.engine
        assert engine is not None, "served pipelines have a backend"
        return engine.backend.max_context


@attrs.frozen
class Fitted:
    """A request fitted to the window, and whether its prompt left a ``<think>`` open."""

    request: Request
    thinking: bool


@attrs.define
class Flight:
    """A submitted request: its handle and a future resolved, on the server's event loop,
    with the completion once it is terminal and its usage record is durable."""

    handle: RequestHandle
    model: ServedModel
    request: Request
    done: asyncio.Future[Completion]


class Gateway:
    """Everything between a parsed HTTP request and a pipeline. Thread-safe."""

    def __init__(self, config: ServerConfig, builder: Builder = default_builder) -> None:
        self.config = config
        self._builder = builder
        self.models = {name: ServedModel(name, folder) for name, folder in config.models.items()}
        self.metrics = Metrics(self.pipelines)
        self.usage = UsageStore(config.data_dir)
        self._loaders: list[threading.Thread] = []
        self._closed = threading.Event()
        self.flights: dict[str, Flight] = {}
        """Requests admitted and not yet finished, by request id (for inspection)."""

    # --- models ------------------------------------------------------------------------------

    def load(self, *, wait: bool = False) -> None:
        """Load the models on a loader thread; requests get a 503 until theirs is ready.

        The loader thread stays parked until :meth:`close`: with GNU OpenMP, the worker
        threads of a thread that ran torch's parallel loading code and then exited keep
        spinning, which made decoding on the engine thread several times slower.
        """
        loaded = threading.Event()
        thread = threading.Thread(target=self._load_all, args=(loaded,), daemon=True,
                                  name="model-loader")
        thread.start()
        self._loaders.append(thread)
        if wait:
            loaded.wait()

    def _load_all(self, loaded: threading.Event) -> None:
        for served in self.models.values():
            try:
                served.pipeline = self._builder(served.folder, self.config)
                served.state = ModelState.READY
            except Exception as exc:  # reported as a 503 naming the failure
                served.error = repr(exc)
                served.state = ModelState.FAILED
        loaded.set()
        self._closed.wait()

    def pipelines(self) -> Mapping[str, Pipeline]:
        """The loaded pipelines by served name."""
        return {n: m.pipeline for n, m in self.models.items()
                if m.pipeline is not None and m.state is ModelState.READY}

    def model(self, name: str) -> ServedModel:
        """The served model called ``name`` (404 if none; 503 while loading)."""
        served = self.models.get(name)
        if served is None:
            raise ModelNotFoundError(name, self.models)
        served.pipe  # raises ModelLoadingError unless ready
        return served

    @property
    def ready(self) -> bool:
        """True when every model is loaded."""
        return all(m.state is ModelState.READY for m in self.models.values())

    # --- keys --------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None, api_key: str | None) -> None:
        """Accept the request's key (``Authorization: Bearer`` or ``x-api-key``) or raise."""
        if not self.config.api_keys:
            return
        given = api_key
        if given is None and authorization is not None:
            scheme, _, token = authorization.partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
        if not given:
            raise AuthenticationError("missing API key: send Authorization: Bearer <key> "
                                      "or x-api-key")
        match = False
        for key in self.config.api_keys:  # compare with all, in constant time each
            match |= hmac.compare_digest(given.encode(), key.encode())
        if not match:
            raise AuthenticationError("invalid API key")

    # --- window arithmetic -------------------------------------------------------------------

    def window(self, served: ServedModel) -> int:
        """The tokens a request may use: the model's window, capped by ``max_context``, less
        ``context_slack``."""
        limit = min(served.max_context, self.config.max_context or served.max_context)
        return limit - self.config.context_slack

    def fit(self, served: ServedModel, request: Request, *, max_tokens_given: bool) -> Fitted:
        """``request`` with ``max_tokens`` fitted to the room the prompt leaves.

        ``room = window - slack - prompt_tokens``. When the character-class bound plus
        ``max_tokens`` fits, the prompt is not counted here at all.
        """
        pipe, config = served.pipe, request.generation_config
        window = self.window(served)
        request = attrs.evolve(request, runtime_limits=attrs.evolve(
            request.runtime_limits, max_context_tokens=window))
        if request.prompt is not None:
            text = request.prompt
        else:
            text = pipe.render(request.messages, tools=request.tool_catalog,
                               **request.template_kwargs).text
        thinking = opens_thinking(text)
        if token_upper_bound(text) + config.max_tokens <= window:
            return Fitted(request, thinking)
        prompt_tokens = pipe.count_tokens(request)
        if prompt_tokens > window - 1:
            raise ContextWindowError("messages", prompt_tokens, window - 1)
        room = window - prompt_tokens
        if config.max_tokens <= room:
            return Fitted(request, thinking)
        if max_tokens_given and not self.config.clamp_max_tokens:
            raise ContextWindowError("max_tokens", prompt_tokens, room, config.max_tokens)
        fitted = attrs.evolve(config, max_tokens=room, min_tokens=min(config.min_tokens, room))
        return Fitted(attrs.evolve(request, generation_config=fitted), thinking)

    # --- admission and the end of a request ------------------------------------------------

    def submit(self, served: ServedModel, request: Request, endpoint: str,
               loop: asyncio.AbstractEventLoop) -> Flight:
        """Admit and start ``request`` (call off the event loop: it renders and tokenizes)."""
        limit = self.config.num_slots + self.config.max_queue
        with served.lock:
            if served.inflight >= limit:
                raise OverloadedError(f"model {served.name!r} is at capacity ({limit} requests "
                                      "running or queued); retry later")
            served.inflight += 1
        try:
            handle = served.pipe.submit(request)
        except BaseException:
            self._leave(served)
            raise
        done: asyncio.Future[Completion] = loop.create_future()
        flight = self.flights[request.request_id] = Flight(handle, served, request, done)
        handle.add_done_callback(lambda c: self._finished(served, endpoint, c, loop, done))
        return flight

    def _leave(self, served: ServedModel) -> None:
        with served.lock:
            served.inflight -= 1

    def _finished(self, served: ServedModel, endpoint: str, completion: Completion,
                  loop: asyncio.AbstractEventLoop, done: asyncio.Future[Completion]) -> None:
        """On the engine thread: free the admission place, count, and record durably."""
        self._leave(served)
        self.flights.pop(completion.request_id, None)
        self.metrics.finished(served.name, completion.usage.prompt_tokens,
                              completion.usage.completion_tokens, completion.timings.first_token_s)

        def resolve() -> None:
            if not done.done():
                done.set_result(completion)

        def durable() -> None:
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is gone: nobody waits any more
                pass

        self.usage.append(UsageRecord.of(completion, served.name, endpoint), durable)

    def close(self) -> None:
        """Stop every engine (cancelling what runs), then flush the usage store."""
        self._closed.set()
        for served in self.models.values():
            if served.pipeline is not None:
                served.pipeline.close()
        self.usage.close()
