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
model (beyond, a 429); ``max_ongoing_requests`` is set to that sum, so Ray's router never sends
a replica more than it takes, and what exceeds every replica waits in Ray's queue instead of
being refused.

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
    return create_app(gateway)


def deployment(config: ServerConfig, num_replicas: int = 2, name: str = "pipeline") -> Any:
    """A Ray Serve deployment of ``num_replicas`` servers of ``config`` (module docstring);
    ``.bind()`` it and ``serve.run`` it. Needs the ``ray[serve]`` package."""
    from ray import serve

    admits = (config.num_slots + config.max_queue) * max(1, len(config.models))

    def build() -> Any:
        return replica_app(config)

    return serve.deployment(serve.ingress(build)(), name=name, num_replicas=num_replicas,
                            max_ongoing_requests=admits)
