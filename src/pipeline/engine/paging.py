"""The engine's KV memory: block tables per job and the prefix cache, or a backend's own.

Owns :class:`KVMemory`, the one interface the engine asks about KV memory (admit, make room,
publish, roll back, free), and its two implementations: :class:`SlotMemory`, the trivial
adapter for a backend that keeps its own memory per slot (everything fits, nothing is shared
or preempted, no table is passed), and :class:`Paging`, the engine's use of a :class:`~pipeline.engine.blocks.BlockManager` sized
like its :class:`~pipeline.contracts.model.PagedBackend` (``num_blocks`` of ``block_size``, keyed
by the backend's ``snapshot``), with the job-level rules (docs/design.md §6, second edition):

- **admission** (:meth:`Paging.admit`): the tokens a job must have in its cache (its prompt,
  or for a preempted job its prompt and committed output but the pending token) are matched
  against the prefix cache; the cached blocks are shared and only the rest is allocated. A
  job whose blocks do not fit gets None and waits in the queue;
- **growth** (:meth:`Paging.grow`) before each forward that writes past the table's end, and
  **preemption by recompute** (:meth:`Paging.make_room`): when blocks run out, the most
  recently admitted other job gives its blocks back (the engine then takes its slot and
  requeues it; it recomputes its cache when readmitted); a job alone and still short starves;
- **publication** (:meth:`Paging.publish`) of full blocks whose content is final: positions
  before the job's pending token, so rejected drafts and a pending token are never shared;
- **rollback** (:meth:`Paging.truncate`) and **release** (:meth:`Paging.free`, which
  publishes first so a finished conversation's blocks serve the next turn).

A job admitted with a prompt that needs more blocks than the whole pool is refused with
:class:`~pipeline.errors.CapacityError` (waiting would never help).

Example::

    paging = Paging(backend, backend.snapshot)
    hit = paging.admit(job, job.prefill_ids)   # None: wait; else hit.cached_tokens are computed
    room = paging.make_room([(job, job.cache_len + 1)], running=[job])
    ... backend.forward([ModelCall(..., blocks=paging.table(job))]) ...
    paging.publish(job)
    paging.free(job)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Generic, Protocol, TypeVar

import attrs

from pipeline.engine.blocks import BlockManager, BlockStats, PrefixMatch
from pipeline.errors import CapacityError, OutOfBlocks
from pipeline.contracts.model import PagedBackend


class PagedJob(Hashable, Protocol):
    """What paging reads of a job: its prompt, committed output and cache length."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def cache_len(self) -> int: ...


J = TypeVar("J", bound=PagedJob)


@attrs.frozen
class Room(Generic[J]):
    """What :meth:`Paging.make_room` did: the jobs it preempted (each with the blocks it
    held), and the jobs that stay short with nobody left to preempt (each with why)."""

    preempted: tuple[tuple[J, int], ...] = ()
    starved: tuple[tuple[J, str], ...] = ()

    @property
    def dropped(self) -> set[J]:
        """Every job that leaves this step's plan."""
        return {job for job, _ in self.preempted} | {job for job, _ in self.starved}


class KVMemory(Protocol):
    """What the engine asks of KV memory, whoever keeps it (engine thread only)."""

    @property
    def stats(self) -> BlockStats | None:
        """The block counters (None: the backend keeps its memory)."""
        ...

    def admit(self, job: PagedJob, tokens: Sequence[int], reserve: int = 0
              ) -> PrefixMatch | None:
        """Room for ``job``'s ``tokens`` and the cached prefix it reuses; None: wait."""
        ...

    def table(self, job: PagedJob) -> tuple[int, ...] | None:
        """``job``'s block table for its calls (None: the backend needs none)."""
        ...

    def make_room(self, needs: Sequence[tuple[J, int]], running: Sequence[J]) -> Room[J]:
        """Room for each job's length in ``needs``; who was preempted or starved for it."""
        ...

    def publish(self, job: PagedJob) -> None:
        """Share ``job``'s final full blocks with later prompts."""
        ...

    def truncate(self, job: PagedJob) -> None:
        """Shrink ``job``'s memory to its cache length (after a rollback)."""
        ...

    def free(self, job: PagedJob) -> None:
        """Give ``job``'s memory back."""
        ...


class SlotMemory:
    """KV memory a backend keeps per slot (no blocks): the trivial :class:`KVMemory`. Every
    admitted job fits (the slot holds the window), no prefix is shared, nobody is preempted,
    and calls carry no table; the backend's own ``truncate`` and ``release`` do the rest."""

    stats: BlockStats | None = None

    def admit(self, job: PagedJob, tokens: Sequence[int], reserve: int = 0) -> PrefixMatch:
        """Always room, nothing cached."""
        return PrefixMatch()

    def table(self, job: PagedJob) -> None:
        """No table."""
        return None

    def make_room(self, needs: Sequence[tuple[J, int]], running: Sequence[J]) -> Room[J]:
        """Nothing to grow, nobody to preempt."""
        return Room()

    def publish(self, job: PagedJob) -> None:
        """Nothing is shared."""

    def truncate(self, job: PagedJob) -> None:
        """The backend's own truncate did it."""

    def free(self, job: PagedJob) -> None:
        """The backend's own release does it."""


def computed_tokens(job: PagedJob) -> list[int]:
    """The token ids of the positions of ``job``'s cache that are final: the prompt, then
    the committed tokens the cache holds (all but the pending one under autoregressive
    decoding; all of them while a masked-diffusion block is denoised)."""
    done = [*job.prompt_ids, *job.output_ids]
    return done[:job.cache_len]


class Paging:
    """Block tables for the engine's jobs over ``backend``'s pool. Engine thread only."""

    def __init__(self, backend: PagedBackend, snapshot: str) -> None:
        self.blocks = BlockManager(backend.num_blocks, backend.block_size, snapshot=snapshot)
        self._full: dict[PagedJob, int] = {}   # full blocks each job has published so far

    @property
    def stats(self) -> BlockStats:
        """The block manager's counters."""
        return self.blocks.stats

    def admit(self, job: PagedJob, tokens: Sequence[int], reserve: int = 0
              ) -> PrefixMatch | None:
        """A table for ``job`` covering ``tokens`` (what it must have in its cache), reusing
        the longest cached prefix; None (and nothing allocated) when the blocks do not fit
        with ``reserve`` blocks left over (room for the running jobs' next blocks, so that
        admitting one does not force a preemption at the next step). Raises
        :class:`~pipeline.errors.CapacityError` when ``tokens`` need more blocks than the
        whole pool holds."""
        if not self.fits_alone(tokens):
            raise CapacityError(f"the prompt needs {self.blocks.blocks_for(len(tokens))} KV "
                                f"blocks, more than the pool's {self.blocks.num_blocks}")
        hit = self.blocks.match(tokens)
        if not self.blocks.can_allocate(len(tokens) + reserve * self.blocks.block_size, hit):
            return None
        self.blocks.allocate(job, len(tokens), prefix=hit)
        return hit

    def fits_alone(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` fit an otherwise empty pool."""
        return self.blocks.blocks_for(len(tokens)) <= self.blocks.num_blocks

    def table(self, job: PagedJob) -> tuple[int, ...]:
        """``job``'s block table."""
        return self.blocks.table(job)

    def grow(self, job: PagedJob, length: int) -> tuple[int, ...]:
        """``job``'s table covering at least ``length`` positions; raises
        :class:`~pipeline.errors.OutOfBlocks` (changing nothing) when memory runs out."""
        if length > self.blocks.length(job):
            return self.blocks.grow(job, length)
        return self.blocks.table(job)

    def make_room(self, needs: Sequence[tuple[J, int]], running: Sequence[J]) -> Room[J]:
        """Grow each job's table to cover its length in ``needs``, in order. When blocks run
        out, the most recently admitted job of ``running`` other than the one growing is
        preempted (its blocks published and freed; a preempted job's own need is skipped) and
        the growth is tried again; a job with nobody left to preempt starves."""
        running = list(running)
        preempted: list[tuple[J, int]] = []
        starved: list[tuple[J, str]] = []
        for job, length in needs:
            if any(job is victim for victim, _ in preempted):
                continue
            while True:
                try:
                    self.grow(job, length)
                    break
                except OutOfBlocks as exc:
                    victims = [j for j in running if j is not job]
                    if not victims:
                        starved.append((job, str(exc)))
                        break
                    victim = victims[-1]
                    preempted.append((victim, len(self.table(victim))))
                    self.free(victim)
                    running.remove(victim)
        return Room(tuple(preempted), tuple(starved))

    def publish(self, job: PagedJob) -> None:
        """Make ``job``'s full, final blocks reusable by later prompts (cheap when no block
        filled up since the last call: the token list is built only when one did)."""
        if job not in self.blocks:
            return
        if job.cache_len // self.blocks.block_size > self._full.get(job, 0):
            tokens = computed_tokens(job)
            self.blocks.publish(job, tokens)
            self._full[job] = len(tokens) // self.blocks.block_size

    def truncate(self, job: PagedJob) -> None:
        """Shrink ``job``'s table to its cache length (after a rollback)."""
        if job in self.blocks and self.blocks.length(job) > job.cache_len:
            self.blocks.truncate(job, job.cache_len)

    def free(self, job: PagedJob) -> None:
        """Publish, then release ``job``'s blocks (cached ones stay for reuse)."""
        if job in self.blocks:
            self.publish(job)
            self.blocks.free(job)
        self._full.pop(job, None)
