"""Handing a request's deltas from the engine thread to the event loop, in batches.

Owns :func:`batches`: an async iterator over a handle's deltas, merged into one
:class:`~pipeline.types.Delta` per wake-up. The engine thread appends to a deque and schedules
at most one wake-up of the loop until the loop has drained it, so a busy server pays one
cross-thread call per batch instead of one per token, and a consumer that falls behind gets
what has piled up in one write. ``None`` comes out when ``ping_s`` passes without a delta (for
keep-alive events). Leaving early (client gone: the task is cancelled, or the iterator is
closed) cancels the request.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

from pipeline.engine.handle import RequestHandle
from pipeline.output_parts import joined
from pipeline.types import Delta, Part


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
                 tuple(c for d in deltas for c in d.tool_calls), tuple(parts))


class _Inbox:
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

    async def wait(self, timeout: float) -> list[Delta]:
        taken = self.take()
        if taken:
            return taken
        self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._resolve)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None
        return self.take()


async def batches(handle: RequestHandle, ping_s: float) -> AsyncIterator[Delta | None]:
    """Merged deltas as they arrive; ``None`` after ``ping_s`` of silence; ends after the
    final delta."""
    inbox = _Inbox(asyncio.get_running_loop(), handle)
    handle.add_listener(inbox.push)
    finished = False
    try:
        while not finished:
            taken = await inbox.wait(ping_s)
            if not taken:
                yield None
                continue
            finished = taken[-1].final
            yield merge(taken)
    finally:
        if not finished:
            handle.cancel()
