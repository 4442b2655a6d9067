"""Prometheus metrics of the HTTP server, on a registry of its own (no process globals).

Owns :class:`Metrics`: request counts by model, endpoint and status; prompt and completion
token counts; the prefix cache's hits (generations that reused cached blocks, and the prompt
tokens read from the cache, a part of the prompt count); time-to-first-token and inter-token
latency histograms; gauges of active slots and queue depth read from the engines at
scrape time; and the usage store's state (records made durable, spilled for a retry, dropped
from a full spill; the spill's depth; whether the writer is up). Labels come from bounded sets:
a ``model`` label is a served name or ``other`` (a client choosing model names must not grow
the exposition, nor put undecodable text in it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.pipe import Pipeline
from pipeline.contracts.output import Usage
from transports.http.accounting.usage import StoreHealth

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _EngineGauges(Collector):
    """Active slots and queue depth of every loaded model, read when scraped."""

    def __init__(self, pipelines: Callable[[], Mapping[str, Pipeline]]) -> None:
        self._pipelines = pipelines

    def collect(self) -> Iterable[Metric]:
        active = GaugeMetricFamily("pipeline_active_slots", "Requests holding a slot",
                                   labels=["model"])
        queued = GaugeMetricFamily("pipeline_queue_depth", "Requests waiting for a slot",
                                   labels=["model"])
        for name, pipe in self._pipelines().items():
            if pipe.engine is not None:
                active.add_metric([name], pipe.engine.active_slots)
                queued.add_metric([name], pipe.engine.queue_depth)
        return [active, queued]


class _UsageGauges(Collector):
    """The usage store's counters, read when scraped."""

    def __init__(self, health: Callable[[], StoreHealth]) -> None:
        self._health = health

    def collect(self) -> Iterable[Metric]:
        h = self._health()
        records = CounterMetricFamily(
            "pipeline_usage_records", "Usage records by outcome: durable (committed), spilled "
            "(a write failed; kept in memory and retried), dropped (the spill was full)",
            labels=["outcome"])
        for outcome, count in (("durable", h.durable), ("spilled", h.spilled),
                               ("dropped", h.dropped)):
            records.add_metric([outcome], count)
        depth = GaugeMetricFamily("pipeline_usage_spill_depth",
                                  "Usage records waiting in memory for a retry", value=h.spill_depth)
        up = GaugeMetricFamily("pipeline_usage_store_up",
                               "1 while usage records are written, 0 while writes fail",
                               value=0 if h.down is not None else 1)
        return [records, depth, up]


class Metrics:
    """The server's metrics; ``render()`` gives the Prometheus text exposition."""

    def __init__(self, pipelines: Callable[[], Mapping[str, Pipeline]],
                 served: Iterable[str] = ()) -> None:
        self.served = frozenset(served)
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pipeline_requests", "HTTP requests by outcome",
                                ["model", "endpoint", "status"], registry=self.registry)
        self.tokens = Counter("pipeline_tokens", "Tokens processed", ["model", "kind"],
                              registry=self.registry)
        self.cached_tokens = Counter(
            "pipeline_cached_prompt_tokens", "Prompt tokens read from the prefix cache (also "
            "counted in pipeline_tokens_total{kind=\"prompt\"})", ["model"],
            registry=self.registry)
        self.cache_hits = Counter("pipeline_prefix_cache_hits",
                                  "Generations whose prompt reused cached blocks", ["model"],
                                  registry=self.registry)
        self.ttft = Histogram("pipeline_time_to_first_token_seconds",
                              "Time from acceptance to the first token", ["model"],
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("pipeline_inter_token_seconds",
                                     "Time between streamed deltas", ["model"],
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineGauges(pipelines))

    def watch_usage(self, health: Callable[[], StoreHealth]) -> None:
        """Expose the usage store's state (:class:`_UsageGauges`) from now on."""
        self.registry.register(_UsageGauges(health))

    def label(self, model: str) -> str:
        """The ``model`` label for a name a request gave: itself if served, else ``other``."""
        return model if model in self.served else "other"

    def request(self, model: str, endpoint: str, status: int) -> None:
        """Count one answered request (``model`` as the request named it)."""
        self.requests.labels(self.label(model), endpoint, str(status)).inc()

    def finished(self, model: str, usage: Usage, ttft_s: float | None) -> None:
        """Record a finished generation's tokens (those its prompt read from the prefix cache
        too) and time to first token."""
        model = self.label(model)
        self.tokens.labels(model, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(model, "completion").inc(usage.completion_tokens)
        self.cached_tokens.labels(model).inc(usage.cached_tokens)
        hits = self.cache_hits.labels(model)  # a sample from the first generation on, hit or not
        if usage.cached_tokens:
            hits.inc()
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
