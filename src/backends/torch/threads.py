"""The intra-op thread count of decode steps, chosen by measuring them.

Owns :class:`ThreadChooser`. A decode step of a small model is a few hundred short parallel
operations, each ending at a barrier where every OpenMP thread must arrive. On an idle
machine two threads decode the default model faster than one; with another busy process on
the machine, the operating system deschedules one of the two threads now and then and every
barrier waits for it (measured: 61 tok/s idle on two threads fell to 8 with a test run beside
it, where one thread kept most of its pace; docs/performance.md). No fixed count is right
for both, so the backend times its decode steps on the count it uses and, now and then, on
the other one, and keeps whichever is faster lately. Exploring costs steps, though: a probe
of two threads beside a busy process runs a few steps at a third of the pace. So the chooser
also reads how much of the machine other processes use (:class:`OtherLoad`, from Linux's
``/proc``: the machine's busy time less this process's own): while they keep so many cores
busy that fewer than ``most`` are left, it runs on what is left and probes nothing larger.

Results do not depend on the choice: each row's products, attention and reductions are the
same on one thread as on several (tests/test_threads.py checks the kernels and whole requests),
so the choice changes speed only, never tokens.

Example::

    chooser = ThreadChooser(most=torch.get_num_threads())
    threads = chooser.threads_for(rows)        # before a decode step of `rows` rows
    ...                                        # run it on that many threads
    chooser.record(rows, threads, seconds)     # after it
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import attrs

PROBE_FIRST = 8
"""Steps of one batch size before the first probe of the count not in use."""
PROBE_MOST = 512
"""The longest wait between probes: each probe that keeps the choice doubles the wait (from
:data:`PROBE_FIRST`), each that changes it starts again from :data:`PROBE_FIRST`."""
PROBE_STEPS = 3
"""Steps a probe runs on the other count: the first one warms that count's thread pool and is
not counted; the mean of the others replaces that count's average."""
SMOOTHING = 0.25
"""Weight of the newest step in each count's moving average of step time."""
LOAD_EVERY_S = 0.25
"""How often :class:`OtherLoad` reads ``/proc`` (the kernel counts CPU time in ticks of
10 ms: a shorter window would read mostly rounding)."""
BUSY_CORE = 0.6
"""Other processes' use of a core, from which that core counts as taken."""


class OtherLoad:
    """How many cores other processes kept busy lately: the machine's busy CPU time from
    ``/proc/stat`` less this process's own from ``/proc/self/stat``, over the wall time since
    the previous reading, read at most every :data:`LOAD_EVERY_S` (the last figure in
    between). Where ``/proc`` cannot be read (not Linux), :meth:`__call__` gives None.
    ``clock`` and ``read`` are injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 read: Callable[[], tuple[float, float] | None] | None = None) -> None:
        self._clock, self._read = clock, read or _proc_busy_seconds
        self._at = clock()
        self._last = self._read()
        self._cores: float | None = 0.0 if self._last is not None else None

    def __call__(self) -> float | None:
        """Cores other processes used lately (0 on an idle machine), or None."""
        now = self._clock()
        if self._last is None or now - self._at < LOAD_EVERY_S:
            return self._cores
        reading = self._read()
        if reading is None:
            return self._cores
        machine = reading[0] - self._last[0]
        ours = reading[1] - self._last[1]
        self._cores = max(0.0, (machine - ours) / (now - self._at))
        self._at, self._last = now, reading
        return self._cores


def _usable_cores(fallback: int) -> int:
    """The cores this process may run on (its affinity), else the machine's count."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or fallback)


def _proc_busy_seconds() -> tuple[float, float] | None:
    """(CPU seconds the cores this process may run on have been busy, this process's own),
    or None. Only those cores count: in a container pinned to two cores of a large host,
    ``/proc/stat`` lists every core of the host, busy with work that is no competitor."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return _busy_of(stat, _allowed_cores(), os.sysconf("SC_CLK_TCK"), own)


def _allowed_cores() -> set[int] | None:
    affinity = getattr(os, "sched_getaffinity", None)
    return set(affinity(0)) if affinity is not None else None


def _busy_of(stat: str, cores: set[int] | None, tick: int,
             own: list[str]) -> tuple[float, float] | None:
    """:func:`_proc_busy_seconds` from the text of ``/proc/stat`` and the fields of
    ``/proc/self/stat`` after the command name."""
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cores is not None and int(name[3:]) not in cores:
            continue
        user, nice, system, _, _, irq, softirq, steal = (int(v) for v in rest.split()[:8])
        busy += user + nice + system + irq + softirq + steal
    if not busy:
        return None
    # after the name: state is field 3 of the line, utime and stime fields 14 and 15
    return busy / tick, (int(own[11]) + int(own[12])) / tick


@attrs.define
class _Bucket:
    """What is known of the decode steps of one batch size."""

    chosen: int
    steps: int = 0
    wait: int = PROBE_FIRST
    probing: int = 0
    probe: list[float] = attrs.field(factory=list)
    average: dict[int, float] = attrs.field(factory=dict)


class ThreadChooser:
    """Picks 1 or ``most`` intra-op threads for each decode step by its measured time.

    Per batch size (rows in the step): use the count that is faster on average lately
    (``most`` until measured otherwise); now and then run :data:`PROBE_STEPS` steps on the
    other count to refresh its average: first after :data:`PROBE_FIRST` steps, then after
    twice as many each time the probe keeps the choice (up to :data:`PROBE_MOST`), and after
    :data:`PROBE_FIRST` again when it changed it. ``most`` of 1 never probes. Not
    thread-safe: one engine thread uses it.
    """

    def __init__(self, most: int, load: Callable[[], float | None] | None = None,
                 cores: int | None = None) -> None:
        self.most = max(1, most)
        self._buckets: dict[int, _Bucket] = {}
        self.load = load if load is not None else (OtherLoad() if self.most > 1 else None)
        """Cores other processes use lately (:class:`OtherLoad`), or None: not known."""
        self.cores = cores if cores is not None else _usable_cores(self.most)
        self.capped = False
        """Whether the last step's count was capped by the other processes' load."""

    def free_cores(self) -> int | None:
        """The cores other processes leave (at least 1), or None where the load is unknown."""
        busy = self.load() if self.load is not None else None
        if busy is None:
            return None
        taken = int(busy + (1 - BUSY_CORE))  # a core counts as taken from BUSY_CORE of it
        return max(1, self.cores - taken)

    def threads_for(self, rows: int) -> int:
        """The thread count for the next decode step of ``rows`` rows."""
        if self.most == 1:
            return 1
        bucket = self._buckets.setdefault(rows, _Bucket(self.most))
        free = self.free_cores()
        self.capped = free is not None and free < self.most
        if self.capped and free is not None:  # no probe of what other processes hold
            bucket.probing, bucket.probe = 0, []
            return min(bucket.chosen, free)
        if bucket.probing:
            return self._other(bucket.chosen)
        return bucket.chosen

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` on ``threads`` threads."""
        if self.most == 1 or self.capped:  # a capped step says nothing of the counts' pace
            return
        bucket = self._buckets.setdefault(rows, _Bucket(self.most))
        if bucket.probing:
            if bucket.probing < PROBE_STEPS:  # a probe's first step wakes a cold pool
                bucket.probe.append(seconds)
            bucket.probing -= 1
            if not bucket.probing:  # the probe's steps replace what was known of the count
                bucket.average[threads] = sum(bucket.probe) / len(bucket.probe)
                bucket.probe.clear()
                faster = min(bucket.average, key=bucket.average.__getitem__)
                kept = faster == bucket.chosen
                bucket.wait = min(2 * bucket.wait, PROBE_MOST) if kept else PROBE_FIRST
                bucket.chosen = faster
            return
        old = bucket.average.get(threads)
        bucket.average[threads] = seconds if old is None else old + SMOOTHING * (seconds - old)
        bucket.steps += 1
        if bucket.steps >= bucket.wait:
            bucket.steps = 0
            bucket.probing = PROBE_STEPS

    def chosen(self, rows: int) -> int:
        """The count steps of ``rows`` rows run on outside probes (``most`` until measured)."""
        bucket = self._buckets.get(rows)
        return bucket.chosen if bucket is not None else self.most

    def averages(self, rows: int) -> dict[int, float]:
        """Seconds per step of ``rows`` rows by thread count, as measured lately."""
        bucket = self._buckets.get(rows)
        return dict(bucket.average) if bucket is not None else {}

    def _other(self, chosen: int) -> int:
        return 1 if chosen == self.most else self.most
