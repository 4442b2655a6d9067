"""The engine's KV memory over a paged backend: block tables per job and the prefix cache.

Owns :class:`Paging`, the engine's use of a :class:`~pipeline.blocks.BlockManager` sized
like its :class:`~pipeline.protocols.PagedBackend` (``num_blocks`` of ``block_size``, keyed
by the backend's ``snapshot``), with the job-level rules (DESIGN §6, second edition):

- **admission** (:meth:`Paging.admit`): the tokens a job must have in its cache (its prompt,
  or for a preempted job its prompt and committed output but the pending token) are matched
  against the prefix cache; the cached blocks are shared and only the rest is allocated. A
  job whose blocks do not fit gets None and waits in the queue;
- **growth** (:meth:`Paging.grow`) before each forward that writes past the table's end;
  :class:`~pipeline.errors.OutOfBlocks` tells the engine to preempt;
- **publication** (:meth:`Paging.publish`) of full blocks whose content is final: positions
  before the job's pending token, so rejected drafts and a pending token are never shared;
- **rollback** (:meth:`Paging.truncate`) and **release** (:meth:`Paging.free`, which
  publishes first so a finished conversation's blocks serve the next turn).

Example::

    paging = Paging(backend)
    hit = paging.admit(job)             # None: wait; else hit.cached_tokens are computed
    table = paging.grow(job, job.cache_len + 1)
    ... backend.forward([ModelCall(..., blocks=table)]) ...
    paging.publish(job)
    paging.free(job)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from pipeline.blocks import BlockManager, PrefixMatch
from pipeline.protocols import PagedBackend


class PagedJob(Hashable, Protocol):
    """What paging reads of a job: its prompt, committed output and cache length."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...

    @property
    def output_ids(self) -> Sequence[int]: ...

    @property
    def cache_len(self) -> int: ...


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

    def admit(self, job: PagedJob, tokens: Sequence[int], reserve: int = 0
              ) -> PrefixMatch | None:
        """A table for ``job`` covering ``tokens`` (what it must have in its cache), reusing
        the longest cached prefix; None (and nothing allocated) when the blocks do not fit
        with ``reserve`` blocks left over (room for the running jobs' next blocks, so that
        admitting one does not force a preemption at the next step)."""
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
