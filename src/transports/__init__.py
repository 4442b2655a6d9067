"""Transports: how deltas reach a consumer: in-process iterators, HTTP serving (OpenAI and
Anthropic dialects over SSE) in ``transports.http``, and that server as Ray Serve replicas in
``transports.ray_serve``."""

from transports.inprocess import AsyncioTransport, InProcessTransport

__all__ = ["AsyncioTransport", "InProcessTransport"]
