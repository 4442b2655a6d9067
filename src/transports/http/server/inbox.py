"""A request's deltas on the server's event loop, with keep-alive pings while it is silent.

Owns :func:`batches`: the deltas of a handle as the pipeline's asyncio transport delivers them
(:class:`~transports.inprocess.AsyncioTransport` unless the pipeline was built with another:
one merged :class:`~pipeline.contracts.output.Delta` per wake-up of the loop), with ``None`` whenever
``ping_s`` passes without one (for keep-alive events). Leaving early (client gone: the task is
cancelled, or the iterator is closed) closes the transport's iterator, which cancels the
request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pipeline.engine.handle import RequestHandle
from pipeline.contracts.transport import Transport
from pipeline.contracts.output import Delta
from transports.inprocess import AsyncioTransport


async def batches(handle: RequestHandle, ping_s: float,
                  transport: Transport[AsyncIterator[Delta]] | None = None
                  ) -> AsyncIterator[Delta | None]:
    """``handle``'s deltas through ``transport`` (default: the asyncio transport), and
    ``None`` after each ``ping_s`` of silence; ends after the final delta."""
    deltas = (transport or AsyncioTransport()).deliver(handle)
    pending: asyncio.Future[Delta] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(deltas))
            done, _ = await asyncio.wait({pending}, timeout=ping_s)
            if not done:
                yield None
                continue
            arrived, pending = pending, None
            try:
                delta = arrived.result()
            except StopAsyncIteration:
                return
            yield delta
            if delta.final:
                return
    finally:
        if pending is not None:  # the transport's iterator unwinds: it cancels the request
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        close = getattr(deltas, "aclose", None)  # an async generator's; a plain iterator's
        if close is not None:                      # end is the transport's own business
            await close()
