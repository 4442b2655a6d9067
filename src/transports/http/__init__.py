"""HTTP serving: the OpenAI and Anthropic dialects over SSE, with the gateway's duties.

Laid out by role: ``dialects/`` (each endpoint's body parsed and its answer encoded, from one
field specification that also gives the OpenAPI document), ``server/`` (routes and request
flow, uvicorn and its wire protocols, deadlines, limits, the request-side pool, the error map,
settings, health), ``gateway/`` (keys, the served models and their supervision, the window
fit, admission), ``accounting/`` (usage stores, metrics, the log, kept traces and their
inspector), ``page/`` (the web chat page and its assets). This package gives the names a
program that serves needs.
"""

from transports.http.server.app import create_app
from transports.http.server.config import ServerConfig, load_api_keys
from transports.http.gateway.gateway import Gateway
from transports.http.server.server import parse_models, serve
from transports.http.server.timeouts import Timeouts

__all__ = ["Gateway", "ServerConfig", "create_app", "load_api_keys", "Timeouts", "parse_models", "serve"]
