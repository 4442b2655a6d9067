"""Admission: a model's requests running or queued kept within its capacity, and the end of
every request.

Owns :class:`Admission`: at most ``num_slots`` running and ``max_queue`` waiting per model,
then :class:`~transports.http.serving_errors.OverloadedError` (a request's choices admitted together, all or
none; a cheap pre-check on the raw body's model names before parsing);
:meth:`Admission.retry_after`, when a refused client should come back, from the model's pace
and queue, or its engine's restart; and the end of every request: its usage record committed
durably, or spilled for a retry after ``usage_wait_s`` at most; its admission place given
back, its metrics counted, its choices' traces kept for the keys that made it; a failed one's
error logged with its id, streamed or not, since the client only hears "internal server
error".
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Collection, Mapping, Sequence

from pipeline.errors import EngineClosed
from transports.http.serving_errors import ModelLoadingError, OverloadedError
from pipeline.prepared import Prepared
from pipeline.contracts.output import Completion
from transports.http.accounting.metrics import Metrics
from transports.http.accounting.traces import TraceStore
from transports.http.accounting.usage import UsageRecord, UsageStore
from transports.http.gateway.door import (
    LOADING_WAIT_S, RETRY_MIN_S, place_wait_s, queue_timed_out, restart_wait_s,
)
from transports.http.gateway.models import Flight, ModelState, ServedModel
from transports.http.server.choices import Choices, total_usage
from transports.http.server.config import ServerConfig

log = logging.getLogger("pipeline.serve")


class Admission:
    """Admits the served models' requests and ends them. Thread-safe."""

    def __init__(self, config: ServerConfig, models: Mapping[str, ServedModel],
                 metrics: Metrics, usage: UsageStore, traces: TraceStore) -> None:
        self.config = config
        self.models = models
        self.metrics = metrics
        self.usage = usage
        self.traces = traces
        self.flights: dict[str, Flight] = {}
        """Requests admitted and not yet finished, by request id (for inspection)."""

    @property
    def capacity(self) -> int:
        """Requests one model may hold, running or queued: ``num_slots + max_queue``."""
        return self.config.num_slots + self.config.max_queue

    def precheck(self, names: Collection[str]) -> None:
        """Refuse a generation request before its body is parsed and its prompt rendered,
        when every name in ``names`` (what its raw body may give as ``model``:
        :func:`~transports.http.gateway.door.peek_models`) is a served model holding
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
          :func:`~transports.http.gateway.door.place_wait_s` from the model's pace and the
          requests waiting ahead (a model not known here: the shortest wait);
        * a model loading for the first time:
          :data:`~transports.http.gateway.door.LOADING_WAIT_S`;
        * an engine restarting (refused, or a request its stop ended):
          :func:`~transports.http.gateway.door.restart_wait_s`, what is left of
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
        ``record_id`` (:func:`~transports.http.server.choices.total_usage`), and their traces are
        kept together under it, readable with the keys whose fingerprints are ``owners``
        (:meth:`~transports.http.accounting.traces.TraceStore.add_choices`); every flight's ``done``
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
