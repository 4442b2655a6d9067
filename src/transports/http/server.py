"""Running the HTTP server: a gateway, its app, and uvicorn on one host and port.

Owns :func:`serve` (blocking; what ``pipeline serve`` calls) and :func:`parse_models`
(``--model DIR`` / ``--model NAME=DIR`` arguments into served names). uvicorn's configuration,
request read deadlines included, is :func:`transports.http.timeouts.uvicorn_config`'s.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from pipeline.errors import InvalidValueError
from transports.http.app import create_app
from transports.http.config import ServerConfig
from transports.http.gateway import Gateway
from transports.http.timeouts import uvicorn_config

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


def serve(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Load the models (in the background) and serve until interrupted; a request's headers
    and body must each arrive within ``config.timeouts``."""
    gateway = Gateway(config)
    gateway.load()
    server = uvicorn.Server(uvicorn_config(create_app(gateway), host, port, log_level,
                                           config.timeouts))
    # what uvicorn.run does around Server.run (it cannot take a prepared Config): Ctrl-C is the
    # ordinary way to stop, and a server that never started exits with uvicorn's status
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
