"""The engine loop cannot die silently: failures are contained to the requests they concern,
the recovery path is contained too, and a loop that ends anyway fails what it holds, refuses
new work with the reason, and can be replaced by a fresh engine.

Faults are injected through the public seams a third party could use (an event sink, a
backend), never by patching the engine."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from pipeline.errors import EngineClosed, RequestFailed
from pipeline.events import Event
from pipeline.contracts.decode import Batch, Scores, Selection
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked
from pipeline.contracts.output import FinishReason
from stages.select import GreedySelector

V = ByteTokenizer.VOCAB
EOS = 256
Z = ord("z")


def spelling_z(length: int = 6) -> ScriptedBackend:
    """Writes "z" ``length`` times after any prompt without a "z", then EOS."""

    def choose(tokens: Sequence[int]) -> int:
        return Z if tokens.count(Z) < length else EOS

    return ScriptedBackend(V, peaked(V, choose))


class FaultySink:
    """An event sink that raises on chosen event types for requests whose id starts with
    ``bad``: a bug in a third-party sink, hit both by a step and by its recovery."""

    def __init__(self, event_types: Sequence[str]) -> None:
        self.event_types = set(event_types)
        self.raised: list[str] = []
        self._lock = threading.Lock()

    def emit(self, event: Event) -> None:
        if event.trace_id.startswith("bad") and event.event_type in self.event_types:
            with self._lock:
                self.raised.append(event.event_type)
            raise RuntimeError(f"sink cannot take {event.event_type}")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("step_event", ["selection.configured", "token.selected",
                                        "decode.completed", "prefill.completed"])
def test_a_step_and_its_recovery_both_raise_and_the_loop_survives(step_event: str) -> None:
    # The step raises at step_event; failing the request then raises again when its
    # generation.finished is recorded (the recovery path).
    sink = FaultySink([step_event, "generation.finished"])
    with build_scripted(spelling_z(), sinks=[sink]) as pipe:
        good = [pipe.submit(f"good {i}", max_tokens=20, temperature=0, request_id=f"ok-{i}")
                for i in range(3)]
        bad = pipe.submit("bad", max_tokens=20, temperature=0, request_id="bad-1")
        with pytest.raises(RequestFailed) as failed:
            bad.result(timeout=10)
        cause = failed.value.cause
        assert "sink cannot take" in cause and step_event in cause
        assert "recording the failure failed" in cause  # the recovery raised and was contained
        assert sink.raised == [step_event, "generation.finished"]
        deltas = list(bad.deltas(timeout=5))
        assert deltas[-1].finish_reason is FinishReason.ERROR  # stream readers end too
        # the requests it did not concern are unharmed
        for handle in good:
            done = handle.result(timeout=10)
            assert done.text == "z" * 6 and done.finish_reason is FinishReason.EOS
        assert pipe.engine.alive
        after = pipe.generate("after", max_tokens=20, temperature=0)
        assert after.text == "z" * 6
        assert pipe.engine.active_slots == 0 and pipe.engine.backend.busy_slots == 0


class GarbageSelector:
    """Greedy, except that rows of requests whose id starts with ``bad`` get a list where a
    token id belongs (what a denormal ``top_p`` once made the sampler return)."""

    name = "garbage"

    def __call__(self, scores: Scores, batch: Batch) -> Selection:
        choice = GreedySelector()(scores, batch)
        ids: list[Any] = [[t, t] if row.request_id.startswith("bad") else t
                          for t, row in zip(choice.token_ids, batch.rows)]
        return attrs.evolve(choice, token_ids=tuple(ids))


def test_a_selector_that_returns_garbage_fails_its_requests_not_the_loop() -> None:
    with build_scripted(spelling_z(), selector=GarbageSelector()) as pipe:
        with pytest.raises(RequestFailed, match="not a token id"):
            pipe.generate("x", max_tokens=5, request_id="bad-2")
        assert pipe.generate("y", max_tokens=20).text == "z" * 6


class Fatal(BaseException):
    """Not an ``Exception``: nothing in the loop catches it, so the engine thread ends."""


def test_an_engine_thread_that_ends_fails_its_requests_and_refuses_new_ones() -> None:
    armed = threading.Event()

    def choose(tokens: Sequence[int]) -> int:
        if armed.is_set():
            raise Fatal("the backend pulled the plug")
        return Z

    backend = ScriptedBackend(V, peaked(V, choose), num_slots=1, delay_s=0.01)
    stopped: list[str] = []
    with build_scripted(backend) as pipe:
        engine = pipe.engine
        engine.on_stop = stopped.append
        running = pipe.submit("one", max_tokens=2000, temperature=0)
        queued = pipe.submit("two", max_tokens=5, temperature=0)  # waits: one slot
        next(running.deltas(timeout=10))
        armed.set()
        for handle in (running, queued):
            with pytest.raises(RequestFailed, match="the engine stopped: Fatal"):
                handle.result(timeout=10)
        engine._thread.join(10)
        assert not engine.alive and engine.failure is not None and "Fatal" in engine.failure
        assert stopped == [engine.failure]
        with pytest.raises(EngineClosed, match="stopped after an internal error"):
            pipe.submit("three", max_tokens=5)  # fails at once, never queued
        armed.clear()
        assert backend.busy_slots == 0  # the dying loop released its slots
        pipe.restart_engine()
        assert pipe.engine is not engine and pipe.engine.alive
        assert pipe.engine.on_stop == stopped.append  # the fresh engine reports the same way
        assert pipe.generate("four", max_tokens=3, temperature=0).text == "zzz"


class DyingRelease(ScriptedBackend):
    """A backend whose ``release`` ends the engine thread once (a dying device)."""

    def __init__(self) -> None:
        super().__init__(V, peaked(V, lambda tokens: Z if tokens.count(Z) < 3 else EOS),
                         num_slots=2)
        self.armed = True

    def release(self, slot: int) -> None:
        if self.armed:
            self.armed = False
            raise Fatal("release pulled the plug")
        super().release(slot)


def test_an_engine_that_dies_while_releasing_still_answers_and_a_fresh_one_has_every_slot(
        ) -> None:
    backend = DyingRelease()
    with build_scripted(backend) as pipe:
        engine = pipe.engine
        handle = pipe.submit("x", max_tokens=10, temperature=0)
        with pytest.raises(RequestFailed):  # answered, not left waiting
            handle.result(timeout=10)
        engine._thread.join(10)
        assert not engine.alive and "release pulled the plug" in (engine.failure or "")
        pipe.restart_engine()
        assert backend.busy_slots == 0  # the fresh engine got back the slot the dead one held
        done = [pipe.submit(p, max_tokens=10, temperature=0) for p in ("a", "b")]
        assert [h.result(timeout=10).text for h in done] == ["zzz", "zzz"]
