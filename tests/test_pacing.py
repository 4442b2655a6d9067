"""The step pacer: prefill beside decoding is sized so a step stays near a decode-only step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from pipeline.engine import EngineConfig
from pipeline.errors import InvalidValueError
from pipeline.engine.handle import RequestState
from pipeline.engine.pacing import Pacer
from pipeline.pipe import Pipeline
from pipeline.contracts.model import ModelCall
from pipeline.testing import ScriptedBackend, build_scripted, hashed_logits

V = 300


def test_the_allowance_follows_the_measured_costs() -> None:
    pacer = Pacer(ratio=1.5, min_tokens=4)
    assert pacer.allowance(decoding=False) is None          # nobody waits: no bound
    assert pacer.allowance(decoding=True) == 16             # before any measurement
    for _ in range(20):
        pacer.observe(0.020, decode_rows=4, prefill_tokens=0)   # decode-only: 20 ms
        pacer.observe(0.020 + 0.001 * 50, decode_rows=4, prefill_tokens=50)  # 1 ms a token
    assert pacer.allowance(decoding=True) == pytest.approx(10, abs=1)  # 0.5 * 20 ms / 1 ms
    for _ in range(20):  # later chunks attend over more positions: 2 ms a token
        pacer.observe(0.020 + 0.002 * 10, decode_rows=4, prefill_tokens=10)
    assert pacer.allowance(decoding=True) == pytest.approx(5, abs=1)
    for _ in range(20):  # very costly tokens: still progress
        pacer.observe(0.020 + 1.0 * 5, decode_rows=4, prefill_tokens=5)
    assert pacer.allowance(decoding=True) == 4


def test_a_bad_ratio_is_refused() -> None:
    for bad in (1.0, 0.5, -2.0):
        with pytest.raises(InvalidValueError, match="step_latency_ratio"):
            EngineConfig(step_latency_ratio=bad)


class CostlyBackend(ScriptedBackend):
    """A scripted model whose forward costs 20 ms plus 1 ms per prompt token, on a clock of
    its own (nanoseconds) that the engine steps by: no sleep, so the machine's load cannot
    change a measurement."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.now = 0
        self.hold_after: int | None = None  # calls after which forward waits for ``go``
        self.go = threading.Event()

    def clock(self) -> int:
        return self.now

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        if self.hold_after is not None and len(self.calls) >= self.hold_after:
            self.go.wait(60)
        prefill = sum(len(c.token_ids) for c in calls if len(c.token_ids) > 1)
        self.now += 20_000_000 + 1_000_000 * prefill
        return super().forward(calls)


def paced(backend: CostlyBackend, **options: object) -> Pipeline:
    """A scripted pipeline whose engine times its steps by ``backend``'s clock."""
    pipe = build_scripted(backend, **options)  # type: ignore[arg-type]
    assert pipe.engine is not None
    pipe.engine.close()
    pipe.engine = pipe.engine.fresh(clock=backend.clock)
    return pipe


def _chunks(backend: ScriptedBackend, decoding_slot: int) -> list[int]:
    """Prompt chunk sizes of forwards that also decoded ``decoding_slot``."""
    return [n for _, rows in backend.calls if any(s == decoding_slot and k == 1 for s, k in rows)
            for s, n in rows if s != decoding_slot]


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def test_a_long_prompt_beside_decoding_goes_in_latency_sized_chunks() -> None:
    backend = CostlyBackend(V, hashed_logits(V))
    backend.hold_after = 12  # decode-only steps measured; then wait for the long prompt
    with paced(backend) as pipe:  # default engine: step_latency_ratio 1.5
        short = pipe.submit("s", max_tokens=3000, temperature=0, ignore_eos=True)
        wait_for(lambda: len(backend.calls) >= 12)
        long = pipe.submit("L" * 600, max_tokens=2, temperature=0)
        wait_for(lambda: pipe.engine is not None and pipe.engine.queue_depth == 1)
        backend.go.set()
        assert long.result(timeout=60).finish_reason.value == "length"
        short.cancel()
        short.result(timeout=10)
    chunks = _chunks(backend, 0)
    assert sum(chunks) >= 600
    # 1.5 x a 20 ms step leaves 10 ms: about 10 tokens a step, never the 512-token cap
    assert max(chunks[3:]) <= 40 and sorted(chunks)[len(chunks) // 2] <= 20


def test_without_pacing_or_decoding_the_token_caps_alone_apply() -> None:
    backend = CostlyBackend(V, hashed_logits(V))
    cfg = EngineConfig(token_budget=256, max_prefill_chunk=256, step_latency_ratio=None)
    with paced(backend, engine=cfg) as pipe:
        short = pipe.submit("s", max_tokens=5000, temperature=0, ignore_eos=True)
        wait_for(lambda: short.state is RequestState.DECODING)
        pipe.generate("L" * 600, max_tokens=2, temperature=0)
        short.cancel()
        short.result(timeout=10)
    assert max(_chunks(backend, 0)) == 255  # the budget minus the decode token
    backend = CostlyBackend(V, hashed_logits(V))
    with paced(backend) as pipe:  # paced, but nothing decodes beside the prompt
        pipe.generate("L" * 600, max_tokens=2, temperature=0)
    assert max(n for _, rows in backend.calls for _, n in rows) == 512
