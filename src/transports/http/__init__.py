"""HTTP serving: the OpenAI and Anthropic dialects over SSE, with the gateway's duties.

Modules: ``app`` (routes and request flow), ``generation`` (a request's choices started, and
its answer or stream encoder), ``choices`` (``n`` generations per request: seeds, usage,
interleaved deltas), ``gateway`` (keys, routing, window arithmetic, admission, usage),
``openai_api`` / ``completions_api`` / ``anthropic_api`` (the dialects: chat, legacy text
completions, Messages), ``documented`` (documented fields ignored or refused), ``errors`` (the
one map from the exception tree to statuses and bodies), ``fields`` (body validation), ``output``
(thinking and tool-call splitting), ``usage`` (SQLite WAL store), ``metrics`` (Prometheus),
``config``, ``server`` (uvicorn), ``timeouts`` (deadlines for a request's headers and body),
``limits`` (what one request may ask for), ``work`` (the bounded request-side pool),
``openapi`` / ``openapi_requests`` (the server's own OpenAPI document, its request bodies),
``traces`` (the last finished requests' traces
for ``GET /traces/{request_id}``), ``page`` (the web chat page at ``GET /``, shipped as
``web/index.html``), ``logs`` (what the server logs: models, address, one access line per
request).
"""

from transports.http.app import create_app
from transports.http.config import ServerConfig, load_api_keys
from transports.http.gateway import Gateway
from transports.http.server import parse_models, serve
from transports.http.timeouts import Timeouts

__all__ = ["Gateway", "ServerConfig", "create_app", "load_api_keys", "Timeouts", "parse_models", "serve"]
