"""The engine over a paged backend: prefix-cache hits, admission by free blocks, preemption by
recompute; and Paging's growth and preemption rules on their own, on a bare pool. Every
request's greedy tokens are checked against the same request run alone in a fresh pipeline
(one slot, an empty pool: no prefix cache, no eviction, no preemption; its equality with
transformers is test_torch_pipeline's business), so a cache hit, an eviction or a
recomputation that changed what the model sees would show."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from pipeline import build
from pipeline.errors import CapacityError
from pipeline.engine.paging import Paging, Room
from pipeline.pipe import Pipeline
from pipeline.trace import check
from pipeline.contracts.output import Completion
from pipeline.contracts.request import Request


@pytest.fixture(scope="module")
def oracle() -> Any:
    def alone(ids: Sequence[int], n: int) -> list[int]:
        with _pipe(block_size=4, max_context=128, num_slots=1) as pipe:
            done = pipe.generate(_request(ids, n))
            assert done.usage.cached_tokens == 0
            return list(done.token_ids)

    return alone


def _pipe(**options: Any) -> Pipeline:
    return build("tiny", options={"dtype": "float32", "pack": False, **options})


def _request(ids: Sequence[int], n: int) -> Request:
    return Request(prompt_ids=list(ids), generation_config={
        "max_tokens": n, "temperature": 0, "ignore_eos": True})


def _events(done: Completion, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in done.trace if e.event_type == kind]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 2000) for _ in range(n)]


def test_a_prefix_cache_hit_decodes_what_a_cold_run_does(oracle: Any) -> None:
    rng = random.Random(1)
    base = _ids(rng, 40)
    a, b = base + _ids(rng, 5), base + _ids(rng, 7)
    with _pipe(block_size=4, max_context=128, num_slots=2) as pipe:
        cold = pipe.generate(_request(a, 12))
        warm = pipe.generate(_request(b, 12))
        again = pipe.generate(_request(a, 12))
        stats = pipe.engine.kv_blocks
    assert cold.usage.cached_tokens == 0 and not _events(cold, "prefix.hit")
    assert warm.usage.cached_tokens == 40                  # the shared 10 blocks of 4
    assert _events(warm, "prefix.hit") == [{"cached_tokens": 40, "blocks": 10}]
    assert again.usage.cached_tokens == 44                 # (45 - 1) // 4 blocks: one to compute
    assert list(cold.token_ids) == list(again.token_ids) == oracle(a, 12)
    assert list(warm.token_ids) == oracle(b, 12)
    assert stats is not None and stats.hits == 2 and stats.cached_tokens == 84


def test_shared_prefixes_under_eviction_pressure_equal_cold_runs(oracle: Any) -> None:
    rng = random.Random(3)
    prefixes = [_ids(rng, rng.randrange(6, 30)) for _ in range(3)]
    jobs = []
    for _ in range(14):
        prompt = rng.choice(prefixes) + _ids(rng, rng.randrange(1, 10))
        jobs.append((prompt, rng.randrange(3, 12)))
    with _pipe(block_size=4, max_context=64, num_slots=4, kv_blocks=20) as pipe:
        handles = [pipe.submit(_request(p, n)) for p, n in jobs]
        done = [h.result(timeout=120) for h in handles]
        stats = pipe.engine.kv_blocks
    for (prompt, n), completion in zip(jobs, done):
        assert list(completion.token_ids) == oracle(prompt, n), completion.usage
        assert check(completion).ok, check(completion).render()
    assert stats is not None and stats.hits > 0 and stats.evictions > 0
    assert sum(c.usage.cached_tokens for c in done) > 0
    for c in done:      # usage counts the hit of the admission that computed the prompt
        assert c.usage.cached_tokens == _prompt_hit(c)


def _prompt_hit(done: Completion) -> int:
    cached = 0
    for event in done.trace:
        if event.event_type == "prefix.hit":
            cached = event.payload["cached_tokens"]
        elif event.event_type == "preempted":
            cached = 0
        elif event.event_type == "prefill.completed":
            return cached
    return cached


def test_more_requests_than_blocks_all_finish_as_alone(oracle: Any) -> None:
    rng = random.Random(4)
    jobs = [(_ids(rng, rng.randrange(12, 24)), 24) for _ in range(6)]
    with _pipe(block_size=4, max_context=48, num_slots=4, kv_blocks=12) as pipe:
        handles = [pipe.submit(_request(p, n)) for p, n in jobs]
        done = [h.result(timeout=120) for h in handles]
    for (prompt, n), completion in zip(jobs, done):
        assert list(completion.token_ids) == oracle(prompt, n)
        assert completion.usage.completion_tokens == n
        assert check(completion).ok, check(completion).render()
    preempted = [c for c in done if _events(c, "preempted")]
    assert preempted, "the pool was meant to force preemption"
    for c in preempted:
        assert any(p.get("resumed") for p in _events(c, "prefill.completed"))


# --- Paging's rules on their own ----------------------------------------------------------


@attrs.frozen
class _Pool:
    """The two numbers Paging reads of a paged backend."""

    num_blocks: int
    block_size: int


@attrs.define(eq=False)
class _Job:
    prompt_ids: tuple[int, ...]
    output_ids: list[int] = attrs.Factory(list)
    cache_len: int = 0


def _admitted(paging: Paging, *prompts: int) -> list[_Job]:
    jobs = [_Job(tuple(range(1 + 10 * i, 1 + 10 * i + n))) for i, n in enumerate(prompts)]
    for job in jobs:
        assert paging.admit(job, job.prompt_ids) is not None
        job.cache_len = len(job.prompt_ids)
    return jobs


def test_make_room_grows_every_table_while_blocks_last() -> None:
    paging = Paging(_Pool(8, 4), "snap")  # type: ignore[arg-type]
    a, b = _admitted(paging, 4, 7)           # 1 + 2 blocks
    room = paging.make_room([(a, 5), (b, 9)], [a, b])
    assert room == Room() and not room.dropped
    assert (len(paging.table(a)), len(paging.table(b))) == (2, 3)
    assert paging.blocks.stats.free_blocks == 3


def test_make_room_preempts_the_most_recently_admitted_other_job() -> None:
    paging = Paging(_Pool(6, 4), "snap")  # type: ignore[arg-type]
    a, b, c = _admitted(paging, 8, 4, 4)     # 2 + 1 + 1 blocks; 2 free
    room = paging.make_room([(a, 17), (c, 5)], [a, b, c])   # a needs 3 more blocks
    assert room.preempted == ((c, 1),) and room.starved == ()
    assert room.dropped == {c} and c not in paging.blocks   # c's own need was skipped
    assert len(paging.table(a)) == 5 and len(paging.table(b)) == 1
    room = paging.make_room([(b, 9)], [a, b])               # b needs 2 more: a goes
    assert room.preempted == ((a, 5),)
    assert len(paging.table(b)) == 3


def test_make_room_starves_a_job_with_nobody_left_to_preempt() -> None:
    paging = Paging(_Pool(3, 4), "snap")  # type: ignore[arg-type]
    (a,) = _admitted(paging, 12)
    room = paging.make_room([(a, 13)], [a])
    assert room.preempted == () and [j for j, _ in room.starved] == [a]
    assert "out of KV blocks: 1 needed, 0 free" in room.starved[0][1]
    assert len(paging.table(a)) == 3   # nothing changed


def test_a_prompt_larger_than_the_whole_pool_is_refused_not_kept_waiting() -> None:
    """It could never be admitted, so the engine fails it rather than block the queue."""
    paging = Paging(_Pool(6, 4), "snap")  # type: ignore[arg-type]
    _admitted(paging, 4)
    with pytest.raises(CapacityError, match="needs 8 KV blocks, more than the pool's 6"):
        paging.admit(_Job((1,) * 30), tuple(range(30)))
    assert paging.admit(_Job((1,) * 24), tuple(range(24)), reserve=1) is None  # waits
    assert paging.blocks.stats.used_blocks == 1


def test_no_position_is_read_before_it_is_written(oracle: Any) -> None:
    # The pool is allocated uninitialised (backends/torch/kv.py: a big pool costs only the
    # pages written). Filled with NaN here, any read of a position nobody wrote would turn
    # the logits to NaN: shared prefixes, blocks reused after others' requests, concurrent
    # requests and gathered (non-contiguous) tables still decode what they decode alone.
    import math

    rng = random.Random(7)
    base = _ids(rng, 23)
    jobs = [(base + _ids(rng, rng.randrange(1, 9)), rng.randrange(3, 9)) for _ in range(6)]
    with _pipe(block_size=4, max_context=64, num_slots=3, kv_blocks=40) as pipe:
        cache = pipe.engine.backend.cache
        for t in (*cache.k, *cache.v):
            t.fill_(math.nan)
        handles = [pipe.submit(_request(ids, n)) for ids, n in jobs]
        got = [list(h.result().token_ids) for h in handles]
    assert got == [oracle(ids, n) for ids, n in jobs]
