"""The step pacer: prefill beside decoding is sized so a step stays near a decode-only step."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
import torch

from pipeline.engine import EngineConfig
from pipeline.errors import InvalidValueError
from pipeline.handle import RequestState
from pipeline.pacing import Pacer
from pipeline.protocols import ModelCall
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
    """A scripted model whose forward sleeps 20 ms plus 1 ms per prompt token."""

    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        prefill = sum(len(c.token_ids) for c in calls if len(c.token_ids) > 1)
        time.sleep(0.020 + 0.001 * prefill)
        return super().forward(calls)


def _chunks(backend: ScriptedBackend, decoding_slot: int) -> list[int]:
    """Prompt chunk sizes of forwards that also decoded ``decoding_slot``."""
    return [n for _, rows in backend.calls if any(s == decoding_slot and k == 1 for s, k in rows)
            for s, n in rows if s != decoding_slot]


def test_a_long_prompt_beside_decoding_goes_in_latency_sized_chunks() -> None:
    backend = CostlyBackend(V, hashed_logits(V))
    with build_scripted(backend) as pipe:  # default engine: step_latency_ratio 1.5
        short = pipe.submit("s", max_tokens=5000, temperature=0, ignore_eos=True)
        while short.state is not RequestState.DECODING:
            time.sleep(0.01)
        time.sleep(0.3)  # decode-only steps measured
        long = pipe.submit("L" * 600, max_tokens=2, temperature=0)
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
    with build_scripted(backend, engine=cfg) as pipe:
        short = pipe.submit("s", max_tokens=5000, temperature=0, ignore_eos=True)
        while short.state is not RequestState.DECODING:
            time.sleep(0.01)
        pipe.generate("L" * 600, max_tokens=2, temperature=0)
        short.cancel()
        short.result(timeout=10)
    assert max(_chunks(backend, 0)) == 255  # the budget minus the decode token
    backend = CostlyBackend(V, hashed_logits(V))
    with build_scripted(backend) as pipe:  # paced, but nothing decodes beside the prompt
        pipe.generate("L" * 600, max_tokens=2, temperature=0)
    assert max(n for _, rows in backend.calls for _, n in rows) == 512
