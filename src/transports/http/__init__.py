"""HTTP serving: the OpenAI and Anthropic dialects over SSE, with the gateway's duties.

Laid out by role: ``dialects/`` (each endpoint's body parsed and its answer encoded, from one
field specification that also gives the OpenAPI document), ``server/`` (routes and request
flow, uvicorn and its wire protocols, deadlines, limits, the request-side pool, the error map,
settings, health), ``gateway/`` (keys, the served models and their supervision, the window
fit, admission), ``accounting/`` (usage stores, metrics, the log, kept traces and their
inspector), ``page/`` (the web chat page and its assets). This package gives the names a
program that serves needs, each loaded when first asked for: importing a light module of the
package (``transports.http.server.limits`` for the command line's flags) loads neither the
server nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.lazy import homes, lazy

if TYPE_CHECKING:
    from transports.http.gateway.gateway import Gateway as Gateway
    from transports.http.server.app import create_app as create_app
    from transports.http.server.config import ServerConfig as ServerConfig
    from transports.http.server.config import load_api_keys as load_api_keys
    from transports.http.server.server import parse_models as parse_models
    from transports.http.server.server import serve as serve
    from transports.http.server.timeouts import Timeouts as Timeouts

_HOMES = homes(__file__)

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy(__name__, _HOMES, globals())
