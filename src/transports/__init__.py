"""Transports: how deltas reach a consumer (in-process iterators now; SSE over HTTP later)."""

from transports.inprocess import AsyncioTransport, InProcessTransport

__all__ = ["AsyncioTransport", "InProcessTransport"]
