"""The served models: where each is in its life, and the requests it holds.

Owns :class:`ModelState`, :class:`ServedModel` (one served model: its pipeline once loaded, its
admission counter and pace, its engine's failure and restarts, the window and token figures
the fit reads) and :class:`Flight` (one submitted request: its handle, and a future resolved
once its completion is terminal and its usage record durable).
"""

from __future__ import annotations

import asyncio
import enum
import threading
from pathlib import Path

import attrs

from pipeline.engine.handle import RequestHandle
from transports.http.serving_errors import ModelLoadingError
from pipeline.pipe import Pipeline
from pipeline.contracts.output import Completion
from pipeline.contracts.request import Request
from transports.http.gateway.door import Pace

UNMENDABLE = ("no fresh engine can replace it: start the server again (pipeline serve --ranks N "
              "supervises a group that restarts itself)")
"""What a model whose engine cannot be replaced (a ``torchrun`` group that lost a rank) tells
the log, ``/health/details`` and its clients."""


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
        """What ``/health`` tells a stranger of ``error`` (:func:`~transports.http.serving_errors.failure_class`
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

