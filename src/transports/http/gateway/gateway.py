"""The gateway duties between an HTTP request and a pipeline (docs/design.md §12).

Owns :class:`Gateway`, which holds the served models (:mod:`~transports.http.gateway.models`,
routed by name: 404 listing the served names, 503 while loading) and the collaborators that
do each duty: :class:`~transports.http.gateway.keys.Keys` (API keys),
:class:`~transports.http.gateway.loading.Loader` (loading, each load and failure logged),
:class:`~transports.http.gateway.supervision.Supervisor` (restarts, stalls, idle memory),
:class:`~transports.http.gateway.fit.WindowFit` (the window fit and thinking guard),
:class:`~transports.http.gateway.admission.Admission` (capacity, retry waits, the end of every
request); and the stores they share: usage, metrics, kept traces. :meth:`Gateway.problems`
names every worker that is down (an abandoned or dead engine, a usage store that cannot write)
for ``/health``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.errors import InvalidValueError
from transports.http.serving_errors import ModelNotFoundError
from pipeline.pipe import Pipeline
from transports.http.accounting.metrics import Metrics
from transports.http.accounting.traces import TraceStore
from transports.http.accounting.usage import UsageStore
from transports.http.gateway.admission import Admission
from transports.http.gateway.fit import WindowFit
from transports.http.gateway.keys import Keys
from transports.http.gateway.loading import Builder, Loader
from transports.http.gateway.models import ModelState, ServedModel
from transports.http.gateway.supervision import Supervisor
from transports.http.server.config import ServerConfig


class Gateway:
    """Everything between a parsed HTTP request and a pipeline. Thread-safe.

    Each served model is built by :func:`~transports.http.gateway.loading.default_builder`
    with its :meth:`ServerConfig.strategy`, unless ``builder`` is given: that builds every
    model its own way, so a config that also chooses strategies is refused.
    """

    def __init__(self, config: ServerConfig, builder: Builder | None = None) -> None:
        if builder is not None and config.strategies:
            raise InvalidValueError("strategies", sorted(config.strategies), "a gateway given "
                                    "its own builder builds each model as that builder says: "
                                    "choose the strategy there")
        self.config = config
        self.models = {name: ServedModel(name, folder) for name, folder in config.models.items()}
        self.metrics = Metrics(self.pipelines, tuple(self.models))
        database = None
        if config.usage_database is not None:  # replicas sharing one store
            from transports.http.accounting.usage_postgres import PostgresUsage

            database = PostgresUsage(config.usage_database)
        self.usage = UsageStore(config.data_dir, database=database)
        self.metrics.watch_usage(self.usage.health)
        self.traces = TraceStore(config.keep_traces)
        self.keys = Keys(config.api_keys)
        self.window_fit = WindowFit(config)
        self.admission = Admission(config, self.models, self.metrics, self.usage, self.traces)
        self.supervisor = Supervisor(config, self.models)
        self.loader = Loader(config, self.models, builder, self.supervisor, self.window_fit)

    @property
    def failed(self) -> dict[str, str]:
        """Why each model that failed to load failed, by served name."""
        return {name: m.error or "unknown" for name, m in self.models.items()
                if m.state is ModelState.FAILED}

    def problems(self) -> dict[str, str]:
        """What is down now, by worker (``engine:<model>``, ``usage_store``), with why."""
        down = {f"engine:{name}": failure for name, m in self.models.items()
                if m.state is ModelState.READY and (failure := m.engine_failure) is not None}
        usage = self.usage.health()
        if usage.down is not None:
            down["usage_store"] = (f"{usage.down} (for {usage.down_for_s:.1f} s; "
                                   f"{usage.spill_depth} records waiting, retried)")
        return down

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

    def close(self) -> None:
        """Stop every engine (cancelling what runs), then flush the usage store."""
        self.supervisor.stop()
        for served in self.models.values():
            if served.pipeline is not None:
                served.pipeline.close()
        self.usage.close()
        self.traces.close()
