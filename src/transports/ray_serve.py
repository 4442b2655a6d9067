"""Replicas behind a router: the HTTP server as a Ray Serve application.

Owns :func:`application`, :func:`deployment`, :func:`replica_app`, the replica side of a
forwarded request (:func:`served`) and the front that forwards it (:class:`Front`). Ray Serve's
proxy takes the HTTP requests and hands each to the front, a thin ingress deployment that
forwards it through a ``DeploymentHandle`` to one of ``num_replicas`` replicas, each a whole
server of this project: its own :class:`~transports.http.Gateway` (the models, their engines,
admission, the usage writer) built on the replica by :func:`replica_app` when Ray starts it
there, so no model or engine crosses a process. Every replica serves every model of the
:class:`~transports.http.ServerConfig`, so a request is routed on its ``model`` field by the
replica's gateway exactly as one server routes it (an unknown name is a 404 listing the
served ones).

**Forwarding.** The front reads the body (at most ``max_body_bytes``, else the gateway's 413)
and sends the request to a replica, which runs it through its gateway's ASGI app
(:func:`served`) and streams back the app's ASGI messages, its response's head first with
``x-replica-id`` (the replica's id) added; the front replays them to the client, holding the
head until the first body bytes, so that nothing reaches the client before the replica has
produced an answer.

**A replica that dies** (its actor killed, its process gone) is met in the client's dialect,
never with Ray's bare plain-text 500 or a stream cut without an end:

- a request nothing was sent for yet (a non-stream request still generating, a stream before
  its first bytes) is sent once more, to another replica (Ray's router drops the dead one);
  if that one dies too, it is the dialect's 503 (the error body of
  :class:`~pipeline.errors.EngineClosed`: OpenAI ``service_unavailable``, Anthropic
  ``api_error``), which a client may retry;
- a stream already under way ends with the dialect's error event carrying that 503 body (an
  OpenAI ``data:`` chunk ``{"error": ...}``, an Anthropic ``event: error``), as the gateway
  ends a stream whose engine died.

The dialect is the route's: ``/v1/messages`` (and under it) is Anthropic, every other route
OpenAI's. Any other failure of the forward is the dialect's 500 body. A client that leaves
cancels the forward, and the replica's app sees the disconnect, as it would behind its own
server. The front itself holds no model; if the front's own actor died, Ray's proxy would
answer as before: it is not the one that fails under load.

**Admission.** A replica admits ``num_slots`` running and ``max_queue`` waiting requests a
model (beyond, a 429); ``max_ongoing_requests`` is set to that sum, one model's worth, so
Ray's router never sends a replica more than a model takes, and what exceeds every replica
waits in Ray's queue instead of being refused. The front takes twice what all replicas admit
(its requests hold their bodies); the rest wait in Ray's proxy.

**Health.** A replica whose models failed to load raises at start, and Ray's health check
(:func:`replica_down`) fails a replica whose engine stopped, so Ray replaces it instead of
routing to it.

**What crosses.** The config is pickled into Ray's deployment definition, API keys and the
database URL included: keep the Ray cluster as private as the server's configuration. A
replica's data directory is named after its id, so a replaced replica's spill file stays in
the old directory.

**Usage.** The replicas share one usage store when ``config.usage_database`` is a PostgreSQL
URL (:mod:`transports.http.accounting.usage_postgres`); each keeps its spill file in a data directory of
its own (``<data_dir>/<replica id>``).

Example (local Ray, two replicas)::

    import ray
    from ray import serve

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(application(config, num_replicas=2), route_prefix="/")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from starlette.responses import JSONResponse

from pipeline.errors import EngineClosed
from transports.http.serving_errors import ClientGone, PayloadTooLargeError
from transports.http.server.config import ServerConfig
from transports.http.server.errors import (
    Dialect, classify, error_body, retry_headers, status_for, stream_error,
)

log = logging.getLogger("pipeline.serve")

REPLICA_HEADER = "x-replica-id"
"""The response header naming the replica that answered (its Ray Serve replica id)."""

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@attrs.frozen
class Asked:
    """One HTTP request as the front forwards it: its head and its whole body."""

    method: str
    path: str
    root_path: str
    raw_path: bytes
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    def scope(self) -> Message:
        """The ASGI scope the replica's app gets (spec 2.3: it listens for the disconnect)."""
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1", "method": self.method, "scheme": "http",
                "path": self.path, "raw_path": self.raw_path, "root_path": self.root_path,
                "query_string": self.query_string, "headers": [list(h) for h in self.headers],
                "client": self.client, "server": None}


def replica_app(config: ServerConfig) -> Any:
    """The ASGI app of one replica (called by Ray on the replica): a gateway over ``config``
    with a data directory of the replica's own, its models loaded before it takes traffic."""
    from ray import serve

    from transports.http import Gateway, create_app

    replica = serve.get_replica_context().replica_id.unique_id
    own = attrs.evolve(config, data_dir=Path(config.data_dir) / f"replica-{replica}")
    gateway = Gateway(own)
    gateway.loader.load(wait=True)
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


async def served(app: Callable[[Message, Receive, Send], Awaitable[None]], asked: Asked,
                 replica: str, running: set[asyncio.Task[None]]) -> AsyncIterator[Message]:
    """On a replica: ``asked`` run through ``app``, its ASGI messages as the app sends them
    (the head with :data:`REPLICA_HEADER` naming ``replica``). Closing the iterator early (the
    front cancelled: its client left) is the app's ``http.disconnect``; the app's task stays in
    ``running`` until it has wound down."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    request = [{"type": "http.request", "body": asked.body, "more_body": False}]
    left = asyncio.Event()

    async def receive() -> Message:
        if request:
            return request.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            named = (REPLICA_HEADER.encode(), replica.encode())
            message = {**message, "headers": [*message.get("headers", []), named]}
        messages.put_nowait(message)

    async def run() -> None:
        try:
            await app(asked.scope(), receive, send)
        finally:
            messages.put_nowait(None)

    task = asyncio.create_task(run())
    running.add(task)
    task.add_done_callback(running.discard)
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # an error that escaped the app reaches the front
    finally:
        left.set()


def dialect_of(path: str) -> Dialect:
    """The dialect a route (``path`` below the route prefix) answers in: Anthropic's under
    ``/v1/messages``, else OpenAI's."""
    return Dialect.ANTHROPIC if path.rstrip("/").startswith("/v1/messages") else Dialect.OPENAI


def _gone(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica serving the request is gone (died, unreachable)."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, RayActorError):
        return True
    return isinstance(exc, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError))


REPLICA_GONE = ("the replica serving this request stopped before it was answered; retry "
                "the request")
RETRY_AFTER_S = 1.0
"""The wait a client refused because its replica (and the one tried after it) died is told
to take before it sends again (``Retry-After``): the router then sends it to a live one."""


class Front:
    """The front's ASGI app: each request forwarded to a replica through ``replicas`` (a
    ``DeploymentHandle`` of the replicas' deployment, method ``forward``), a replica's death
    answered in the client's dialect (module docstring)."""

    def __init__(self, replicas: Any, max_body_bytes: int) -> None:
        self.replicas = replicas.options(stream=True)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _http(self, scope: Message, receive: Receive, send: Send) -> None:
        root, path = scope.get("root_path", ""), scope["path"]
        dialect = dialect_of(path[len(root):] if path.startswith(root) else path)
        try:
            body = await self._body(receive)
        except ClientGone:
            return
        except PayloadTooLargeError as exc:
            await _refuse(send, exc, dialect)
            return
        headers = tuple((k, v) for k, v in scope["headers"])
        client = tuple(scope["client"]) if scope.get("client") else None
        asked = Asked(scope["method"], path, root, scope.get("raw_path") or path.encode(),
                      scope["query_string"], headers, body, client)
        if not await self._forward(asked, send, dialect, last=False):
            log.warning("%s %s: a replica died before answering; sent to another",
                        asked.method, asked.path)
            await self._forward(asked, send, dialect, last=True)

    async def _body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone("the client left before its body was read")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLargeError(size, self.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _forward(self, asked: Asked, send: Send, dialect: Dialect, last: bool) -> bool:
        """One try at ``asked``: False when its replica died before anything was sent and
        this is not the ``last`` try (the caller tries another), else True once the client
        has had an answer, whole or ended in the dialect's error."""
        call = self.replicas.forward.remote(asked)
        head: Message | None = None  # held until the first body bytes
        sent = stream = False
        try:
            while True:
                try:
                    message = await call.__anext__()
                except StopAsyncIteration:
                    return True
                except Exception as exc:
                    gone = _gone(exc)
                    if not sent and gone and not last:
                        return False
                    fault: Exception = EngineClosed(REPLICA_GONE) if gone else exc
                    log.warning("%s %s: the replica failed (%r)", asked.method, asked.path, exc)
                    if not sent:
                        await _refuse(send, fault, dialect)
                    elif stream:
                        await send({"type": "http.response.body",
                                    "body": stream_error(fault, dialect)})
                    return True
                if message["type"] == "http.response.start":
                    head, stream = message, _is_stream(message)
                    continue
                if not sent:
                    await send(head or {})
                    sent = True
                await send(message)
                if not message.get("more_body", False):
                    return True
        finally:
            call.cancel()  # a no-op once it ended; a client that left cancels the replica's


def _is_stream(head: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
               for k, v in head.get("headers", []))


async def _refuse(send: Send, exc: BaseException, dialect: Dialect) -> None:
    """The dialect's error response for ``exc``, whole, as the gateway's app writes it; a
    replica gone says when to retry (:data:`RETRY_AFTER_S`: another replica may serve it)."""
    info = classify(exc)
    retry = RETRY_AFTER_S if isinstance(exc, EngineClosed) else None
    response = JSONResponse(error_body(info, dialect), status_for(info, dialect),
                            headers=retry_headers(retry))
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


async def _lifespan(receive: Receive, send: Send) -> None:
    """The front has nothing to start or stop: every lifespan event completes at once."""
    while True:
        event = (await receive())["type"]
        await send({"type": f"{event}.complete"})
        if event == "lifespan.shutdown":
            return


def deployment(config: ServerConfig, num_replicas: int = 2, name: str = "pipeline") -> Any:
    """The replicas' Ray Serve deployment: ``num_replicas`` servers of ``config`` (module
    docstring), each answering the front's ``forward``. Needs the ``ray[serve]`` package.
    Ray's health check asks :func:`replica_down` and replaces a replica that cannot serve."""
    from ray import serve

    class Replica:
        async def __init__(self) -> None:  # type: ignore[misc]  # Ray awaits it
            from uvicorn.config import Config
            from uvicorn.lifespan.on import LifespanOn

            self.app = replica_app(config)
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.running: set[asyncio.Task[None]] = set()
            # the app's lifespan, as a server runs it: its end closes the gateway
            self.lifespan = LifespanOn(Config(self.app, lifespan="on", log_config=None))
            await self.lifespan.startup()

        async def forward(self, asked: Asked) -> AsyncIterator[Message]:
            async for message in served(self.app, asked, self.replica, self.running):
                yield message

        def check_health(self) -> None:
            down = replica_down()
            if down is not None:
                raise RuntimeError(f"replica down: {down}")

        async def __del__(self) -> None:  # Ray awaits it when it stops the replica
            await self.lifespan.shutdown()

    # what one model admits: with several, a replica never gets more than any one takes
    return serve.deployment(Replica, name=name, num_replicas=num_replicas,
                            max_ongoing_requests=config.num_slots + config.max_queue)


def application(config: ServerConfig, num_replicas: int = 2, name: str = "pipeline") -> Any:
    """The Ray Serve application to ``serve.run``: the front (deployment ``<name>-front``, no
    CPU of its own) over :func:`deployment`'s ``num_replicas`` replicas (deployment
    ``name``). Needs the ``ray[serve]`` package."""
    from ray import serve

    max_body_bytes = config.limits.max_body_bytes

    class Ingress:
        def __init__(self, replicas: Any) -> None:
            self.front = Front(replicas, max_body_bytes)

        def __serve_build_asgi_app__(self) -> Front:
            return self.front

    ingress: Any = serve.ingress()(Ingress)
    admitted = num_replicas * (config.num_slots + config.max_queue)
    front: Any = serve.deployment(ingress, name=f"{name}-front", max_ongoing_requests=2 * admitted,
                                  ray_actor_options={"num_cpus": 0})
    return front.bind(deployment(config, num_replicas, name).bind())
