"""A parallel group as the engine process: rank 0 is the engine, the other ranks its followers.

Owns :class:`Followers` (ranks 1 … N−1, started and watched by the server) and
:func:`group_env`. ``pipeline serve --ranks N`` (``ServerConfig.ranks``) runs the engine of
:mod:`pipeline.runtime.parent` as rank 0 of a ``torch.distributed`` group of N processes on
this machine — the variables ``torchrun`` would set (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) given by this process instead — so the
model is split over the ranks as under ``torchrun`` (:mod:`backends.torch.parallel`), while
the server itself holds no rank and outlives the group.

**Supervision.** The group lives and dies as one. A follower that exits while the group is
up (killed, crashed, out of memory) is seen at once by a watcher thread here, even while the
engine is idle and no collective would notice: the engine is abandoned (its requests end
with the engine-down error, ``/health`` says ``restarting``, the rank 0 process is killed) and
the server's supervision starts a whole fresh group — every rank a new process, on a fresh
port, so nothing of the lost group's connections is reused — ``restart_delay_s`` later. A
lost rank 0 is the engine process's own death. Followers end when rank 0 does (their call
channel closes) and are killed with it.

Each follower is ``python -c`` importing this module (never the server's main script), with
the server's import path; the recipe arrives on its standard input, pickled as the engine
process's is, and it builds it exactly as rank 0 does: under the group's variables
``build()`` loads this rank's part and serves rank 0's calls until the group ends
(:func:`~backends.torch.parallel.parallel_backend`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from pipeline.runtime.wire import loads

log = logging.getLogger("pipeline.engine")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (rank 0's store binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def group_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of a group of ``world`` on this machine: the
    server's own, plus what ``torchrun`` would set."""
    return {**os.environ, "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class Followers:
    """Ranks 1 … ``world``−1 of one group, started by :meth:`spawn`; :meth:`watch` reports
    the first that exits on its own."""

    def __init__(self, popens: list[subprocess.Popen[bytes]]) -> None:
        self.popens = popens
        self._stopping = threading.Event()

    @classmethod
    def spawn(cls, recipe: bytes, world: int, port: int) -> Followers:
        """Start ranks 1 … ``world``−1, each given the pickled ``recipe`` on its standard
        input; ranks already started are killed if a later one fails to start."""
        boot = (f"import sys; sys.path[:0] = {sys.path!r}; "
                "from pipeline.runtime.ranks import follower_entry; follower_entry()")
        popens: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, world):
                popen = subprocess.Popen([sys.executable, "-c", boot], stdin=subprocess.PIPE,
                                         env=group_env(rank, world, port))
                popens.append(popen)
                assert popen.stdin is not None
                with popen.stdin:
                    popen.stdin.write(recipe)
        except BaseException:
            cls(popens).stop()
            raise
        return cls(popens)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.popens]

    def exited(self) -> tuple[int, int] | None:
        """``(rank, exit code)`` of the first follower that has exited, else None."""
        for rank, popen in enumerate(self.popens, 1):
            code = popen.poll()
            if code is not None:
                return rank, code
        return None

    def watch(self, lost: Callable[[int, int], None]) -> None:
        """Call ``lost(rank, exit code)`` (once, on a watcher thread) when a follower exits
        before :meth:`stop`."""
        reported = threading.Lock()

        def wait(rank: int, popen: subprocess.Popen[bytes]) -> None:
            code = popen.wait()
            if not self._stopping.is_set() and reported.acquire(blocking=False):
                lost(rank, code)

        for rank, popen in enumerate(self.popens, 1):
            threading.Thread(target=wait, args=(rank, popen), daemon=True,
                             name=f"pipeline-rank-{rank}").start()

    def stop(self, timeout: float = 5.0) -> None:
        """Kill every follower and reap it (idempotent; a stopped process ends too)."""
        self._stopping.set()
        for popen in self.popens:
            with contextlib.suppress(OSError):
                popen.kill()
        for popen in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout)


def follower_entry() -> None:
    """A follower's start: the recipe from standard input, then ``build()`` under the
    group's variables, which serves rank 0 and ends this process when the group ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the server's
    recipe: Any = loads(sys.stdin.buffer.read())
    for prepare in recipe.setup:
        prepare()
    from pipeline.builder import build

    build(recipe.model, options=recipe.options, **recipe.build_args)
    log.error("rank %s: the recipe built no parallel backend; this rank ends",
              os.environ.get("RANK"))
    sys.exit(1)
