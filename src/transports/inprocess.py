"""In-process transports: deltas as a blocking iterator or as an asyncio async iterator.

Owns :class:`InProcessTransport` and :class:`AsyncioTransport` (the one bridge from the engine
thread to an event loop: the HTTP server streams through it too). Both deliver a handle's
deltas in order and end after the final one; a consumer that stops early (closes the
iterator, breaks out of the loop, or lets it be collected) cancels the request so its slot is
freed.

The asyncio bridge batches: the engine thread appends to a deque and schedules at most one
wake-up of the loop until the loop has drained it, so a busy loop pays one cross-thread call
per batch instead of one per token, and a consumer that falls behind gets what has piled up
as one :class:`~pipeline.contracts.output.Delta` (:func:`merge`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from pipeline.output_parts import joined
from pipeline.contracts.output import Delta, Part, ToolCallDelta

if TYPE_CHECKING:
    from pipeline.engine.handle import RequestHandle


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
    """Deltas as an async iterator on the running event loop (no thread per request), one
    merged delta per wake-up of the loop."""

    name = "asyncio"

    def deliver(self, handle: RequestHandle) -> AsyncIterator[Delta]:
        """Iterate ``handle``'s deltas asynchronously; closing early cancels the request."""
        return _aiterate(handle)


async def _aiterate(handle: RequestHandle) -> AsyncIterator[Delta]:
    inbox = _Inbox(asyncio.get_running_loop(), handle)
    handle.add_listener(inbox.push)
    finished = False
    try:
        while not finished:
            taken = await inbox.wait()
            finished = taken[-1].final
            yield merge(taken)
    finally:
        if not finished:
            handle.cancel()


def merge(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one request as one: texts, ids, logprobs, tool-call pieces and
    typed parts joined in order (:func:`~pipeline.output_parts.joined`)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    parts: list[Part] = []
    for d in deltas:
        joined(parts, d.parts)
    return Delta(last.request_id, last.seq, "".join(d.text for d in deltas),
                 tuple(t for d in deltas for t in d.token_ids),
                 tuple(lp for d in deltas for lp in d.logprobs), last.finish_reason,
                 tuple(p for p in parts if isinstance(p, ToolCallDelta)), tuple(parts))


class _Inbox:
    """The deltas the engine thread has pushed and the loop has not taken yet."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: RequestHandle) -> None:
        self.loop = loop
        self.handle = handle
        self.items: deque[Delta] = deque()
        self.lock = threading.Lock()
        self.scheduled = False
        self.waiter: asyncio.Future[None] | None = None

    def push(self, delta: Delta) -> None:  # engine thread
        with self.lock:
            self.items.append(delta)
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.handle.cancel()

    def _wake(self) -> None:  # loop thread: deltas arrived (unless a take() got them first)
        with self.lock:
            empty = not self.items
        if not empty:
            self._resolve()

    def _resolve(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def take(self) -> list[Delta]:
        with self.lock:
            out = list(self.items)
            self.items.clear()
            self.scheduled = False
        return out

    async def wait(self) -> list[Delta]:
        """The deltas that have arrived, once there is at least one."""
        while True:
            taken = self.take()
            if taken:
                return taken
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
