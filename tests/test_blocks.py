"""The KV block manager: tables, reference counts, the prefix cache and eviction.

The unit tests pin each rule; the stress test runs random operations against a reference
model that knows blocks by their *content* (a dict from token prefix to block, a simulated
KV memory, its own LRU list), checking after every operation that each live sequence reads
back exactly its tokens, that matches are the longest cached chains, that allocation fails
exactly when the referenced blocks leave too little room, and that only the least recently
released unreferenced block is ever evicted.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence

import pytest

from pipeline.engine.blocks import BlockManager, PrefixMatch, block_hash
from pipeline.errors import CapacityError, InvalidValueError, OutOfBlocks

SNAP = "sha256:model-a"


def manager(num_blocks: int = 8, block_size: int = 4, snapshot: str = SNAP) -> BlockManager:
    return BlockManager(num_blocks, block_size, snapshot=snapshot)


def test_tables_grow_by_whole_blocks_into_the_room_left_for_them() -> None:
    kv = manager()
    assert kv.allocate("a", 5) == (0, 1)
    assert kv.allocate("b", 0) == ()
    assert kv.grow("a", 8) == (0, 1)          # still two blocks
    assert kv.grow("a", 9) == (0, 1, 2)
    assert kv.grow("b", 1) == (5,)            # mid-way in the free stretch 3..7: room for a
    assert kv.grow("a", 13) == (0, 1, 2, 3)
    assert kv.grow("b", 5) == (5, 6)
    assert kv.grow("a", 17) == (0, 1, 2, 3, 4)
    assert kv.grow("a", 21) == (0, 1, 2, 3, 4, 7)   # no room left after 4: a second run
    assert kv.length("a") == 21 and kv.stats.free_blocks == 0
    kv.check()


def _runs(table: Sequence[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:])) if table else 0


def test_equal_windows_pack_without_fragmenting() -> None:
    """One window per slot, allocated and freed in any order, is always one run."""
    rng = random.Random(5)
    kv = manager(num_blocks=8 * 6, block_size=4)
    live: list[int] = []
    for serial in range(300):
        if len(live) < 8 and (not live or rng.random() < 0.6):
            assert _runs(kv.allocate(serial, 6 * 4)) == 1
            live.append(serial)
        else:
            kv.free(live.pop(rng.randrange(len(live))))
    kv.check()


def test_a_batch_growing_together_keeps_one_run_each_while_there_is_room() -> None:
    kv = manager(num_blocks=64, block_size=4)
    for seq in range(4):
        kv.allocate(seq, 10)
    for length in range(11, 31):
        for seq in range(4):
            kv.grow(seq, length)
    assert [_runs(kv.table(seq)) for seq in range(4)] == [1, 1, 1, 1]
    kv.check()


def test_out_of_blocks_is_a_capacity_error_and_changes_nothing() -> None:
    kv = manager(num_blocks=3)
    kv.allocate("a", 8)
    with pytest.raises(OutOfBlocks) as info:
        kv.grow("a", 13)                      # needs 2 more, 1 is free
    assert isinstance(info.value, CapacityError)
    assert (info.value.needed, info.value.available) == (2, 1)
    assert kv.table("a") == (0, 1) and kv.length("a") == 8
    assert not kv.can_allocate(5) and kv.can_allocate(4)
    with pytest.raises(OutOfBlocks):
        kv.allocate("b", 5)
    assert "b" not in kv
    kv.check()


def test_truncate_frees_whole_trailing_blocks() -> None:
    kv = manager()
    kv.allocate("a", 14)                      # blocks 0..3
    kv.truncate("a", 9)
    assert kv.table("a") == (0, 1, 2) and kv.length("a") == 9
    kv.truncate("a", 8)
    assert kv.table("a") == (0, 1)
    kv.truncate("a", 0)
    assert kv.table("a") == () and kv.stats.free_blocks == 8
    with pytest.raises(InvalidValueError, match="0..0"):
        kv.truncate("a", 1)                   # truncate never grows
    with pytest.raises(InvalidValueError, match="never shrinks"):
        kv.grow("a", -1)
    kv.check()


def test_unknown_and_repeated_sequences_are_named() -> None:
    kv = manager()
    kv.allocate("a", 1)
    with pytest.raises(InvalidValueError, match="already has a block table"):
        kv.allocate("a", 1)
    for call in (lambda: kv.grow("zz", 3), lambda: kv.free("zz"), lambda: kv.table("zz")):
        with pytest.raises(InvalidValueError, match="'zz'.*no block table"):
            call()
    with pytest.raises(InvalidValueError, match="num_blocks"):
        BlockManager(0, snapshot=SNAP)
    with pytest.raises(InvalidValueError, match="block_size"):
        BlockManager(4, 0, snapshot=SNAP)


PROMPT = list(range(100, 111))                # 11 tokens: two full blocks of 4 and 3 more


def test_a_published_prefix_is_matched_and_shared_by_reference() -> None:
    kv = manager()
    a = kv.allocate("a", len(PROMPT))
    assert kv.publish("a", PROMPT) == 2       # only the two full blocks
    hit = kv.match(PROMPT[:9] + [7, 7, 7])
    assert hit.blocks == a[:2] and hit.cached_tokens == 8
    b = kv.allocate("b", 12, prefix=hit)
    assert b[:2] == a[:2] and b[2] not in a
    stats = kv.stats
    assert (stats.hits, stats.cached_tokens, stats.allocations) == (1, 8, 2)
    kv.free("a")                              # b still holds the shared blocks
    assert kv.stats.cached_blocks == 0 and kv.stats.used_blocks == 3
    kv.check()
    kv.free("b")
    assert kv.stats.cached_blocks == 2 and kv.stats.free_blocks == 8
    assert kv.match(PROMPT).blocks == a[:2]   # still cached after every holder left
    kv.check()


def test_a_match_never_covers_the_whole_prompt() -> None:
    kv = manager()
    kv.allocate("a", 12)
    kv.publish("a", list(range(12)))          # three full blocks
    assert kv.match(list(range(12))).cached_tokens == 8    # one token must be computed
    assert kv.match(list(range(13))).cached_tokens == 12
    assert kv.match(list(range(5))).cached_tokens == 4
    assert kv.match(list(range(4))).cached_tokens == 0
    assert kv.match([]).cached_tokens == 0
    assert kv.match([1] + list(range(1, 12))).blocks == ()   # the chain starts at the head


def test_publish_only_counts_positions_the_sequence_covers() -> None:
    kv = manager()
    kv.allocate("a", 6)
    with pytest.raises(InvalidValueError, match="publish only positions that are computed"):
        kv.publish("a", list(range(8)))
    assert kv.publish("a", list(range(6))) == 1
    kv.grow("a", 8)
    assert kv.publish("a", list(range(8))) == 1               # only the new full block
    assert kv.publish("a", list(range(8))) == 0
    assert kv.stats.published == 2


def test_two_models_never_share_blocks() -> None:
    assert block_hash(b"", [1, 2], "m1") != block_hash(b"", [1, 2], "m2")
    assert block_hash(b"", [1, 2], "m1") != block_hash(block_hash(b"", [0], "m1"), [1, 2], "m1")
    a, b = manager(snapshot="m1"), manager(snapshot="m2")
    for kv in (a, b):
        kv.allocate("x", 12)
    a.publish("x", list(range(12)))
    assert a.match(list(range(13))).cached_tokens == 12
    assert b.match(list(range(13))).cached_tokens == 0


def test_hashes_are_the_same_in_another_process() -> None:
    """Content addressing must not depend on Python's per-process hash seed."""
    here = block_hash(block_hash(b"", [1, 2, 3, 4], SNAP), [5, 6, 7, 8], SNAP).hex()
    code = ("from pipeline.engine.blocks import block_hash as h; "
            f"print(h(h(b'', [1, 2, 3, 4], {SNAP!r}), [5, 6, 7, 8], {SNAP!r}).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345",
                                          "PYTHONPATH": ":".join(sys.path)})
    assert out.stdout.strip() == here and len(here) == 32


def test_eviction_takes_the_oldest_unreferenced_block_and_never_a_referenced_one() -> None:
    kv = manager(num_blocks=6)
    kv.allocate("a", 8)
    kv.publish("a", list(range(8)))           # blocks 0, 1 published
    kv.allocate("b", 9)                       # blocks 2, 3, 4
    kv.publish("b", list(range(50, 59)))      # 2, 3 published
    kv.free("a")                              # cached, tail first: 1, 0
    kv.allocate("live", 4, prefix=kv.match(list(range(50, 55))))  # holds block 2 (b's too)
    kv.free("b")                              # cached: 3 (2 is still held); 4 is free
    assert kv.stats.cached_blocks == 3 and kv.stats.free_blocks == 5   # 1, 0, 3 + free 5, 4
    assert kv.allocate("c", 12) == (4, 5, 1)  # free blocks first, then the oldest cached
    assert kv.stats.evictions == 1
    assert kv.match(list(range(9))).cached_tokens == 4     # block 0 survives, 1 is gone
    assert kv.grow("c", 20) == (4, 5, 1, 0, 3)
    with pytest.raises(OutOfBlocks):
        kv.grow("c", 21)                      # block 2 is referenced: never evicted
    assert kv.table("live") == (2,) and kv.stats.evictions == 3
    kv.check()


def test_truncating_into_a_published_block() -> None:
    kv = manager()
    kv.allocate("a", 10)
    kv.publish("a", list(range(10)))          # blocks 0, 1 published
    kv.allocate("b", 10, prefix=kv.match(list(range(9)) + [99]))
    with pytest.raises(InvalidValueError, match="block 1, which 2 sequences share"):
        kv.truncate("a", 6)
    assert kv.table("a") == (0, 1, 2)
    kv.truncate("a", 8)                       # on the boundary: nothing is rewritten
    kv.free("b")
    kv.truncate("a", 6)                       # a alone holds block 1: it is unpublished
    assert kv.match(list(range(10))).cached_tokens == 4
    kv.check()


def test_a_stale_match_is_refused() -> None:
    kv = manager(num_blocks=3)
    kv.allocate("a", 4)
    kv.publish("a", [1, 2, 3, 4])
    kv.free("a")
    hit = kv.match([1, 2, 3, 4, 5])
    assert hit.cached_tokens == 4
    kv.allocate("b", 12)                      # needs every block: evicts the cached one
    kv.free("b")
    with pytest.raises(InvalidValueError, match="evicted since the match"):
        kv.allocate("c", 5, prefix=hit)
    with pytest.raises(InvalidValueError, match="below the 4 cached tokens"):
        kv.can_allocate(3, PrefixMatch(hit.blocks, hit.hashes, 4))


def test_the_same_content_computed_twice_is_cached_once() -> None:
    kv = manager()
    kv.allocate("a", 5)
    kv.allocate("b", 5)
    assert kv.publish("a", [1, 2, 3, 4, 5]) == 1
    assert kv.publish("b", [1, 2, 3, 4, 5]) == 0   # b's copy stays private
    kv.free("a")
    kv.free("b")
    assert kv.stats.cached_blocks == 1
    kv.check()


def test_a_hash_collision_never_yields_other_content(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a hash that collides on every block, a match still checks the token ids."""
    import pipeline.engine.blocks

    monkeypatch.setattr(pipeline.engine.blocks, "block_hash", lambda parent, ids, snap: b"same")
    kv = manager()
    kv.allocate("a", 5)
    kv.publish("a", [1, 2, 3, 4, 5])
    assert kv.match([9, 9, 9, 9, 9]).blocks == ()
    assert kv.match([1, 2, 3, 4, 5]).cached_tokens == 4
    kv.check()


def test_check_detects_a_broken_invariant() -> None:
    kv = manager()
    kv.allocate("a", 4)
    kv._refs[0] = 2                           # simulate a bookkeeping bug
    with pytest.raises(AssertionError, match="reference count"):
        kv.check()


# --- randomized: the manager against a content-level reference model ----------------------


class Reference:
    """What the manager must do, said in terms of contents rather than block ids."""

    def __init__(self, kv: BlockManager) -> None:
        self.kv = kv
        self.bs = kv.block_size
        self.tokens: dict[str, list[int]] = {}       # each live sequence's computed tokens
        self.chains: dict[str, int] = {}             # blocks that count as published, per seq
        self.memory: dict[int, list[int | None]] = {}   # the simulated KV pool
        self.cached: dict[tuple[int, ...], int] = {}    # token prefix -> block holding its end
        self.lru: list[int] = []                     # unreferenced published blocks, oldest first

    def holders(self, block: int) -> int:
        return sum(block in self.kv.table(s) for s in self.tokens)

    def referenced(self) -> set[int]:
        return {b for s in self.tokens for b in self.kv.table(s)}

    def published(self, block: int) -> bool:
        return block in self.cached.values()

    def room(self, prefix: Sequence[int] = ()) -> int:
        return self.kv.num_blocks - len(self.referenced() | set(prefix))

    def expected_match(self, tokens: Sequence[int]) -> tuple[int, ...]:
        out = []
        for i in range(max(len(tokens) - 1, 0) // self.bs):
            block = self.cached.get(tuple(tokens[:(i + 1) * self.bs]))
            if block is None:
                break
            out.append(block)
        return tuple(out)

    def handed_out(self, blocks: Sequence[int], before: set[int]) -> None:
        """Blocks newly given to a table: free ones, or the oldest unreferenced cached one."""
        for block in blocks:
            assert block not in before, "a referenced block was handed out again"
            if block in self.lru:
                free = self.kv.num_blocks - len(before) - len(self.lru)
                assert free == 0 and block == self.lru[0], "evicted out of LRU order"
                self.lru.pop(0)
                del self.cached[next(k for k, b in self.cached.items() if b == block)]
            before = before | {block}
            self.memory[block] = [None] * self.bs

    def write(self, seq: str, start: int) -> None:
        table = self.kv.table(seq)
        for p in range(start, len(self.tokens[seq])):
            self.memory[table[p // self.bs]][p % self.bs] = self.tokens[seq][p]

    def publish(self, seq: str) -> int:
        table, toks, new = self.kv.table(seq), self.tokens[seq], 0
        for i in range(self.chains[seq], len(toks) // self.bs):
            key = tuple(toks[:(i + 1) * self.bs])
            if key not in self.cached and not self.published(table[i]):
                self.cached[key] = table[i]
                new += 1
        self.chains[seq] = max(self.chains[seq], len(toks) // self.bs)
        return new

    def release(self, blocks: Sequence[int]) -> None:
        """After a table dropped ``blocks``: unreferenced published ones become cached, the
        table's tail first."""
        after = self.referenced()
        for block in reversed(blocks):
            if block not in after and self.published(block):
                self.lru.append(block)

    def verify(self) -> None:
        self.kv.check()
        for seq, toks in self.tokens.items():
            table = self.kv.table(seq)
            assert len(table) == -(-self.kv.length(seq) // self.bs)
            read = [self.memory[table[p // self.bs]][p % self.bs] for p in range(len(toks))]
            assert read == toks, f"sequence {seq}'s blocks no longer hold its tokens"
        assert self.kv.stats.free_blocks == self.room()
        assert self.kv.stats.cached_blocks == len(self.lru)


DOCS = [[random.Random(d).randrange(50) for _ in range(40)] for d in range(3)]


def _prompt(rng: random.Random) -> list[int]:
    base = DOCS[rng.randrange(len(DOCS))][:rng.randrange(1, 30)]
    return base + [rng.randrange(50) for _ in range(rng.randrange(0, 6))]


def _step(rng: random.Random, ref: Reference, kv: BlockManager, serial: int) -> None:
    live = sorted(ref.tokens)
    op = rng.choice(["new", "new", "grow", "grow", "truncate", "free"] if live else ["new"])
    if op == "new":
        seq, prompt = f"s{serial}", _prompt(rng)
        hit = kv.match(prompt)
        assert hit.blocks == ref.expected_match(prompt)
        assert hit.cached_tokens == len(hit.blocks) * ref.bs < max(len(prompt), 1)
        for i, block in enumerate(hit.blocks):
            assert ref.memory[block] == prompt[i * ref.bs:(i + 1) * ref.bs]
        need = -(-len(prompt) // ref.bs) - len(hit.blocks)
        fits = need <= ref.room(hit.blocks)
        assert kv.can_allocate(len(prompt), hit) == fits
        before = ref.referenced()
        if not fits:
            with pytest.raises(OutOfBlocks):
                kv.allocate(seq, len(prompt), prefix=hit)
            return
        table = kv.allocate(seq, len(prompt), prefix=hit)
        assert table[:len(hit.blocks)] == hit.blocks
        ref.lru = [b for b in ref.lru if b not in hit.blocks]
        ref.handed_out(table[len(hit.blocks):], before | set(hit.blocks))
        ref.tokens[seq], ref.chains[seq] = prompt, len(hit.blocks)
        ref.write(seq, hit.cached_tokens)
        assert kv.publish(seq, prompt) == ref.publish(seq)
    elif op == "grow":
        seq = rng.choice(live)
        extra = [rng.randrange(50) for _ in range(rng.randrange(1, 7))]
        n = len(ref.tokens[seq]) + len(extra)
        old, before = kv.table(seq), ref.referenced()
        need = -(-n // ref.bs) - len(old)
        if need > ref.room():
            with pytest.raises(OutOfBlocks):
                kv.grow(seq, n)
            assert kv.table(seq) == old
            return
        table = kv.grow(seq, n)
        assert table[:len(old)] == old
        ref.handed_out(table[len(old):], before)
        start = len(ref.tokens[seq])
        ref.tokens[seq] = ref.tokens[seq] + extra
        ref.write(seq, start)
        if rng.random() < 0.7:                # drafts stay unpublished until verified
            assert kv.publish(seq, ref.tokens[seq]) == ref.publish(seq)
    elif op == "truncate":
        seq = rng.choice(live)
        length = rng.randrange(len(ref.tokens[seq]) + 1)
        table, keep = kv.table(seq), -(-length // ref.bs)
        partial = table[keep - 1] if length % ref.bs else None
        if partial is not None and ref.published(partial) and ref.holders(partial) > 1:
            with pytest.raises(InvalidValueError, match="share"):
                kv.truncate(seq, length)
            return
        if partial is not None and ref.published(partial):
            del ref.cached[next(k for k, b in ref.cached.items() if b == partial)]
        kv.truncate(seq, length)
        ref.tokens[seq] = ref.tokens[seq][:length]
        ref.chains[seq] = min(ref.chains[seq], length // ref.bs)
        ref.release(table[keep:])
    else:
        seq = rng.choice(live)
        table = kv.table(seq)
        kv.free(seq)
        del ref.tokens[seq], ref.chains[seq]
        ref.release(table)


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_against_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    kv = BlockManager(rng.choice([10, 16, 24]), rng.choice([2, 4, 5]), snapshot=SNAP)
    ref = Reference(kv)
    for serial in range(300):
        _step(rng, ref, kv, serial)
        ref.verify()
    stats = kv.stats
    assert stats.hits > 0 and stats.evictions > 0, "the run never exercised the cache"
