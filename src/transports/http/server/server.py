"""Running the HTTP server: a gateway, its app, and uvicorn on one host and port.

Owns :func:`serve` (blocking; what ``pipeline serve`` calls) and :func:`parse_models`
(``--model DIR`` / ``--model NAME=DIR`` arguments into served names). uvicorn's configuration,
request read deadlines and the bounds on a request's head included (the server's
``limits``), is :func:`transports.http.server.timeouts.uvicorn_config`'s; what
the server logs is :mod:`transports.http.accounting.logs`'s. Models load while the server already
listens (503 until ready); when every one of them failed, the server stops and :func:`serve`
raises.
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from pipeline.errors import ArtifactError, InvalidValueError
from transports.http.accounting import logs
from transports.http.server.app import create_app
from transports.http.server.config import ServerConfig
from transports.http.gateway.gateway import Gateway
from transports.http.server.timeouts import uvicorn_config

DEFAULT_MODEL_NAME = "default"


def parse_models(specs: Sequence[str]) -> dict[str, Path | None]:
    """``["MODEL", "NAME=MODEL"]`` → ``{name: model}``; MODEL is what ``build`` takes (a
    folder, a GGUF file, ``smollm2``, ``tiny``, a cached repo id); a bare one is named after
    its folder, its file (without ``.gguf``) or itself. No specs serve the default model
    (SmolLM2-135M-Instruct) as ``default``."""
    if not specs:
        return {DEFAULT_MODEL_NAME: None}
    models: dict[str, Path | None] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        path = Path(folder if sep else spec)
        if not sep:
            name = (path.resolve().name if path.is_dir() else
                    path.stem if path.is_file() else spec.replace("/", "--"))
        if not name or name in models:
            raise InvalidValueError("--model", spec, "each served model needs a distinct name")
        models[name] = path
    return models


class _Server(uvicorn.Server):
    """uvicorn's server, saying where it listens once it does (port 0: the port it got), and
    that it stopped."""

    def __init__(self, config: uvicorn.Config, models: Sequence[str]) -> None:
        super().__init__(config)
        self.models = models

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal capture, saying ``stopped`` once the server has shut down: before
        uvicorn raises the captured signal again, whose default action (SIGTERM's) ends the
        process on the spot."""
        with super().capture_signals():
            yield
            if self.started:
                logs.log.info("stopped")

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = next((s.getsockname()[1] for server in self.servers
                         for s in server.sockets), self.config.port)
            logs.listening(logs.url(self.config.host, port), self.models)


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Load the models (in the background) and serve until interrupted; a request's headers
    and body must each arrive within ``config.timeouts``, and its head keep within
    ``config.limits`` (431). Raises
    :class:`~pipeline.errors.ArtifactError` when no model could be loaded (the server stops
    as soon as that is known), and :class:`~pipeline.errors.InvalidValueError` for a data
    directory or a usage database it cannot open (before serving). Logging is left to the caller
    (:func:`transports.http.accounting.logs.configure`); ``log_level`` is uvicorn's own."""
    try:
        gateway = Gateway(config)
    except (OSError, sqlite3.Error) as exc:  # the usage database cannot be opened there
        raise InvalidValueError("data_dir", str(config.data_dir),
                                f"cannot hold the usage database: {exc}") from exc
    server = _Server(uvicorn_config(create_app(gateway), host, port, log_level,
                                    config.timeouts, log_config=None, limits=config.limits),
                     list(gateway.models))

    def loaded() -> None:
        if not gateway.pipelines():
            server.should_exit = True

    gateway.loader.load(then=loaded)
    # what uvicorn.run does around Server.run (it cannot take a prepared Config): Ctrl-C is the
    # ordinary way to stop, and a server that never started exits with uvicorn's status
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    failed = gateway.failed
    if failed and len(failed) == len(gateway.models):
        why = "; ".join(f"{name!r}: {error}" for name, error in failed.items())
        raise ArtifactError(f"no model could be loaded ({why})")
    if not server.started:
        sys.exit(STARTUP_FAILURE)
