"""Replicas behind a router: the HTTP server as a Ray Serve deployment.

Owns :func:`deployment` and :func:`replica_app`. Ray Serve's proxy takes the HTTP requests and
spreads them over ``num_replicas`` replicas, each a whole server of this project: its own
:class:`~transports.http.Gateway` (the models, their engines, admission, the usage writer)
built on the replica by :func:`replica_app`, which Ray calls there (``serve.ingress`` with a
builder), so no model or engine crosses a process. Every replica serves every model of the
:class:`~transports.http.ServerConfig`, so a request is routed on its ``model`` field by the
replica's gateway exactly as one server routes it (an unknown name is a 404 listing the
served ones).

**Admission.** A replica admits ``num_slots`` running and ``max_queue`` waiting requests a
model (beyond, a 429); ``max_ongoing_requests`` is set to that sum, one model's worth, so
Ray's router never sends a replica more than a model takes, and what exceeds every replica
waits in Ray's queue instead of being refused.

**Health.** A replica whose models failed to load raises at start, and Ray's health check
(:func:`replica_down`) fails a replica whose engine stopped, so Ray replaces it instead of
routing to it.

**What crosses.** The config is pickled into Ray's deployment definition, API keys and the
database URL included: keep the Ray cluster as private as the server's configuration. A
replica's data directory is named after its id, so a replaced replica's spill file stays in
the old directory.

**Usage.** The replicas share one usage store when ``config.usage_database`` is a PostgreSQL
URL (:mod:`transports.http.usage_postgres`); each keeps its spill file in a data directory of
its own (``<data_dir>/<replica id>``).

Example (local Ray, two replicas)::

    import ray
    from ray import serve

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(deployment(config, num_replicas=2).bind(), route_prefix="/")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from transports.http.config import ServerConfig


def replica_app(config: ServerConfig) -> Any:
    """The ASGI app of one replica (called by Ray on the replica): a gateway over ``config``
    with a data directory of the replica's own, its models loaded before it takes traffic."""
    from ray import serve

    from transports.http import Gateway, create_app

    replica = serve.get_replica_context().replica_id.unique_id
    own = attrs.evolve(config, data_dir=Path(config.data_dir) / f"replica-{replica}")
    gateway = Gateway(own)
    gateway.load(wait=True)
    if gateway.failed:  # Ray starts another replica rather than route traffic to this one
        gateway.close()
        raise RuntimeError(f"this replica's models failed to load: {gateway.failed}")
    _GATEWAY[:] = [gateway]
    return create_app(gateway)


_GATEWAY: list[Any] = []
"""The replica's gateway (one a replica process), for its health check."""


def replica_down() -> str | None:
    """Why this replica cannot serve (a model that failed, an engine that stopped), or None.
    A usage store that is down is not a reason: its records are kept and retried."""
    if not _GATEWAY:
        return None
    gateway = _GATEWAY[0]
    problems = {k: v for k, v in gateway.problems().items() if k.startswith("engine:")}
    if gateway.failed or problems:
        return f"failed: {gateway.failed}, stopped: {problems}"
    return None


def deployment(config: ServerConfig, num_replicas: int = 2, name: str = "pipeline") -> Any:
    """A Ray Serve deployment of ``num_replicas`` servers of ``config`` (module docstring);
    ``.bind()`` it and ``serve.run`` it. Needs the ``ray[serve]`` package. Ray's health
    check asks :func:`replica_down` and replaces a replica that cannot serve."""
    from ray import serve

    def build() -> Any:
        return replica_app(config)

    class Replica(serve.ingress(build)()):  # type: ignore[misc]
        def check_health(self) -> None:
            down = replica_down()
            if down is not None:
                raise RuntimeError(f"replica down: {down}")

    # what one model admits: with several, a replica never gets more than any one takes
    return serve.deployment(Replica, name=name, num_replicas=num_replicas,
                            max_ongoing_requests=config.num_slots + config.max_queue)
