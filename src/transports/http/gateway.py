"""The gateway duties between an HTTP request and a pipeline (docs/design.md §12).

Owns :class:`Gateway`: API-key checks (constant time), the served models and their loading
state (503 while loading; each load and each failure logged as it happens), routing by name
(404 listing the served names), window arithmetic (a fast upper bound first, the exact count
only near the limit; clamp or refuse ``max_tokens``),
admission control (at most ``num_slots`` running and ``max_queue`` waiting per model, then
:class:`~pipeline.errors.OverloadedError`; :meth:`Gateway.retry_after`, when a refused client
should come back, from the model's pace and queue, or its engine's restart), the end of every request (its usage record
committed durably, or spilled for a retry after ``usage_wait_s`` at most; its admission place
given back, its metrics counted, its choices' traces kept for the keys that made it; a failed
one's error logged with its id, streamed or not, since the client only hears "internal server
error"), and supervision:
when a model's engine loop stops after an internal error, the model answers 503 (its queued
requests already failed) and a fresh engine replaces it ``restart_delay_s`` later. A
watchdog thread checks every engine's ``stall()``: a step in progress, or an engine process
unheard between steps (:class:`~pipeline.runtime.parent.Unresponsive`: frozen, or not taking
up its work), that has lasted longer than ``stall_timeout_s`` is abandoned
(:meth:`~pipeline.engine.api.EngineAPI.abandon`: its requests fail with a 503, the model is
``restarting``), and the fresh engine starts once the stuck step has returned (an engine
process is killed instead). :meth:`Gateway.problems` names every worker that is down (an
abandoned or dead engine, a usage store that cannot write) for ``/health``.

Keys: ``Authorization: Bearer KEY`` and ``x-api-key: KEY`` are both accepted. When a request
sends both (or repeats one), every value must be a valid key: a wrong one is a 401 naming the
header it came in (the one the client used: the OpenAI SDK sends ``Authorization``, the
Anthropic SDK ``Authorization`` or ``x-api-key`` by version and settings), never ignored
because another is right. An ``Authorization`` header of another scheme
is a 401. :meth:`Gateway.authenticate` returns the fingerprints of the keys a request sent;
a request's trace is readable with those keys only (:mod:`transports.http.traces`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import hmac
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import attrs

from backends.torch.native_memory import bound_native_caches, release_free_memory
from pipeline.builder import build
from pipeline.errors import (
    AuthenticationError, ContextWindowError, EngineClosed, InvalidValueError,
    ModelLoadingError, ModelNotFoundError, OverloadedError, PipelineError, StepStillRunning,
    failure_class,
)
from pipeline.engine.handle import RequestHandle
from pipeline.runtime.parent import ProcessEngine
from pipeline.runtime.wire import EngineRecipe
from pipeline.pipe import Pipeline
from pipeline.prepared import Prepared
from pipeline.sampling_defaults import sampling_summary
from pipeline.strategy_choice import StrategyChoice
from pipeline.types import Completion, Request
from transports.http import logs
from transports.http.admission import (
    LOADING_WAIT_S, RETRY_MIN_S, Pace, place_wait_s, queue_timed_out, restart_wait_s,
)
from transports.http.choices import Choices, total_usage
from transports.http.config import ServerConfig
from transports.http.work import Checkpoint
from transports.http.metrics import Metrics
from pipeline.output_parts import opens_thinking
from transports.http.traces import TraceStore, key_fingerprint
from transports.http.usage import UsageRecord, UsageStore

Builder = Callable[[Path | None, ServerConfig], Pipeline]
log = logging.getLogger("pipeline.serve")
UNMENDABLE = ("no fresh engine can replace it: start the server again (pipeline serve --ranks N "
              "supervises a group that restarts itself)")
"""What a model whose engine cannot be replaced (a ``torchrun`` group that lost a rank) tells
the log, ``/health/details`` and its clients."""


def default_builder(folder: Path | None, config: ServerConfig,
                    strategy: StrategyChoice | None = None) -> Pipeline:
    """``build()`` for a model (None: the default model) with the server's backend options
    and the model's ``strategy`` (None: its own); with ``config.engine_process`` the model
    and its scheduler run in a child process (:class:`~pipeline.runtime.parent.ProcessEngine`),
    with ``config.ranks`` above 1 rank 0 of a group of that many."""
    args = strategy.build_args() if strategy is not None else {}
    if config.engine_process or config.ranks > 1:  # the child caps its native caches
        recipe = EngineRecipe(folder, config.backend_options(), args,
                              setup=(bound_native_caches,), ranks=config.ranks)
        return ProcessEngine.start(recipe).pipeline()
    return build(folder, options=config.backend_options(), **args)


def token_upper_bound(text: str) -> int:
    """An upper bound on the token count of ``text`` by character class, without tokenizing.

    A byte-level BPE token covers at least one UTF-8 byte, so the count is at most the byte
    length: 1 per ASCII character, 2 below U+0800, 3 below U+10000, else 4. (A tokenizer with
    tokens that cover no input byte, like SentencePiece's dummy prefix, can exceed it by a few;
    the pipeline's own window check and the engine's context-full stop still hold then.)
    """
    return len(text.encode("utf-8", "surrogatepass"))


def _values(header: str | Sequence[str] | None) -> list[str]:
    """A header's values: none, one, or each of a repeated header."""
    if header is None:
        return []
    return [header] if isinstance(header, str) else list(header)


def _prompt_field(request: Request) -> str:
    """The body field a too-long prompt came from."""
    return "messages" if request.messages else "prompt"


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
        self.error_class = "load_failed"
        """What ``/health`` tells a stranger of ``error`` (:func:`~pipeline.errors.failure_class`
        when a stopped engine could not be replaced)."""
        self.inflight = 0
        self.lock = threading.Lock()
        self.pace = Pace()
        """How fast its requests end: the admission places it gives back per second."""
        self.start_s: float | None = None
        """How long its engine took to start last time (its load, then each restart)."""
        self.stopped_at: float | None = None
        """When (``time.monotonic``) its engine last stopped."""
        self.restarts = 0
        """Fresh engines started after the engine loop stopped."""
        self._token_chars: int | None = None

    def leave(self, flight: Flight) -> None:
        """Give ``flight``'s admission place back (once, whoever calls first)."""
        with self.lock:
            if flight.admitted:
                flight.admitted = False
                self.inflight -= 1

    @property
    def engine_failure(self) -> str | None:
        """Why the engine loop stopped, while no fresh engine has replaced it."""
        pipe = self.pipeline
        engine = pipe.engine if pipe is not None else None
        return engine.failure if engine is not None and not engine.alive else None

    @property
    def mendable(self) -> bool:
        """Whether a fresh engine can replace a stopped one: not over a backend that knows it
        cannot be used again (a parallel group under ``torchrun`` that lost a rank)."""
        engine = self.pipeline.engine if self.pipeline is not None else None
        return getattr(getattr(engine, "backend", None), "broken", None) is None

    @property
    def pipe(self) -> Pipeline:
        """The pipeline; raises :class:`ModelLoadingError` until it is ready, and while its
        stopped engine waits for a fresh one."""
        if self.pipeline is None or self.state is not ModelState.READY:
            raise ModelLoadingError(self.name, self.error)
        failure = self.engine_failure
        if failure is not None:
            raise ModelLoadingError(self.name, restarting=failure)
        return self.pipeline

    @property
    def token_chars(self) -> int:
        """The most characters one token of the vocabulary decodes to (computed once)."""
        if self._token_chars is None:
            assert self.pipeline is not None, "the model is loaded"
            tokenizer = self.pipeline.stages.tokenizer
            assert tokenizer is not None
            self._token_chars = max(
                (len(tokenizer.decode([i], skip_special_tokens=False))
                 for i in range(tokenizer.vocab_size)), default=1) or 1
        return self._token_chars

    @property
    def max_context(self) -> int:
        """The backend's window in tokens."""
        engine = self.pipe.engine
        assert engine is not None, "served pipelines have a backend"
        return engine.backend.max_context


@attrs.frozen
class Fitted:
    """A prepared request fitted to the window, and whether its prompt left a ``<think>``
    open."""

    prepared: Prepared
    thinking: bool

    @property
    def request(self) -> Request:
        """The fitted request."""
        return self.prepared.request


@attrs.define
class Flight:
    """A submitted request: its handle and a future resolved, on the server's event loop,
    with the completion once it is terminal and its usage record is durable."""

    handle: RequestHandle
    model: ServedModel
    request: Request
    done: asyncio.Future[Completion]
    admitted: bool = True
    """True while the flight holds one of its model's admission places."""

    def cancel(self) -> None:
        """Cancel the request and give its admission place back now: the engine ends it at
        its next step, but a client that left must not keep a newcomer out meanwhile."""
        self.handle.cancel()
        self.model.leave(self)


class Gateway:
    """Everything between a parsed HTTP request and a pipeline. Thread-safe.

    Each served model is built by :func:`default_builder` with its
    :meth:`ServerConfig.strategy`, unless ``builder`` is given: that builds every model its
    own way, so a config that also chooses strategies is refused.
    """

    def __init__(self, config: ServerConfig, builder: Builder | None = None) -> None:
        if builder is not None and config.strategies:
            raise InvalidValueError("strategies", sorted(config.strategies), "a gateway given "
                                    "its own builder builds each model as that builder says: "
                                    "choose the strategy there")
        self.config = config
        self._builder = builder
        self.models = {name: ServedModel(name, folder) for name, folder in config.models.items()}
        self.metrics = Metrics(self.pipelines, tuple(self.models))
        database = None
        if config.usage_database is not None:  # replicas sharing one store
            from transports.http.usage_postgres import PostgresUsage

            database = PostgresUsage(config.usage_database)
        self.usage = UsageStore(config.data_dir, database=database)
        self.metrics.watch_usage(self.usage.health)
        self.traces = TraceStore(config.keep_traces)
        self._loaders: list[threading.Thread] = []
        self._closed = threading.Event()
        self._lifecycle = threading.Lock()  # orders engine restarts against close()
        self.flights: dict[str, Flight] = {}
        """Requests admitted and not yet finished, by request id (for inspection)."""
        self._steps_seen: dict[str, int] = {}
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name="engine-watchdog")
        self._watchdog.start()

    # --- models ------------------------------------------------------------------------------

    def load(self, *, wait: bool = False, then: Callable[[], None] | None = None) -> None:
        """Load the models on a loader thread; requests get a 503 until theirs is ready.
        Each load and each failure is logged as it happens (:mod:`transports.http.logs`);
        ``then`` runs on the loader thread once every model is ready or failed.

        The loader thread stays parked until :meth:`close`: with GNU OpenMP, the worker
        threads of a thread that ran torch's parallel loading code and then exited keep
        spinning, which made decoding on the engine thread several times slower.
        """
        loaded = threading.Event()
        thread = threading.Thread(target=self._load_all, args=(loaded, then), daemon=True,
                                  name="model-loader")
        thread.start()
        self._loaders.append(thread)
        if wait:
            loaded.wait()

    def _load_all(self, loaded: threading.Event, then: Callable[[], None] | None) -> None:
        for served in self.models.values():
            self._load(served)
        loaded.set()
        if then is not None:
            then()
        self._closed.wait()

    def _load(self, served: ServedModel) -> None:
        source = str(served.folder) if served.folder is not None else "the default model"
        logs.model_loading(served.name, source, self.config.device)
        start = time.perf_counter()
        try:
            served.pipeline = (
                self._builder(served.folder, self.config) if self._builder is not None
                else default_builder(served.folder, self.config,
                                     self.config.strategy(served.name)))
            self._supervise(served)
            served.start_s = time.perf_counter() - start
            served.token_chars  # the prompt-size bound needs it; compute it before serving
            served.state = ModelState.READY
        except Exception as exc:  # reported as a 503 naming the failure
            served.error = logs.reason(exc)
            served.state = ModelState.FAILED
            logs.model_failed(served.name, exc)
            return
        pipe = served.pipe
        assert pipe.engine is not None, "served pipelines have a backend"
        logs.model_loaded(served.name, pipe.model_info(), time.perf_counter() - start,
                          self.window(served), pipe.engine.backend.num_slots,
                          pipe.description.get("strategy"), self.config.strategy(served.name))
        logs.model_sampling(served.name, sampling_summary(pipe.defaults), pipe.defaults_source)

    @property
    def failed(self) -> dict[str, str]:
        """Why each model that failed to load failed, by served name."""
        return {name: m.error or "unknown" for name, m in self.models.items()
                if m.state is ModelState.FAILED}

    # --- supervision -------------------------------------------------------------------------

    def _supervise(self, served: ServedModel) -> None:
        """Have ``served``'s engine report a stopped loop to :meth:`_engine_stopped`."""
        engine = served.pipeline.engine if served.pipeline is not None else None
        if engine is not None:
            engine.on_stop = lambda why: self._engine_stopped(served, why)

    def _engine_stopped(self, served: ServedModel, why: str) -> None:
        """On the dying engine thread: schedule a fresh engine (503 until it runs), or, when
        none can replace it (:attr:`ServedModel.mendable`), mark the model failed at once."""
        served.stopped_at = time.monotonic()
        if not served.mendable:
            served.error, served.error_class = f"{why}; {UNMENDABLE}", failure_class(why)
            served.state = ModelState.FAILED
            log.error("model %r: the engine loop stopped (%s); %s", served.name, why,
                      UNMENDABLE)
            return
        log.error("model %r: the engine loop stopped (%s); a fresh engine starts in %.1f s",
                  served.name, why, self.config.restart_delay_s)
        if self._closed.is_set():
            return
        timer = threading.Timer(self.config.restart_delay_s, self._restart, (served,))
        timer.daemon = True
        timer.start()

    def _watch(self) -> None:
        """The watchdog thread, until :meth:`close`: a few looks per ``stall_timeout_s`` (at
        least one a second) for stalls, and free memory handed back once the engines fall
        idle after work."""
        limit = self.config.stall_timeout_s
        while not self._closed.wait(min(limit / 4, 1.0) if limit is not None else 1.0):
            try:
                self.check_stalls()
                if self.config.release_idle_memory and self._fell_idle():
                    release_free_memory()
                    self._release_in_children()
            except Exception:  # the watchdog must outlive a bug in one look
                log.exception("the engine watchdog's check failed")

    def _release_in_children(self) -> None:
        """Have each engine process hand its free pages back too (on its engine thread,
        between steps; its answer is not waited for)."""
        for served in self.models.values():
            engine = served.pipeline.engine if served.pipeline is not None else None
            if isinstance(engine, ProcessEngine) and engine.alive:
                with contextlib.suppress(PipelineError):  # stopped or busy: next time
                    engine.call(release_free_memory)

    def _fell_idle(self) -> bool:
        """True when every engine is idle and some stepped since the last look that was."""
        engines = {name: m.pipeline.engine for name, m in self.models.items()
                   if m.pipeline is not None and m.pipeline.engine is not None}
        if any(e.active_slots or e.queue_depth for e in engines.values()):
            return False
        steps = {name: e.steps for name, e in engines.items()}
        moved = steps != self._steps_seen
        self._steps_seen = steps
        return moved

    def check_stalls(self) -> list[str]:
        """Abandon every engine whose stall (a step in progress, an engine process gone
        quiet) has lasted past ``stall_timeout_s``; returns the served names abandoned (the
        watchdog calls this; so may a test)."""
        limit, abandoned = self.config.stall_timeout_s, []
        for served in self.models.values():
            engine = served.pipeline.engine if served.pipeline is not None else None
            stall = engine.stall() if engine is not None and engine.alive else None
            if engine is None or stall is None or limit is None or stall.running_s <= limit:
                continue
            log.error("model %r: the engine stalled: %s (limit %.1f s); its requests fail and "
                      "a fresh engine starts once the old one lets go", served.name,
                      stall.describe_for_log(), limit)
            engine.abandon(f"stalled: {stall.describe()}")
            abandoned.append(served.name)
        return abandoned

    def problems(self) -> dict[str, str]:
        """What is down now, by worker (``engine:<model>``, ``usage_store``), with why."""
        down = {f"engine:{name}": failure for name, m in self.models.items()
                if m.state is ModelState.READY and (failure := m.engine_failure) is not None}
        usage = self.usage.health()
        if usage.down is not None:
            down["usage_store"] = (f"{usage.down} (for {usage.down_for_s:.1f} s; "
                                   f"{usage.spill_depth} records waiting, retried)")
        return down

    def _restart(self, served: ServedModel) -> None:
        with self._lifecycle:  # never after close(): a fresh engine nobody would close
            if self._closed.is_set() or served.pipeline is None:
                return
            try:
                start = time.perf_counter()
                served.pipeline.restart_engine()
                served.start_s = time.perf_counter() - start
            except StepStillRunning as exc:  # a stalled step holds the backend: wait for it
                log.warning("model %r: %s; trying again in %.1f s", served.name, exc,
                            max(self.config.restart_delay_s, 1.0))
                timer = threading.Timer(max(self.config.restart_delay_s, 1.0), self._restart,
                                        (served,))
                timer.daemon = True
                timer.start()
                return
            except Exception as exc:
                served.error = f"restarting the engine failed: {exc!r}"
                served.state = ModelState.FAILED
                log.exception("model %r: restarting the engine failed", served.name)
                return
        served.restarts += 1
        log.warning("model %r: a fresh engine is running (restart %d)", served.name,
                    served.restarts)

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
        """True when every model is loaded, its engine runs, and usage records are written."""
        return (all(m.state is ModelState.READY and m.engine_failure is None
                    for m in self.models.values())
                and self.usage.health().down is None)

    # --- keys --------------------------------------------------------------------------------

    def authenticate(self, authorization: str | Sequence[str] | None,
                     api_key: str | Sequence[str] | None) -> frozenset[str]:
        """Accept the request's keys or raise; returns their fingerprints (empty when the
        server has no keys). Each header may be given once or repeated (a sequence of its
        values): every value sent must be a valid key."""
        if not self.config.api_keys:
            return frozenset()
        sent: list[tuple[str, str]] = []
        for value in _values(authorization):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer":
                raise AuthenticationError("Authorization header: only the Bearer scheme is "
                                          "accepted (Authorization: Bearer <key>)")
            sent.append(("Authorization", token.strip()))
        sent.extend(("x-api-key", value.strip()) for value in _values(api_key))
        if not any(key for _, key in sent):
            raise AuthenticationError("missing API key: send Authorization: Bearer <key> "
                                      "or x-api-key")
        wrong = list(dict.fromkeys(h for h, given in sent if not self._valid(given)))
        if wrong:  # every key sent must be valid: say which header (the client's) held one
            where = " and ".join(wrong)
            raise AuthenticationError(f"invalid API key in the {where} header"
                                      f"{'s' * (len(wrong) > 1)}: it is not one of this "
                                      "server's keys")
        return frozenset(key_fingerprint(key) for _, key in sent if key)

    def _valid(self, given: str) -> bool:
        match = False
        for key in self.config.api_keys:  # compare with all, in constant time each
            match |= hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())
        return match

    # --- window arithmetic -------------------------------------------------------------------

    def window(self, served: ServedModel) -> int:
        """The tokens a request may use: the model's window, capped by ``max_context``, less
        ``context_slack``."""
        limit = min(served.max_context, self.config.max_context or served.max_context)
        return limit - self.config.context_slack

    def fit(self, served: ServedModel, request: Request | Prepared, *, max_tokens_given: bool,
            checkpoint: Checkpoint | None = None, budget_field: str = "max_tokens") -> Fitted:
        """``request``, prepared (rendered once, :meth:`~pipeline.pipe.Pipeline.prepare`),
        with ``max_tokens`` fitted to the room the prompt leaves.

        ``room = window - slack - prompt_tokens``. When the character-class bound plus
        ``max_tokens`` fits, the prompt is not counted here at all (a token-id prompt is
        counted by its length). A prompt with more
        characters than ``window`` tokens of the longest token could cover is refused before
        tokenizing. ``checkpoint`` is called between the render and the count. A refused
        budget is named ``budget_field``, the body's name for it. The tokens counted here
        are the ones submitted: the prompt is tokenized at most once.
        """
        prepared = request if isinstance(request, Prepared) else served.pipe.prepare(request)
        request = prepared.request
        window = self.window(served)
        limits = request.runtime_limits
        prepared = prepared.with_request(attrs.evolve(request, runtime_limits=attrs.evolve(
            limits, max_context_tokens=window,
            deadline_s=limits.deadline_s or self.config.request_deadline_s,
            queue_timeout_s=limits.queue_timeout_s or self.config.max_queue_wait_s)))
        if request.prompt_ids is not None:  # counted already: its length
            return self._fit_count(prepared, len(request.prompt_ids), window, False,
                                   max_tokens_given, budget_field)
        text = prepared.rendered.text
        thinking = opens_thinking(text)
        if token_upper_bound(text) + request.generation_config.max_tokens <= window:
            return self._guard_thinking(served, Fitted(prepared, thinking))
        self.refuse_longer(served, text, _prompt_field(request))
        if checkpoint is not None:
            checkpoint()
        return self._guard_thinking(served, self._fit_count(
            prepared, len(prepared.tokens), window, thinking, max_tokens_given, budget_field))

    def _guard_thinking(self, served: ServedModel, fitted: Fitted) -> Fitted:
        """The thinking guard (:class:`ServerConfig`): a request with no thinking preference
        and no budget gets a reasoning budget that leaves its answer
        ``min(answer_reserve_tokens, max_tokens // 3)`` tokens after the two think markers,
        when the model has think markers and its strategy keeps a budget."""
        request = fitted.request
        config = request.generation_config
        engine = served.pipe.engine
        if (config.reasoning_budget_tokens is not None or "enable_thinking" in
                request.template_kwargs or engine is None or served.pipe.think_markers() is None
                or not engine.strategy(config.processor_order).honours.reasoning_budget):
            return fitted
        reserve = min(self.config.answer_reserve_tokens, config.max_tokens // 3)
        budget = max(0, config.max_tokens - reserve - 2)  # <think> and </think> count too
        guarded = attrs.evolve(config, reasoning_budget_tokens=budget)
        return Fitted(fitted.prepared.with_request(attrs.evolve(
            request, generation_config=guarded)), fitted.thinking)

    def refuse_longer(self, served: ServedModel, text: str, field: str) -> None:
        """Refuse ``text`` without tokenizing it when it has more characters than the window's
        tokens could cover even at the vocabulary's longest token."""
        window = self.window(served)
        at_least = math.ceil(len(text) / served.token_chars)
        if at_least > window - 1:
            raise ContextWindowError(field, at_least, window - 1, lower_bound=True)

    def _fit_count(self, prepared: Prepared, prompt_tokens: int, window: int, thinking: bool,
                   max_tokens_given: bool, budget_field: str) -> Fitted:
        """:meth:`fit` once the prompt's exact length is known."""
        request = prepared.request
        config = request.generation_config
        if prompt_tokens > window - 1:
            raise ContextWindowError(_prompt_field(request), prompt_tokens, window - 1)
        room = window - prompt_tokens
        if config.max_tokens <= room:
            return Fitted(prepared, thinking)
        if max_tokens_given and not self.config.clamp_max_tokens:
            raise ContextWindowError(budget_field, prompt_tokens, room, config.max_tokens)
        fitted = attrs.evolve(config, max_tokens=room, min_tokens=min(config.min_tokens, room))
        return Fitted(prepared.with_request(attrs.evolve(request, generation_config=fitted)),
                      thinking)

    # --- admission and the end of a request ------------------------------------------------

    @property
    def capacity(self) -> int:
        """Requests one model may hold, running or queued: ``num_slots + max_queue``."""
        return self.config.num_slots + self.config.max_queue

    def precheck(self, names: Collection[str]) -> None:
        """Refuse a generation request before its body is parsed and its prompt rendered,
        when every name in ``names`` (what its raw body may give as ``model``:
        :func:`~transports.http.admission.peek_models`) is a served model holding
        :attr:`capacity` requests. Cheap (no lock: a count read a moment early only refuses
        what :meth:`submit` would refuse a moment later); :meth:`submit` still decides
        exactly. An empty ``names``, or one naming a model with room or no served model,
        passes. (A model loading or restarting is refused after parsing, as before: that
        costs no render.)"""
        full = [self.models[name] for name in names if name in self.models
                and self.models[name].inflight >= self.capacity]
        if full and len(full) == len(names):
            raise self._full(full[0])

    def _full(self, served: ServedModel) -> OverloadedError:
        return OverloadedError(f"model {served.name!r} is at capacity ({self.capacity} "
                               "requests running or queued); retry later")

    def retry_after(self, exc: BaseException, model: str | None) -> float | None:
        """Seconds a client refused with ``exc`` should wait before it sends again, or None
        when waiting would not help (a model that failed, an engine nothing can replace, no
        refusal at all); ``model`` is the served name the request gave, if known. Cheap: a
        few reads, no lock.

        * over capacity, or a queue wait over its bound:
          :func:`~transports.http.admission.place_wait_s` from the model's pace and the
          requests waiting ahead (a model not known here: the shortest wait);
        * a model loading for the first time:
          :data:`~transports.http.admission.LOADING_WAIT_S`;
        * an engine restarting (refused, or a request its stop ended):
          :func:`~transports.http.admission.restart_wait_s`, what is left of
          ``restart_delay_s`` plus how long starting its engine took last time.
        """
        if isinstance(exc, ModelLoadingError):
            model = exc.model
        served = self.models.get(model) if model is not None else None
        if isinstance(exc, OverloadedError):
            if served is None:
                return RETRY_MIN_S
            ahead = max(served.inflight - self.config.num_slots, 0) + 1
            return place_wait_s(ahead, served.pace.rate())
        if isinstance(exc, ModelLoadingError) and exc.failed:
            return None
        if isinstance(exc, ModelLoadingError) and not exc.restarting:
            return LOADING_WAIT_S
        if isinstance(exc, (ModelLoadingError, EngineClosed)):
            if served is None or not served.mendable or served.state is ModelState.FAILED:
                return None
            since = (time.monotonic() - served.stopped_at if served.stopped_at is not None
                     else 0.0)
            return restart_wait_s(self.config.restart_delay_s, since, served.start_s)
        return None

    def submit(self, served: ServedModel, requests: Sequence[Prepared], endpoint: str,
               loop: asyncio.AbstractEventLoop, *, record_id: str, n: int = 1,
               owners: frozenset[str] = frozenset()) -> list[Flight]:
        """Admit and start ``requests``, the choices of one HTTP request (``n`` per prompt),
        all or none, one after the other without waiting, so the engine batches them. Call
        off the event loop: submitting tokenizes a prompt not yet counted. Their usage is one record,
        ``record_id`` (:func:`~transports.http.choices.total_usage`), and their traces are
        kept together under it, readable with the keys whose fingerprints are ``owners``
        (:meth:`~transports.http.traces.TraceStore.add_choices`); every flight's ``done``
        resolves once the record is durable and the traces are kept."""
        count = len(requests)
        with served.lock:
            if served.inflight + count > self.capacity:
                raise self._full(served)
            served.inflight += count
        flights: list[Flight] = []
        choices = Choices(count, lambda done: self._record(served, endpoint, record_id, n,
                                                           done, loop, flights, owners))
        try:
            for index, prepared in enumerate(requests):
                handle = served.pipe.submit(prepared)
                request = prepared.request
                flight = Flight(handle, served, request, loop.create_future())
                flights.append(flight)
                self.flights[request.request_id] = flight
                handle.add_done_callback(functools.partial(self._finished, served,
                                                           choices=choices, index=index))
        except BaseException:
            for _ in range(count - len(flights)):
                self._leave(served)
            for started in flights:
                started.handle.cancel()
            choices.started(len(flights))
            raise
        return flights

    def _leave(self, served: ServedModel) -> None:
        with served.lock:
            served.inflight -= 1

    def _finished(self, served: ServedModel, completion: Completion, choices: Choices,
                  index: int) -> None:
        """On the engine thread: free the admission place and count; the last choice to
        finish keeps the request's traces and writes its usage record."""
        flight = self.flights.pop(completion.request_id, None)
        if flight is not None:
            served.leave(flight)
        else:  # not registered: submit failed half-way and gave the places back itself
            self._leave(served)
        served.pace.tick()
        self.metrics.finished(served.name, completion.usage, completion.timings.first_token_s)
        choices.add(index, completion)

    def _record(self, served: ServedModel, endpoint: str, record_id: str, n: int,
                completions: list[Completion], loop: asyncio.AbstractEventLoop,
                flights: list[Flight], owners: frozenset[str]) -> None:
        """Keep the choices' traces (before any response can end), record the request's usage
        durably, then resolve each flight's ``done``."""
        self.traces.add_choices(record_id, owners,
                                [(c.request_id, c.trace) for c in completions])

        def resolve() -> None:
            for flight, completion in zip(flights, completions):
                if not flight.done.done():
                    flight.done.set_result(completion)

        def bounded() -> None:  # on the event loop: the store gets usage_wait_s at most
            loop.call_later(self.config.usage_wait_s, resolve)

        def done(_durable: bool) -> None:  # durable or spilled: the response may end now
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                loop.call_soon_threadsafe(resolve)

        record = UsageRecord.of_choices(record_id, completions, total_usage(completions, n),
                                        served.name, endpoint, owners)
        # the client is told "internal error"; the log says what (a queue timeout is a
        # refusal the client is told of, which the app's summary of refusals counts)
        if record.error is not None and not queue_timed_out(record.error):
            log.error("request %s to model %r failed: %s", record_id, served.name,
                      record.error)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(bounded)
        self.usage.append(record, done)

    def close(self) -> None:
        """Stop every engine (cancelling what runs), then flush the usage store."""
        with self._lifecycle:
            self._closed.set()
        for served in self.models.values():
            if served.pipeline is not None:
                served.pipeline.close()
        self.usage.close()
        self.traces.close()
