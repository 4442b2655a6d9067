"""The intra-op thread count of decode steps, chosen by measuring them.

Owns :class:`ThreadChooser`. A decode step of a small model is a few hundred short parallel
operations, each ending at a barrier where every OpenMP thread must arrive. On an idle
machine two threads decode the default model faster than one; with another busy process on
the machine, the operating system deschedules one of the two threads now and then and every
barrier waits for it (measured: 61 tok/s idle on two threads fell to 8 with a test run beside
it, where one thread kept most of its pace; docs/performance.md). No fixed count is right
for both, so the backend times its decode steps on the count it uses and, now and then, on
the other one, and keeps whichever is faster lately.

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

    def __init__(self, most: int) -> None:
        self.most = max(1, most)
        self._buckets: dict[int, _Bucket] = {}

    def threads_for(self, rows: int) -> int:
        """The thread count for the next decode step of ``rows`` rows."""
        if self.most == 1:
            return 1
        bucket = self._buckets.setdefault(rows, _Bucket(self.most))
        if bucket.probing:
            return self._other(bucket.chosen)
        return bucket.chosen

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A decode step of ``rows`` rows took ``seconds`` on ``threads`` threads."""
        if self.most == 1:
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
