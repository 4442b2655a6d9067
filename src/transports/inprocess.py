"""In-process transports: deltas as a blocking iterator or as an asyncio async iterator.

Owns :class:`InProcessTransport` and :class:`AsyncioTransport`. Both deliver a handle's deltas
in order and end after the final one; a consumer that stops early (closes the iterator, breaks
out of the loop, or lets it be collected) cancels the request so its slot is freed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

from pipeline.engine.handle import RequestHandle
from pipeline.types import Delta


class InProcessTransport:
    """Deltas as a blocking iterator, for threads and scripts."""

    name = "inprocess"

    def deliver(self, handle: RequestHandle) -> Iterator[Delta]:
        """Iterate ``handle``'s deltas; closing early cancels the request."""
        return _iterate(handle)


def _iterate(handle: RequestHandle) -> Iterator[Delta]:
    finished = False
    try:
        for delta in handle.deltas():
            finished = delta.final
            yield delta
    finally:
        if not finished:
            handle.cancel()


class AsyncioTransport:
    """Deltas as an async iterator on the running event loop (no thread per request)."""

    name = "asyncio"

    def deliver(self, handle: RequestHandle) -> AsyncIterator[Delta]:
        """Iterate ``handle``'s deltas asynchronously; closing early cancels the request."""
        return _aiterate(handle)


async def _aiterate(handle: RequestHandle) -> AsyncIterator[Delta]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Delta] = asyncio.Queue()

    def listener(delta: Delta) -> None:  # runs on the engine thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, delta)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            handle.cancel()

    handle.add_listener(listener)
    finished = False
    try:
        while not finished:
            delta = await queue.get()
            finished = delta.final
            yield delta
    finally:
        if not finished:
            handle.cancel()
