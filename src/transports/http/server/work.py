"""Request-side work off the event loop: a bounded pool that stops when the client leaves.

Owns :class:`Workers`. Parsing a body, rendering a chat template, tokenizing and counting
cost CPU in proportion to what a client sent, so they run on a pool of ``threads`` threads of
the server's own (not asyncio's default executor, which other code shares), with at most
``max_waiting`` more jobs waiting; beyond that a request is refused as overloaded (429/529)
instead of queueing without bound. Cheap requests (``/health``, ``/metrics``, ``/v1/models``)
never enter the pool, so they cannot starve behind it.

While a job runs, the handler watches its connection. When the client disconnects, the job's
:class:`Checkpoint` starts raising :class:`~transports.http.serving_errors.ClientGone`, so work between stages
(render → count → tokenize → submit) stops at the next checkpoint, a job still waiting never
starts, and anything the job produced for nobody (a submitted request) is handed to
``orphan`` to be cancelled.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

from starlette.requests import Request as HTTPRequest

from transports.http.serving_errors import ClientGone, OverloadedError

T = TypeVar("T")


class Checkpoint:
    """Called between stages of a job: raises :class:`ClientGone` once the client left."""

    def __init__(self) -> None:
        self._gone = threading.Event()

    def leave(self) -> None:
        """The client disconnected."""
        self._gone.set()

    @property
    def gone(self) -> bool:
        """True once the client disconnected."""
        return self._gone.is_set()

    def __call__(self) -> None:
        if self._gone.is_set():
            raise ClientGone("the client disconnected; its request was not started")


async def disconnected(http: HTTPRequest) -> None:
    """Return once the client has disconnected (the body must have been read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class Workers:
    """A bounded thread pool for request-side work. Thread-safe; ``close`` when done."""

    def __init__(self, threads: int = 4, max_waiting: int = 64) -> None:
        self.threads = threads
        self.max_waiting = max_waiting
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="http-work")
        self._lock = threading.Lock()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Jobs running or waiting now."""
        with self._lock:
            return self._pending

    async def run(self, http: HTTPRequest, job: Callable[[Checkpoint], T],
                  orphan: Callable[[T], None] | None = None) -> T:
        """``job(checkpoint)`` on the pool; raises :class:`ClientGone` if the client leaves
        first (then ``orphan`` gets the job's result, should it still produce one)."""
        checkpoint = Checkpoint()
        future = self._submit(job, checkpoint)
        watcher: asyncio.Future[Any] = asyncio.ensure_future(disconnected(http))
        result: asyncio.Future[Any] = asyncio.wrap_future(future)
        try:
            await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left = watcher.done() and not watcher.cancelled()
            watcher.cancel()
        if result.done() and not left:
            return cast(T, result.result())
        checkpoint.leave()
        future.cancel()  # never starts if it was still waiting
        # (when the job finished in the same instant, the callback runs at once)
        result.add_done_callback(lambda f: _orphaned(f, orphan))
        raise ClientGone("the client disconnected while its request was being prepared")

    def _submit(self, job: Callable[[Checkpoint], T], checkpoint: Checkpoint) -> Future[T]:
        with self._lock:
            if self._pending >= self.threads + self.max_waiting:
                raise OverloadedError(
                    f"request preparation is at capacity ({self._pending} requests being "
                    "rendered or counted); retry later")
            self._pending += 1

        def task() -> T:
            checkpoint()
            return job(checkpoint)

        future = self._pool.submit(task)
        future.add_done_callback(self._done)
        return future

    def _done(self, _: Future[Any]) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        """Stop taking work; jobs waiting are dropped, running ones finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _orphaned(done: asyncio.Future[T], orphan: Callable[[T], None] | None) -> None:
    """Hand a result nobody waits for to ``orphan`` (cancelling a submitted request)."""
    if orphan is None or done.cancelled() or done.exception() is not None:
        return
    orphan(done.result())
