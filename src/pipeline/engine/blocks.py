"""The engine-side KV block manager: block tables, reference counts and the prefix cache.

Owns the bookkeeping of KV memory as ``num_blocks`` blocks of ``block_size`` positions each
(docs/design.md §6, second edition), in pure Python: which blocks are free, which sequence holds
which, and which hold content that later requests may reuse. The memory itself lives in a
backend (a :class:`~pipeline.contracts.model.PagedBackend`); this module only hands out block ids.

A sequence (any hashable id) holds a *block table*: block ``table[i]`` holds its positions
``i*block_size .. (i+1)*block_size - 1``. ``allocate`` gives a new sequence a table for its
first tokens, ``grow`` extends it as the sequence grows (:class:`~pipeline.errors.OutOfBlocks`
when memory runs out, so the engine can preempt), ``truncate`` frees whole trailing blocks
(rolling back rejected drafts) and ``free`` releases the sequence.

**Prefix cache.** A full block is content-addressed by a hash chain
``h_i = H(h_{i-1}, token ids of block i, model snapshot)`` (:func:`block_hash`: BLAKE2b,
16 bytes, the same in every process; ``h_{-1}`` is empty). ``publish`` registers a
sequence's full blocks once their positions are computed; ``match`` finds, for a new prompt,
the longest chain of published blocks that starts it, and ``allocate(..., prefix=match)``
takes references on them. Because the snapshot is in every hash, two models never share a
block. **A match never covers the whole prompt**: it stops at ``(len(tokens) - 1) //
block_size`` blocks, so at least one prompt token is left to compute and yield logits.

A block is in exactly one of three states::

    free ──allocate/grow──▶ referenced ──last reference dropped──▶ free      (never published)
                              ▲     └───────────────────────────▶ cached    (published)
                              └──────── match + allocate ◀────── cached ──evicted──▶ free

A cached block (published, no reference) keeps its content and hash until its memory is
needed: ``allocate``/``grow`` take free blocks first, then evict the least recently released
cached block and forget its hash. A referenced block is never evicted. When a sequence is
freed its cached blocks join the LRU list tail first, so a chain's tail goes before its head.

**Placement.** A backend reads a table that is one run of consecutive blocks as a view and
gathers (copies) any other, so free blocks are placed to keep tables in few runs: a sequence
grows into the block after its last one when that is free; otherwise it starts a new run in
the largest stretch of free blocks, at its start when the stretch starts the pool or the run
fills it, else in its middle (aligned to the run's length), leaving room on both sides for
the neighbours to grow. Equal-sized allocations (one window per slot) thus pack without
fragmenting, and interleaved growth of a batch stays contiguous while there is room.

**Invariants** (:meth:`BlockManager.check` verifies all of them):

1. every block is in exactly one of *free*, *cached* (published and unreferenced, in LRU
   order) and *referenced*; their union is all ``num_blocks`` blocks;
2. a block's reference count equals the number of tables holding it; no table holds a block
   twice;
3. a table covers its sequence: ``len(table) == ceil(length / block_size)``;
4. the hash index and the blocks' hashes are inverse maps; free blocks have no hash;
5. a sequence's chain hashes cover at most its full blocks, and where its block is published
   the block's hash is the sequence's chain hash at that index;
6. published blocks are never written: a caller writes only positions at or after a
   sequence's computed length, and ``truncate`` into a published block unpublishes it (when
   the sequence is its only holder) or refuses (when others share it).

Example::

    kv = BlockManager(num_blocks=1024, block_size=16, snapshot=backend.snapshot)
    hit = kv.match(prompt)                        # hit.cached_tokens are already computed
    table = kv.allocate("req-1", len(prompt), prefix=hit)
    ... compute positions hit.cached_tokens .. len(prompt)-1 into table's blocks ...
    kv.publish("req-1", prompt)                   # its full blocks become reusable
    table = kv.grow("req-1", len(prompt) + 1)     # room for the next token
    kv.free("req-1")
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import attrs

from pipeline.errors import InvalidValueError, OutOfBlocks
from pipeline.options import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE  # the manager's default


def block_hash(parent: bytes, token_ids: Sequence[int], snapshot: str) -> bytes:
    """The chain hash of a full block: BLAKE2b-128 over the parent's hash (empty for a
    sequence's first block), the model snapshot and the block's token ids (little-endian
    int64). Deterministic across processes and machines."""
    h = hashlib.blake2b(digest_size=16, person=b"pipeline.kv")
    name = snapshot.encode()
    h.update(struct.pack("<B", len(parent)) + parent)
    h.update(struct.pack("<Q", len(name)) + name)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@attrs.frozen
class PrefixMatch:
    """The longest cached chain that starts a prompt: ``blocks`` (their ids, in order) hold its
    first ``cached_tokens`` positions; ``hashes`` are their chain hashes. Pass it to
    :meth:`BlockManager.allocate` before anything else allocates (an eviction in between
    makes it stale, and ``allocate`` says so)."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    cached_tokens: int = 0


@attrs.frozen
class BlockStats:
    """Counters for tests and metrics.

    ``free_blocks`` can be allocated now (free or cached-unreferenced); ``cached_blocks`` of
    them still hold published content; ``used_blocks`` are referenced. ``allocations`` counts
    sequences allocated, ``hits`` those that reused at least one cached block,
    ``cached_tokens`` the positions reused in all, ``published`` blocks ever registered and
    ``evictions`` cached blocks whose hash was forgotten to reuse their memory.
    """

    num_blocks: int
    block_size: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    allocations: int
    hits: int
    cached_tokens: int
    published: int
    evictions: int


@attrs.define
class _Sequence:
    table: list[int]
    length: int
    hashes: list[bytes]


class BlockManager:
    """Block tables, reference counts and the prefix cache over ``num_blocks`` blocks of
    ``block_size`` positions, for the model whose content digest is ``snapshot``.

    Not thread-safe: the engine's thread owns it. Every method either does all it says or
    raises before changing anything.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                 snapshot: str) -> None:
        if num_blocks < 1:
            raise InvalidValueError("num_blocks", num_blocks, "must be >= 1")
        if block_size < 1:
            raise InvalidValueError("block_size", block_size, "must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.snapshot = snapshot
        self._free = bytearray(b"\x01" * num_blocks)              # 1: block is free
        self._nfree = num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()    # LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._seqs: dict[Hashable, _Sequence] = {}
        self._counts = dict(allocations=0, hits=0, cached_tokens=0, published=0, evictions=0)

    # --- queries ---------------------------------------------------------------------------

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._seqs

    def table(self, seq: Hashable) -> tuple[int, ...]:
        """``seq``'s block table."""
        return tuple(self._get(seq).table)

    def length(self, seq: Hashable) -> int:
        """Positions ``seq``'s table covers (what ``allocate``/``grow``/``truncate`` set)."""
        return self._get(seq).length

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` positions."""
        return -(-n_tokens // self.block_size)

    @property
    def available(self) -> int:
        """Blocks that can be allocated now: free ones, then cached ones by eviction."""
        return self._nfree + len(self._cached)

    @property
    def stats(self) -> BlockStats:
        """The counters now."""
        return BlockStats(self.num_blocks, self.block_size, self.available, len(self._cached),
                          self.num_blocks - self.available, **self._counts)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest chain of published blocks that starts ``tokens``, leaving at least one
        token uncovered (so its logits get computed). Read-only: takes no reference."""
        bs, parent = self.block_size, b""
        blocks: list[int] = []
        hashes: list[bytes] = []
        for i in range(max(len(tokens) - 1, 0) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk, self.snapshot)
            block = self._block_of.get(parent)
            if block is None or self._tokens_of[block] != chunk:   # absent, or a collision
                break
            blocks.append(block)
            hashes.append(parent)
        return PrefixMatch(tuple(blocks), tuple(hashes), len(blocks) * bs)

    def can_allocate(self, n_tokens: int, prefix: PrefixMatch | None = None) -> bool:
        """Whether :meth:`allocate` of ``n_tokens`` positions (reusing ``prefix``) would fit."""
        prefix = self._checked_prefix(prefix or PrefixMatch(), n_tokens)
        return self._new_blocks(n_tokens, prefix) <= self._room(prefix)

    # --- changes ---------------------------------------------------------------------------

    def allocate(self, seq: Hashable, n_tokens: int,
                 prefix: PrefixMatch | None = None) -> tuple[int, ...]:
        """A table for the new sequence ``seq`` covering ``n_tokens`` positions, starting with
        ``prefix``'s cached blocks (a reference on each). Raises
        :class:`~pipeline.errors.OutOfBlocks` when the rest does not fit."""
        if seq in self._seqs:
            raise InvalidValueError("seq", seq, "already has a block table; grow or free it")
        prefix = self._checked_prefix(prefix or PrefixMatch(), n_tokens)
        need, room = self._new_blocks(n_tokens, prefix), self._room(prefix)
        if need > room:
            raise OutOfBlocks(need, room)
        for block in prefix.blocks:
            self._cached.pop(block, None)
            self._refs[block] += 1
        table = list(prefix.blocks)
        self._take(table, need)
        self._seqs[seq] = _Sequence(table, n_tokens, list(prefix.hashes))
        self._counts["allocations"] += 1
        if prefix.blocks:
            self._counts["hits"] += 1
            self._counts["cached_tokens"] += prefix.cached_tokens
        return tuple(table)

    def grow(self, seq: Hashable, new_length: int) -> tuple[int, ...]:
        """Extend ``seq`` to cover ``new_length`` positions; its table after. Raises
        :class:`~pipeline.errors.OutOfBlocks` (and changes nothing) when blocks run out."""
        s = self._get(seq)
        if new_length < s.length:
            raise InvalidValueError("new_length", new_length,
                                    f"below the sequence's {s.length} positions; grow never "
                                    "shrinks (use truncate)")
        need = self.blocks_for(new_length) - len(s.table)
        if need > self.available:
            raise OutOfBlocks(need, self.available)
        self._take(s.table, need)
        s.length = new_length
        return tuple(s.table)

    def truncate(self, seq: Hashable, length: int) -> None:
        """Keep ``seq``'s first ``length`` positions, freeing whole trailing blocks.

        A kept last block that is now partial will be written again, so if it was published
        its hash is forgotten; if other sequences share it that would corrupt them, and this
        raises :class:`~pipeline.errors.InvalidValueError` instead.
        """
        s = self._get(seq)
        if not 0 <= length <= s.length:
            raise InvalidValueError("length", length,
                                    f"must be in 0..{s.length} (the sequence's length)")
        keep = self.blocks_for(length)
        last = s.table[keep - 1] if length % self.block_size else None
        if last is not None and last in self._hash_of:
            if self._refs[last] > 1:
                raise InvalidValueError(
                    "length", length,
                    f"cuts into block {last}, which {self._refs[last]} sequences share; "
                    f"truncate to a block boundary ({length // self.block_size * self.block_size})"
                    " and recompute the rest")
            self._unpublish(last)
        self._release(s.table[keep:])
        del s.table[keep:]
        del s.hashes[length // self.block_size:]
        s.length = length

    def free(self, seq: Hashable) -> None:
        """Release ``seq``: its blocks lose a reference; published ones stay cached, tail
        first in the eviction order."""
        self._release(self._get(seq).table)
        del self._seqs[seq]

    def publish(self, seq: Hashable, tokens: Sequence[int]) -> int:
        """Register ``seq``'s full blocks among its first ``len(tokens)`` positions, whose token
        ids are ``tokens`` (starting with those published before); returns how many blocks
        became reusable. Only positions actually computed may be published."""
        s = self._get(seq)
        if len(tokens) > s.length:
            raise InvalidValueError("tokens", f"{len(tokens)} tokens",
                                    f"the sequence covers {s.length} positions; publish only "
                                    "positions that are computed")
        bs, new = self.block_size, 0
        parent = s.hashes[-1] if s.hashes else b""
        for i in range(len(s.hashes), len(tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            parent = block_hash(parent, chunk, self.snapshot)
            s.hashes.append(parent)
            block = s.table[i]
            if parent in self._block_of or block in self._hash_of:
                continue        # the same content is cached in another block already
            self._block_of[parent], self._hash_of[block] = block, parent
            self._tokens_of[block] = chunk
            new += 1
        self._counts["published"] += new
        return new

    # --- invariants ------------------------------------------------------------------------

    def check(self) -> None:
        """Verify the module docstring's invariants 1-5; raise ``AssertionError`` naming the
        first that fails (for tests and debugging; O(blocks + table entries))."""
        free, cached = {b for b, f in enumerate(self._free) if f}, set(self._cached)
        _require(len(free) == self._nfree, "the free count is wrong")
        referenced = {b for b in range(self.num_blocks) if self._refs[b] > 0}
        _require(not (free & cached or free & referenced or cached & referenced),
                 "free, cached and referenced blocks overlap")
        _require(free | cached | referenced == set(range(self.num_blocks)),
                 "some block is neither free, cached nor referenced")
        holders = [0] * self.num_blocks
        for seq, s in self._seqs.items():
            _require(len(set(s.table)) == len(s.table), f"sequence {seq!r} holds a block twice")
            _require(len(s.table) == self.blocks_for(s.length),
                     f"sequence {seq!r}: {len(s.table)} blocks for {s.length} positions")
            _require(len(s.hashes) <= s.length // self.block_size,
                     f"sequence {seq!r} has chain hashes beyond its full blocks")
            for i, block in enumerate(s.table):
                holders[block] += 1
                if block in self._hash_of and i < len(s.hashes):
                    _require(self._hash_of[block] == s.hashes[i],
                             f"sequence {seq!r}: block {block} is published with another hash")
        _require(holders == self._refs, "a reference count differs from its holders' number")
        _require(all(b in self._hash_of for b in cached), "a cached block has no hash")
        _require(not any(b in self._hash_of for b in free), "a free block has a hash")
        _require({h: b for b, h in self._hash_of.items()} == self._block_of
                 and set(self._tokens_of) == set(self._hash_of),
                 "the hash index and the blocks' hashes disagree")

    # --- internals -------------------------------------------------------------------------

    def _get(self, seq: Hashable) -> _Sequence:
        found = self._seqs.get(seq)
        if found is None:
            raise InvalidValueError("seq", seq, "has no block table")
        return found

    def _checked_prefix(self, prefix: PrefixMatch, n_tokens: int) -> PrefixMatch:
        if n_tokens < prefix.cached_tokens:
            raise InvalidValueError("n_tokens", n_tokens,
                                    f"below the {prefix.cached_tokens} cached tokens it reuses")
        for block, h in zip(prefix.blocks, prefix.hashes, strict=True):
            if self._hash_of.get(block) != h:
                raise InvalidValueError("prefix", f"block {block}",
                                        "no longer holds the matched content (evicted since "
                                        "the match); match again")
        return prefix

    def _new_blocks(self, n_tokens: int, prefix: PrefixMatch) -> int:
        return self.blocks_for(n_tokens) - len(prefix.blocks)

    def _room(self, prefix: PrefixMatch) -> int:
        """Blocks allocatable once ``prefix``'s cached blocks are referenced (not evictable)."""
        return self.available - sum(1 for b in prefix.blocks if b in self._cached)

    def _take(self, table: list[int], n: int) -> None:
        """Append ``n`` blocks to ``table`` (the caller checked they exist): the block after
        the table's last if free, else a new run's first block (see the module docstring's
        placement), else the least recently released cached block, evicted."""
        for left in range(n, 0, -1):
            after = table[-1] + 1 if table else self.num_blocks
            if after < self.num_blocks and self._free[after]:
                block = after
            elif self._nfree:
                block = self._run_start(left)
            else:
                block, _ = self._cached.popitem(last=False)
                self._unpublish(block)
                self._counts["evictions"] += 1
            if self._free[block]:
                self._free[block], self._nfree = 0, self._nfree - 1
            self._refs[block] = 1
            table.append(block)

    def _run_start(self, want: int) -> int:
        """Where a new run of up to ``want`` blocks starts: in the largest stretch of free
        blocks, at its start if it starts the pool or the run fills it, else in its middle
        (an offset that is a multiple of the run's length)."""
        stretch = max(re.finditer(rb"\x01+", self._free), key=lambda m: m.end() - m.start())
        start, size = stretch.start(), stretch.end() - stretch.start()
        run = min(want, size)
        if start == 0 or run == size:
            return start
        return start + (size - run) // 2 // run * run

    def _release(self, blocks: Sequence[int]) -> None:
        """Drop a reference on each of ``blocks`` (a table's run, in order). Unpublished
        blocks become free; published ones join the LRU list tail first (a chain's head
        outlives its tail, and a match needs the head)."""
        for block in blocks:
            self._refs[block] -= 1
        for block in blocks:
            if self._refs[block] == 0 and block not in self._hash_of:
                self._free[block], self._nfree = 1, self._nfree + 1
        for block in reversed(blocks):
            if self._refs[block] == 0 and block in self._hash_of:
                self._cached[block] = None

    def _unpublish(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
        del self._tokens_of[block]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"BlockManager invariant broken: {message}")
