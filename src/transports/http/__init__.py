"""HTTP serving: the OpenAI and Anthropic dialects over SSE, with the gateway's duties.

Modules: ``app`` (routes and request flow), ``gateway`` (keys, routing, window arithmetic,
admission, usage), ``openai_api`` / ``anthropic_api`` (the dialects), ``errors`` (the one map
from the exception tree to statuses and bodies), ``fields`` (body validation), ``output``
(thinking and tool-call splitting), ``usage`` (SQLite WAL store), ``metrics`` (Prometheus),
``config``, ``server`` (uvicorn), ``timeouts`` (deadlines for a request's headers and body),
``limits`` (what one request may ask for), ``work`` (the bounded request-side pool),
``openapi`` (the server's own OpenAPI document), ``logs`` (what the server logs: models,
address, one access line per request).
"""

from transports.http.app import create_app
from transports.http.config import ServerConfig, load_api_keys
from transports.http.gateway import Gateway
from transports.http.server import parse_models, serve
from transports.http.timeouts import Timeouts

__all__ = ["Gateway", "ServerConfig", "create_app", "load_api_keys", "Timeouts", "parse_models", "serve"]
