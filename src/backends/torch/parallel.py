"""Tensor and expert parallelism for the torch backend over ``torch.distributed``.

Owns :func:`join_group`, :class:`ParallelTorchBackend` (rank 0's backend) and
:func:`serve_rank` (every other rank's loop). A group of W ranks — processes started by
``torchrun --nproc-per-node W``, gloo on CPUs, NCCL on GPUs — holds one model split as
:mod:`backends.torch.shard` says: each rank reads only its part of the weights, keeps only its
heads' KV cache, and sums each attention and MLP output over the group with one all-reduce
(:class:`~backends.torch.model.Transformer`'s ``reduce``). Every rank ends a forward with the
whole logits; rank 0's are the ones used.

Numerics: a row's logits differ from one process's by the order of the sums (within 1e-5
of their scale in float32, tested). With two ranks they do not depend on the batch (a sum of
two terms is the same either way round); with more, the collective's order of summation is
the library's (gloo's, NCCL's), and batch invariance is not claimed.

Rank 0 runs everything else — the engine and its scheduler, the API, the trace — over a
:class:`ParallelTorchBackend`. Before each call that touches the model or its cache
(``allocate``, ``release``, ``truncate``, ``forward``, ``hidden_states``) it broadcasts the
call to the other ranks, which make the same call on their part (:func:`serve_rank`), so all
ranks walk the same slots and blocks and meet in the same collectives. A call a rank refuses
(a bad slot, say) is refused by every rank alike, before any collective.

**A rank's death.** The next collective on rank 0 fails (gloo sees the closed connection at
once; otherwise the group's ``timeout`` bounds it) and the backend raises
:class:`~pipeline.errors.DeviceFault` naming it: the engine stops, its requests fail with
``the engine stopped: ...``, and ``/health`` says so; every later call fails at once with the
same reason (``broken``). The group cannot be mended; it must be started again. The other ranks
end when rank 0 closes the group or dies. Under ``torchrun`` the agent itself stops the whole
group when one rank dies (after rank 0 has failed its requests), and ``--max-restarts N``
starts it again; ranks started by another launcher with torchrun's variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``) leave rank 0 serving its
``/health``.

Example (``torchrun --nproc-per-node 2 script.py``; every rank runs the same script)::

    group = join_group()                       # Shard(rank, world) from torchrun's variables
    backend = parallel_backend("model/", group, num_slots=4, max_context=512)
    # ranks > 0 serve inside parallel_backend() and exit when rank 0 closes the group
    logits = backend.prefill([PrefillChunk(backend.allocate(), ids, 0, True)])
    backend.close()
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from backends.torch.backend import TorchBackend
from backends.torch.shard import Shard
from pipeline.errors import out_of_memory
from pipeline.errors import DeviceFault, InvalidValueError, PipelineError
from pipeline.contracts.model import ModelCall

log = logging.getLogger("pipeline.parallel")

GROUP_TIMEOUT_S = 60.0
"""The longest a step's collective waits for a rank that does not answer (a rank whose
connection closes is seen at once)."""
CONTROL_TIMEOUT = datetime.timedelta(days=365)
"""How long a rank other than 0 waits for rank 0's next call: without bound in practice (a
server may idle for hours); rank 0's death still closes the connection at once."""
_CONTROL: list[Any] = []
"""The call channel: a gloo group of its own with :data:`CONTROL_TIMEOUT`, so an idle wait
never meets the step collectives' timeout (set by :func:`join_group`)."""
_SERVED: list[str] = []
"""The model this process's group holds (a group holds one)."""


def launched_world() -> tuple[int, int] | None:
    """``(rank, world)`` when this process was started by ``torchrun`` with more than one
    rank (its ``RANK`` and ``WORLD_SIZE``), else None."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    return int(os.environ["RANK"]), world


def join_group(timeout_s: float = GROUP_TIMEOUT_S, device: str = "cpu") -> Shard:
    """Join the process group ``torchrun`` described (gloo on a CPU, NCCL on a CUDA device;
    once per process) and return this rank's :class:`Shard`."""
    place = launched_world()
    if place is None:
        raise DeviceFault("no parallel group: start the ranks with torchrun --nproc-per-node N")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.startswith("cuda"):  # one device a rank, current before NCCL starts
            torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl", timeout=timeout,
                                    device_id=torch.device(device))
        else:
            dist.init_process_group("gloo", timeout=timeout)
        _CONTROL[:] = [dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)]
    return Shard(dist.get_rank(), dist.get_world_size())


def _control() -> Any:
    return _CONTROL[0] if _CONTROL else None


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over the group (in place; returned for chaining)."""
    dist.all_reduce(tensor)
    return tensor


class ParallelTorchBackend(TorchBackend):
    """Rank 0's backend of a parallel group: a :class:`TorchBackend` over this rank's part
    whose model calls are broadcast to the other ranks first (module docstring)."""

    closed = False
    broken: str | None = None
    """Why the group cannot be used any more (a rank stopped answering): every later call
    fails at once with it, so a restarted engine reports it instead of waiting again."""

    def _tell(self, op: str, *args: Any) -> None:
        """Broadcast ``op(*args)`` to the other ranks; a rank that is gone is a
        :class:`DeviceFault`."""
        if self.broken is not None:
            raise DeviceFault(self.broken)
        if self.closed:
            raise DeviceFault("the parallel group is closed")
        try:
            dist.broadcast_object_list([(op, args)], src=0, group=_control())
        except Exception as exc:
            raise self._lost(exc) from exc

    def _lost(self, exc: BaseException) -> DeviceFault:
        self.broken = (f"a rank of the parallel group stopped answering ({exc}); the group "
                       "cannot go on: start it again")
        log.error("%s", self.broken)
        return DeviceFault(self.broken)

    def _mirrored(self, op: str, *args: Any) -> Any:
        self._tell(op, *args)
        try:
            return getattr(TorchBackend, op)(self, *args)
        except PipelineError:
            raise
        except RuntimeError as exc:
            if out_of_memory(exc):
                raise  # as in one process: this step failed; if a rank went on past it,
                # the next collective's timeout says so
            raise self._lost(exc) from exc  # a collective failed: the group cannot be trusted

    def allocate(self) -> int:
        result: int = self._mirrored("allocate")
        return result

    def release(self, slot: int) -> None:
        self._mirrored("release", slot)

    def truncate(self, slot: int, length: int) -> None:
        self._mirrored("truncate", slot, length)

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        result: torch.Tensor = self._mirrored("forward", list(calls))
        return result

    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        result: torch.Tensor = self._mirrored("hidden_states", list(token_ids))
        return result

    def probe(self, rows: int, count: int, payload: Any = None) -> float:
        """Seconds the group's communication of one step takes without its compute: one
        broadcast (carrying ``payload``, e.g. the step's calls) and ``count`` all-reduces of
        ``[rows, H]`` (a step makes two a layer); also a check that every rank answers (a
        :class:`DeviceFault` if not)."""
        start = time.perf_counter()
        self._tell("probe", rows, count, payload)
        try:
            _probe(self, rows, count)
        except RuntimeError as exc:
            raise self._lost(exc) from exc
        return time.perf_counter() - start

    def close(self) -> None:
        """Tell the other ranks to end (idempotent; also run at exit)."""
        if not self.closed and self.broken is None:
            try:
                self._tell("close")
            except DeviceFault:
                pass
            self.closed = True


_CALLS = ("allocate", "release", "truncate", "forward", "hidden_states")


def serve_rank(backend: TorchBackend) -> bool:
    """A rank other than 0: make each call rank 0 broadcasts on this rank's part, until it
    says close (True) or is gone (False). A call that fails here fails on rank 0 alike (the
    same refusal, the same out-of-memory step); should it not, the step's next collective
    times out on rank 0, which then says the group is broken."""
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=_control())
        except Exception as exc:  # rank 0 is gone
            log.error("rank %d: rank 0 stopped answering: %s", dist.get_rank(), exc)
            return False
        op, args = box[0]
        if op == "close":
            return True
        try:
            if op == "probe":
                _probe(backend, args[0], args[1])
            elif op in _CALLS:
                getattr(TorchBackend, op)(backend, *args)
            else:
                log.error("rank %d: unknown call %r from rank 0", dist.get_rank(), op)
                return False
        except Exception as exc:
            log.warning("rank %d: %s failed here as on rank 0: %r", dist.get_rank(), op, exc)


def _probe(backend: TorchBackend, rows: int, count: int) -> None:
    """``count`` all-reduces of a ``[rows, H]`` tensor of the model's dtype (every rank)."""
    model = backend.model
    x = torch.zeros(rows, model.spec.hidden_size, dtype=model.dtype,
                    device=model.weights.embed.device)
    for _ in range(count):
        all_reduce(x)


def parallel_backend(path: str | Path, shard: Shard, **options: Any) -> ParallelTorchBackend:
    """This rank's part of the model at ``path`` (``options``: :meth:`TorchBackend.from_dir`'s).
    Rank 0 gets its :class:`ParallelTorchBackend`; every other rank serves rank 0's calls
    here and then ends the process (it never returns), as a worker of the group should."""
    if _SERVED:  # a second model (a speculative draft, say) would share the call channel
        raise InvalidValueError("model", str(path), f"this process's parallel group holds "
                                f"{_SERVED[0]} already; a group holds one model (load a draft "
                                "model without torchrun, or use n-gram drafts)")
    _SERVED.append(str(path))
    if shard.rank == 0:
        backend = ParallelTorchBackend.from_dir(path, shard=shard, reduce=all_reduce, **options)
        assert isinstance(backend, ParallelTorchBackend)
        atexit.register(backend.close)
        return backend
    worker = TorchBackend.from_dir(path, shard=shard, reduce=all_reduce, **options)
    closed = serve_rank(worker)
    if closed and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(0 if closed else 1)  # 1: the launcher sees a failed rank (--max-restarts)
