"""Registers the built-in transports through the ``pipeline_components`` hook."""

from __future__ import annotations

from pipeline.hookspecs import hookimpl
from pipeline.registry import Component
from transports.inprocess import AsyncioTransport, InProcessTransport


@hookimpl
def pipeline_components() -> list[Component]:
    """The in-process transports."""
    return [
        Component("transport", "inprocess", lambda ctx: InProcessTransport(),
                  "deltas as a blocking iterator"),
        Component("transport", "asyncio", lambda ctx: AsyncioTransport(),
                  "deltas as an asyncio async iterator"),
    ]
