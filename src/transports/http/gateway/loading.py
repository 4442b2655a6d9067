"""Loading the served models: each built on a loader thread, each load and failure logged.

Owns :func:`default_builder` (``build()`` with the server's backend options and the model's
strategy, or a child engine process) and :class:`Loader`; requests get a 503 until their
model is ready.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pipeline.builder import build
from pipeline.runtime.parent import ProcessEngine
from pipeline.runtime.wire import EngineRecipe
from pipeline.pipe import Pipeline
from pipeline.process_memory import bound_native_caches
from pipeline.sampling_defaults import sampling_summary
from pipeline.strategy_choice import StrategyChoice
from transports.http.accounting import logs
from transports.http.gateway.fit import WindowFit
from transports.http.gateway.models import ModelState, ServedModel
from transports.http.gateway.supervision import Supervisor
from transports.http.server.config import ServerConfig

Builder = Callable[[Path | None, ServerConfig], Pipeline]


def default_builder(folder: Path | None, config: ServerConfig,
                    strategy: StrategyChoice | None = None) -> Pipeline:
    """``build()`` for a model (None: the default model) with the server's backend options
    and backend, and the model's ``strategy`` (None: its own); with ``config.engine_process`` the model
    and its scheduler run in a child process (:class:`~pipeline.runtime.parent.ProcessEngine`),
    with ``config.ranks`` above 1 rank 0 of a group of that many."""
    args = strategy.build_args() if strategy is not None else {}
    if config.backend is not None:
        args["backend"] = config.backend
    if config.engine_process or config.ranks > 1:  # the child caps its native caches
        recipe = EngineRecipe(folder, config.backend_options(), args,
                              setup=(bound_native_caches,), ranks=config.ranks)
        return ProcessEngine.start(recipe).pipeline()
    return build(folder, options=config.backend_options(), **args)


class Loader:
    """Loads the served models, with ``builder`` or :func:`default_builder`."""

    def __init__(self, config: ServerConfig, models: Mapping[str, ServedModel],
                 builder: Builder | None, supervisor: Supervisor,
                 window_fit: WindowFit) -> None:
        self.config = config
        self.models = models
        self._builder = builder
        self.supervisor = supervisor
        self.window_fit = window_fit
        self._loaders: list[threading.Thread] = []

    def load(self, *, wait: bool = False, then: Callable[[], None] | None = None) -> None:
        """Load the models on a loader thread; requests get a 503 until theirs is ready.
        Each load and each failure is logged as it happens (:mod:`transports.http.accounting.logs`);
        ``then`` runs on the loader thread once every model is ready or failed.

        The loader thread stays parked until the supervisor stops: with GNU OpenMP, the worker
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
        self.supervisor.closed.wait()

    def _load(self, served: ServedModel) -> None:
        source = str(served.folder) if served.folder is not None else "the default model"
        logs.model_loading(served.name, source, self.config.device)
        start = time.perf_counter()
        try:
            served.pipeline = (
                self._builder(served.folder, self.config) if self._builder is not None
                else default_builder(served.folder, self.config,
                                     self.config.strategy(served.name)))
            self.supervisor.supervise(served)
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
                          self.window_fit.window(served), pipe.engine.backend.num_slots,
                          pipe.description.get("strategy"), self.config.strategy(served.name))
        logs.model_sampling(served.name, sampling_summary(pipe.defaults), pipe.defaults_source)
