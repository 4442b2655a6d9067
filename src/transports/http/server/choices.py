"""A request's choices: the ``n`` generations one HTTP request asks for, run together.

Owns the seed rule (:func:`choice_requests`: choice ``i`` of a prompt is the request with seed
``(seed + i) mod 2**63``, or, without a seed, a seed of its own derived from its own request
id), the request's usage (:func:`total_usage`: each prompt counted once, the completions
summed), :class:`Choices` (collects the completions on the engine thread and hands them over
once all are in, so the request's usage is one record), and :func:`merged` (the choices'
deltas interleaved as they arrive, for one stream). The choices are submitted one after the
other without waiting, so the engine batches them like any concurrent requests.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence

import attrs

from pipeline.engine.handle import RequestHandle
from pipeline.contracts.transport import Transport
from pipeline.contracts.output import Completion, Delta, Usage
from pipeline.contracts.request import Request
from transports.http.server.inbox import batches

SEED_SPACE = 1 << 63
_QUIET_S = 1e9  # the pumps of a merged stream never ping; the merge does


def choice_requests(requests: Sequence[Request], n: int, base_id: str) -> list[Request]:
    """The choices of ``requests`` (one per prompt), ``n`` per prompt, in response order.

    Choice ``k = p * n + i`` (prompt ``p``, ``i`` below ``n``) gets request id
    ``f"{base_id}-{k}"`` and, when its prompt's request has a seed, seed ``seed + i`` (mod
    2**63); without one each choice draws its own seed from its own id. A single choice is
    the request itself, id and seed unchanged.
    """
    if n == 1 and len(requests) == 1:
        return [requests[0]]
    out = []
    for p, request in enumerate(requests):
        config = request.generation_config
        for i in range(n):
            seed = None if config.seed is None else (config.seed + i) % SEED_SPACE
            out.append(attrs.evolve(request, request_id=f"{base_id}-{p * n + i}",
                                    generation_config=attrs.evolve(config, seed=seed)))
    return out


def total_usage(completions: Sequence[Completion], n: int) -> Usage:
    """One request's usage: each prompt once (the first choice of every ``n``), the
    completions summed."""
    firsts = completions[::n]
    return Usage(sum(c.usage.prompt_tokens for c in firsts),
                 sum(c.usage.completion_tokens for c in completions),
                 sum(c.usage.cached_tokens for c in firsts))


class Choices:
    """Collects the completions of a request's choices; calls ``on_all`` with them (in
    choice order) once every choice that started has finished. Thread-safe."""

    def __init__(self, expected: int, on_all: Callable[[list[Completion]], None]) -> None:
        self._expected = expected
        self._on_all = on_all
        self._got: dict[int, Completion] = {}
        self._lock = threading.Lock()
        self._fired = False

    def add(self, index: int, completion: Completion) -> None:
        """Choice ``index`` finished (any way: done, cancelled, failed)."""
        with self._lock:
            self._got[index] = completion
        self._maybe_fire()

    def started(self, count: int) -> None:
        """Only the first ``count`` choices were started (submitting the next one failed)."""
        with self._lock:
            self._expected = count
        self._maybe_fire()

    def _maybe_fire(self) -> None:
        with self._lock:
            ready = not self._fired and 0 < self._expected <= len(self._got)
            if ready:
                self._fired = True
            completions = [self._got[i] for i in sorted(self._got)][:self._expected]
        if ready:
            self._on_all(completions)


async def merged(handles: Sequence[RequestHandle], ping_s: float,
                 transport: Transport[AsyncIterator[Delta]] | None = None
                 ) -> AsyncIterator[tuple[int, Delta] | None]:
    """``(choice index, delta)`` from every handle as they arrive (each choice's deltas in
    order, through ``transport``: the pipeline's asyncio transport stage), ``None`` after
    ``ping_s`` of silence from all of them; ends when every choice has ended. Leaving early
    cancels every choice still running."""
    if len(handles) == 1:
        async for delta in batches(handles[0], ping_s, transport):
            yield None if delta is None else (0, delta)
        return
    queue: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for delta in batches(handle, _QUIET_S, transport):
                if delta is not None:
                    queue.put_nowait((index, delta))
        finally:
            queue.put_nowait((index, None))  # this choice has ended

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    running = len(handles)
    try:
        while running:
            try:
                index, delta = await asyncio.wait_for(queue.get(), ping_s)
            except asyncio.TimeoutError:
                yield None
                continue
            if delta is None:
                running -= 1
            else:
                yield index, delta
    finally:
        for task in tasks:  # a pump left running cancels its choice as it unwinds
            task.cancel()
