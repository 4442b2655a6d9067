"""The decode thread count chosen by measurement (backends/torch/threads.py).

Oracles: the chooser is driven with given step times (no clock, no machine load); that the
choice never changes results is checked kernel by kernel (each product, attention and
reduction of a step on one thread and on two, bit for bit; attention as the backend calls it,
:func:`backends.torch.invariant.sdpa`) and for whole requests of the
default model, greedy and seeded, run with one thread and with two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from backends.torch.invariant import sdpa
from backends.torch.threads import PROBE_FIRST, PROBE_MOST, PROBE_STEPS, ThreadChooser
from pipeline import build
from pipeline.errors import ArtifactError
from pipeline.model_paths import SMOLLM2_INSTALL, smollm2_file

try:
    HAVE_SMOLLM2 = smollm2_file() is not None
except ArtifactError:
    HAVE_SMOLLM2 = False


def _QUIET() -> float | None:
    """No machine-load reading: the chooser measures alone (a verdict never depends on what
    else the test machine runs)."""
    return None


def _steps(chooser: ThreadChooser, rows: int, n: int, cost: dict[int, float]) -> list[int]:
    used = []
    for _ in range(n):
        threads = chooser.threads_for(rows)
        chooser.record(rows, threads, cost[threads])
        used.append(threads)
    return used


def test_the_faster_count_wins_after_a_probe_and_loses_when_it_slows() -> None:
    chooser = ThreadChooser(most=2, load=_QUIET)
    used = _steps(chooser, 1, PROBE_FIRST, {1: 0.02, 2: 0.05})
    assert used == [2] * PROBE_FIRST  # the most threads until measured otherwise
    used = _steps(chooser, 1, PROBE_STEPS, {1: 0.02, 2: 0.05})
    assert used == [1] * PROBE_STEPS  # the probe
    assert chooser.threads_for(1) == 1  # one thread was faster
    assert chooser.averages(1) == {2: pytest.approx(0.05), 1: pytest.approx(0.02)}
    # the machine frees up: two threads become faster, and the next probe finds it
    used = _steps(chooser, 1, PROBE_FIRST + PROBE_STEPS + 1, {1: 0.02, 2: 0.01})
    assert used[PROBE_FIRST:PROBE_FIRST + PROBE_STEPS] == [2] * PROBE_STEPS
    assert used[-1] == 2


def test_probes_that_keep_the_choice_come_ever_more_rarely() -> None:
    chooser = ThreadChooser(most=2, load=_QUIET)
    used = _steps(chooser, 1, 4000, {1: 0.02, 2: 0.05})  # a busy machine, all along
    starts = [i for i in range(1, len(used)) if used[i] == 2 and used[i - 1] == 1]
    gaps = [b - a - PROBE_STEPS for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == [2 * PROBE_FIRST, 4 * PROBE_FIRST, 8 * PROBE_FIRST, 16 * PROBE_FIRST]
    assert max(gaps) == PROBE_MOST
    assert used.count(2) < PROBE_FIRST + 15 * PROBE_STEPS  # about one step in a hundred


def test_each_batch_size_is_measured_on_its_own_and_one_thread_never_probes() -> None:
    chooser = ThreadChooser(most=2, load=_QUIET)
    _steps(chooser, 1, PROBE_FIRST + PROBE_STEPS, {1: 0.02, 2: 0.05})
    assert chooser.threads_for(1) == 1 and chooser.threads_for(8) == 2
    single = ThreadChooser(most=1, load=_QUIET)
    assert _steps(single, 1, 3 * PROBE_MOST, {1: 0.01}) == [1] * (3 * PROBE_MOST)
    assert single.averages(1) == {}


def test_a_probes_first_step_is_not_counted() -> None:
    chooser = ThreadChooser(most=2, load=_QUIET)
    _steps(chooser, 4, PROBE_FIRST, {1: 0.03, 2: 0.02})
    # the first probe step is slow (a cold pool), the rest fast: the probe still wins
    costs = iter([1.0] + [0.01] * (PROBE_STEPS - 1))
    for _ in range(PROBE_STEPS):
        threads = chooser.threads_for(4)
        chooser.record(4, threads, next(costs))
    assert chooser.threads_for(4) == 1


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _same_on_one_and_two(f: Callable[[], torch.Tensor]) -> bool:
    torch.set_num_threads(1)
    one = f()
    torch.set_num_threads(2)
    return torch.equal(one, f())


@pytest.mark.usefixtures("two_threads")
def test_every_kernel_of_a_step_gives_the_same_bits_on_one_and_two_threads() -> None:
    g = torch.Generator().manual_seed(0)
    head, x = torch.randn(4096, 576, generator=g).half(), torch.randn(8, 576, generator=g)
    assert _same_on_one_and_two(lambda: F.linear(x.half(), head))
    dense, xs = torch.randn(768, 576, generator=g), torch.randn(32, 576, generator=g)
    assert _same_on_one_and_two(lambda: F.linear(xs.bfloat16(), dense.bfloat16()))
    assert _same_on_one_and_two(lambda: F.linear(xs, dense))
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        codes = torch.randint(0, 16, (768, 576), dtype=torch.int32, generator=g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales = torch.randn(18, 768, 2, generator=g).bfloat16()
        for rows in (1, 8, 32):
            xr = xs[:rows].bfloat16()
            assert _same_on_one_and_two(
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xr, packed, 32, scales))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # one query, any history
        q, k, v = (torch.randn(1, 3, n, 64, generator=g).to(dtype) for n in (3, 700, 700))
        assert _same_on_one_and_two(lambda: sdpa(q, k, v)), dtype
        qg, kg = torch.randn(1, 9, 3, 64, generator=g).to(dtype), k[:, :, :40]  # GQA, masked
        mask = torch.ones(3, 40, dtype=torch.bool).tril(37)
        assert _same_on_one_and_two(
            lambda: sdpa(qg, kg, v[:, :, :40], attn_mask=mask, enable_gqa=True)), dtype
        assert _same_on_one_and_two(
            lambda: sdpa(qg, kg[:, :, :3], v[:, :, :3], is_causal=True, enable_gqa=True)), dtype
        x8 = torch.randn(8, 1536, generator=g).to(dtype)  # a long inner dimension
        w = torch.randn(192, 1536, generator=g).to(dtype)
        assert _same_on_one_and_two(lambda: F.linear(x8, w)), dtype
    logits = torch.randn(1, 49152, generator=g)
    assert _same_on_one_and_two(lambda: (logits.double() - logits.max()).exp().cumsum(-1))
    assert _same_on_one_and_two(lambda: logits.float().softmax(-1))


@pytest.mark.skipif(not HAVE_SMOLLM2, reason=SMOLLM2_INSTALL)
@pytest.mark.usefixtures("two_threads")
def test_requests_give_the_same_tokens_on_one_thread_and_on_two() -> None:
    with build(options={"num_slots": 2, "max_context": 256}) as pipe:
        backend = pipe.engine.backend
        chooser, backend.threads = backend.threads, None  # the count is set by hand here
        try:
            runs = {}
            for threads in (1, 2):
                torch.set_num_threads(threads)
                runs[threads] = [
                    pipe.generate("Name a colour.", max_tokens=12, temperature=0).token_ids,
                    pipe.generate("Name a colour.", max_tokens=12, temperature=0.9, top_p=0.9,
                                  seed=7).token_ids]
        finally:
            backend.threads = chooser
    assert runs[1] == runs[2]


def test_cores_other_processes_hold_are_not_used_nor_probed() -> None:
    busy = [1.0]
    chooser = ThreadChooser(most=2, load=lambda: busy[0], cores=2)
    used = _steps(chooser, 1, 600, {1: 0.02, 2: 0.01})
    assert used == [1] * 600 and chooser.capped   # no probe of the core another process holds
    assert chooser.averages(1) == {}               # capped steps teach nothing of the counts
    busy[0] = 0.3                                  # it went quiet: the chooser as before
    used = _steps(chooser, 1, PROBE_FIRST + PROBE_STEPS + 1, {1: 0.02, 2: 0.01})
    assert used[0] == 2 and not chooser.capped and used.count(1) == PROBE_STEPS
    unknown = ThreadChooser(most=2, load=lambda: None, cores=2)  # no /proc: measuring alone
    assert unknown.free_cores() is None and unknown.threads_for(1) == 2


def test_other_load_is_the_machines_busy_time_less_this_process() -> None:
    from backends.torch.threads import LOAD_EVERY_S, OtherLoad

    now = [100.0]
    readings = iter([(10.0, 1.0), (10.5, 1.25), (11.0, 1.5), None])
    load = OtherLoad(clock=lambda: now[0], read=lambda: next(readings))
    assert load() == 0.0                       # nothing known yet: idle
    now[0] += LOAD_EVERY_S / 2
    assert load() == 0.0                       # too soon to read again
    now[0] += LOAD_EVERY_S / 2                 # 0.5 s busy, 0.25 of it ours, in 0.25 s
    assert load() == pytest.approx(1.0)
    now[0] += 2 * LOAD_EVERY_S                 # 0.5 s busy, 0.25 ours, in 0.5 s
    assert load() == pytest.approx(0.5)
    now[0] += LOAD_EVERY_S
    assert load() == pytest.approx(0.5)        # a failed read keeps the last figure
    assert OtherLoad(read=lambda: None)() is None


def test_only_the_cores_this_process_may_use_count_as_busy() -> None:
    from backends.torch.threads import _busy_of

    stat = ("cpu  900 0 300 5000 0 0 0 0 0 0\n"
            "cpu0 100 0 50 1000 0 0 0 0 0 0\n"
            "cpu1 200 0 50 1000 0 0 0 0 0 0\n"
            "cpu2 600 0 200 3000 0 0 0 0 0 0\n"
            "intr 12345\n")
    own = ["R"] + ["0"] * 10 + ["30", "20"]         # utime 30, stime 20 ticks
    assert _busy_of(stat, {0, 1}, 100, own) == (4.0, 0.5)
    assert _busy_of(stat, None, 100, own) == (12.0, 0.5)
    assert _busy_of(stat, {7}, 100, own) is None     # nothing readable of those cores
