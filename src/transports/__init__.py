"""Transports: how deltas reach a consumer: in-process iterators, and HTTP serving (OpenAI and
Anthropic dialects over SSE) in ``transports.http``."""

from transports.inprocess import AsyncioTransport, InProcessTransport

__all__ = ["AsyncioTransport", "InProcessTransport"]
