"""The engine's step loop, state machine, scheduling and failure handling, on fakes."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from pipeline import EngineConfig, FinishReason, RequestState
from pipeline.errors import RequestFailed
from pipeline.events import MINIMAL_TIMELINE
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, hashed_logits, peaked

V = ByteTokenizer.VOCAB
EOS = 256


def spell(text: str, prompt_len: int) -> ScriptedBackend:
    """A backend that spells ``text`` after a prompt of ``prompt_len`` tokens, then EOS."""
    data = text.encode()

    def choose(tokens: Sequence[int]) -> int:
        at = len(tokens) - prompt_len
        return data[at] if at < len(data) else EOS

    return ScriptedBackend(V, peaked(V, choose))


def test_greedy_generation_spells_the_script_and_stops_at_eos() -> None:
    pipe = build_scripted(ScriptedBackend(V, peaked(V, lambda t: EOS)))
    m = pipe.count_tokens("hi")
    pipe.close()
    with build_scripted(spell("héllo 🌍", m)) as pipe:
        done = pipe.generate("hi", max_tokens=50, temperature=0)
    assert done.text == "héllo 🌍"
    assert done.finish_reason is FinishReason.EOS
    assert done.token_ids[-1] == EOS
    assert done.usage.prompt_tokens == m
    assert done.usage.completion_tokens == len("héllo 🌍".encode()) + 1


def test_max_tokens_ends_with_length() -> None:
    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 65))) as pipe:
        done = pipe.generate("x", max_tokens=5, temperature=0)
    assert done.text == "AAAAA"
    assert done.finish_reason is FinishReason.LENGTH


def test_trace_has_the_minimal_timeline_in_causal_order_and_cache_lengths() -> None:
    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 66))) as pipe:
        m = pipe.count_tokens("q")
        done = pipe.generate("q", max_tokens=3, temperature=0)
    types = [e.event_type for e in done.trace]
    ids = [e.event_id for e in done.trace]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    firsts = [types.index(t) for t in MINIMAL_TIMELINE]
    assert firsts == sorted(firsts), types
    assert types[-2:] == ["generation.finished", "resources.released"]
    by_type = {}
    for e in done.trace:
        by_type.setdefault(e.event_type, []).append(e.payload)
    assert by_type["prefill.completed"][0]["cache_len"] == m  # m, not m + 1
    for p in by_type["token.selected"]:
        assert p["cache_len"] == m + p["step"] - 1
    for p in by_type["decode.completed"]:
        assert p["cache_len"] == m + p["step"]
    # the last token stops the run: it never enters the model
    assert len(by_type["decode.completed"]) == len(by_type["token.selected"]) - 1
    parents = {e.event_id for e in done.trace}
    assert all(e.parent_event_id in parents for e in done.trace[1:])


def test_chunked_prefill_equals_one_shot_and_respects_the_chunk_size() -> None:
    prompt = "a long prompt " * 10
    results = []
    for chunk in (7, 1000):
        backend = ScriptedBackend(V, hashed_logits(V))
        with build_scripted(backend, engine=EngineConfig(token_budget=64,
                                                         max_prefill_chunk=chunk)) as pipe:
            results.append(pipe.generate(prompt, max_tokens=20, temperature=0).token_ids)
        sizes = [n for _, rows in backend.calls for _, n in rows]
        assert max(sizes) <= chunk
    assert results[0] == results[1]


def test_a_long_prefill_does_not_starve_decoding() -> None:
    backend = ScriptedBackend(V, hashed_logits(V))
    cfg = EngineConfig(token_budget=16, max_prefill_chunk=16)
    with build_scripted(backend, engine=cfg) as pipe:
        short = pipe.submit("s", max_tokens=5000, temperature=0, ignore_eos=True)
        _wait_state(short, RequestState.DECODING)
        long = pipe.submit("L" * 400, max_tokens=2, temperature=0)
        long.result(timeout=10)
        short.cancel()
        short.result(timeout=10)
    # the long prompt went in chunks of at most 15 (the budget minus one decode token), and
    # each chunk rode in the same forward as the short request's decode token
    calls = [rows for _, rows in backend.calls]
    short_slot = calls[0][0][0]  # the short prompt's first chunk
    long_slot = next(s for rows in calls for s, _ in rows if s != short_slot)
    chunked = [rows for rows in calls if any(s == long_slot for s, _ in rows)]
    assert sum(n for rows in chunked for s, n in rows if s == long_slot) >= 400
    assert len(chunked) >= 400 // 15
    for rows in chunked[:-1]:  # the last one may follow the short request's end
        assert len(rows) == 2 and max(n for _, n in rows) <= 15
        assert [n for s, n in rows if s != long_slot] == [1]


def test_greedy_batch_results_equal_solo_results() -> None:
    prompts = [f"prompt number {i} " * (i + 1) for i in range(8)]
    with build_scripted(ScriptedBackend(V, hashed_logits(V))) as pipe:
        solo = [pipe.generate(p, max_tokens=24, temperature=0).token_ids for p in prompts]
        handles = [pipe.submit(p, max_tokens=24, temperature=0) for p in prompts]
        batched = [h.result().token_ids for h in handles]
    assert batched == solo


def test_seeded_sampling_is_the_same_alone_and_in_a_batch() -> None:
    with build_scripted(ScriptedBackend(V, hashed_logits(V, scale=1.0))) as pipe:
        alone = pipe.generate("seeded", max_tokens=16, temperature=1.0, seed=7).token_ids
        others = [pipe.submit(f"other {i}", max_tokens=16, seed=i) for i in range(7)]
        mine = pipe.submit("seeded", max_tokens=16, temperature=1.0, seed=7)
        assert mine.result().token_ids == alone
        for h in others:
            h.result()


def _wait_state(handle, state: RequestState, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while handle.state is not state:
        assert time.monotonic() < end, f"never reached {state}, at {handle.state}"
        time.sleep(0.0005)


@pytest.mark.parametrize("state", [RequestState.QUEUED, RequestState.PREFILLING,
                                   RequestState.DECODING])
def test_cancel_in_every_state_frees_the_slot(state: RequestState) -> None:
    backend = ScriptedBackend(V, peaked(V, lambda t: 65), num_slots=1, delay_s=0.005)
    cfg = EngineConfig(token_budget=4, max_prefill_chunk=2)
    with build_scripted(backend, engine=cfg) as pipe:
        blocker = pipe.submit("b", max_tokens=30, temperature=0) if state is RequestState.QUEUED \
            else None
        handle = pipe.submit("x" * 40, max_tokens=1000, temperature=0)
        _wait_state(handle, state)
        handle.cancel()
        done = handle.result(timeout=5)
        assert done.finish_reason is FinishReason.CANCELLED
        assert handle.state is RequestState.CANCELLED
        if blocker is not None:
            blocker.cancel()
            blocker.result(timeout=5)
        assert pipe.engine.active_slots == 0
        assert backend.busy_slots == 0
    types = [e.event_type for e in done.trace]
    assert types[-2:] == ["generation.finished", "resources.released"]
    assert "stream.delta" not in types[types.index("generation.finished"):]


def test_a_slot_error_fails_only_that_request() -> None:
    bad = 90  # 'Z': a prompt containing it breaks the backend at prefill
    backend = ScriptedBackend(V, hashed_logits(V), fail=lambda tokens: bad in tokens)
    with build_scripted(backend) as pipe:
        handles = [pipe.submit(p, max_tokens=8, temperature=0) for p in ("ok1", "Zap", "ok2")]
        with pytest.raises(RequestFailed) as info:
            handles[1].result(timeout=5)
        assert handles[0].result(timeout=5).finish_reason is not FinishReason.ERROR
        assert handles[2].result(timeout=5).finish_reason is not FinishReason.ERROR
    completion = info.value.completion  # type: ignore[attr-defined]
    assert completion.finish_reason is FinishReason.ERROR
    finished = [e for e in completion.trace if e.event_type == "generation.finished"]
    assert finished[0].payload["reason"] == "error"
    assert backend.busy_slots == 0


def test_an_unexpected_backend_exception_never_hangs_the_caller() -> None:
    def explode(tokens: Sequence[int]):
        raise RuntimeError("boom")

    with build_scripted(ScriptedBackend(V, explode)) as pipe:
        with pytest.raises(RequestFailed, match="boom"):
            pipe.generate("x", max_tokens=3, temperature=0)
        assert pipe.engine.active_slots == 0


def test_deadline_ends_the_request() -> None:
    backend = ScriptedBackend(V, peaked(V, lambda t: 65), delay_s=0.01)
    with build_scripted(backend) as pipe:
        done = pipe.generate("x", max_tokens=1000, temperature=0, limits={"deadline_s": 0.1})
    assert done.finish_reason is FinishReason.DEADLINE
    assert 0 < done.usage.completion_tokens < 1000


def test_queue_timeout_fails_a_request_that_waits_too_long() -> None:
    backend = ScriptedBackend(V, peaked(V, lambda t: 65), num_slots=1, delay_s=0.01)
    with build_scripted(backend) as pipe:
        first = pipe.submit("a", max_tokens=40, temperature=0)
        late = pipe.submit("b", max_tokens=5, temperature=0, limits={"queue_timeout_s": 0.05})
        with pytest.raises(RequestFailed, match="queue timeout"):
            late.result(timeout=5)
        first.result(timeout=5)


def test_sixteen_threads_get_their_solo_results_and_cancels_leave_no_slot() -> None:
    import random

    backend = ScriptedBackend(V, hashed_logits(V), num_slots=6)
    prompts = [f"thread {i} says " + "x" * i for i in range(16)]
    with build_scripted(backend) as pipe:
        solo = {p: pipe.generate(p, max_tokens=20, temperature=0).token_ids for p in prompts}
        results: dict[str, tuple[int, ...]] = {}
        errors: list[BaseException] = []
        rng = random.Random(0)
        cancel_at = {p: rng.random() * 0.02 for p in prompts[::3]}

        def work(p: str) -> None:
            try:
                for _ in range(3):
                    h = pipe.submit(p, max_tokens=20, temperature=0)
                    if p in cancel_at:
                        time.sleep(cancel_at[p])
                        h.cancel()
                        h.result(timeout=10)
                    else:
                        results[p] = h.result(timeout=10).token_ids
                        assert results[p] == solo[p]
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert pipe.engine.active_slots == 0 and pipe.engine.queue_depth == 0
    assert backend.busy_slots == 0


def test_stream_yields_deltas_that_concatenate_to_the_result() -> None:
    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 0xE4 if len(t) % 3 else 65))
                        ) as pipe:
        handle = pipe.submit("x", max_tokens=30, temperature=0)
        deltas = list(handle.deltas())
        done = handle.result()
    assert "".join(d.text for d in deltas) == done.text
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert deltas[-1].final and not any(d.final for d in deltas[:-1])
    assert sum(len(d.token_ids) for d in deltas) == len(done.token_ids)


def test_closing_a_stream_early_cancels_the_request() -> None:
    backend = ScriptedBackend(V, peaked(V, lambda t: 65), delay_s=0.002)
    with build_scripted(backend) as pipe:
        it = pipe.stream("x", max_tokens=10_000, temperature=0)
        next(it)
        it.close()  # type: ignore[attr-defined]
        end = time.monotonic() + 5
        while pipe.engine.active_slots and time.monotonic() < end:
            time.sleep(0.001)
        assert pipe.engine.active_slots == 0
    assert backend.busy_slots == 0


def test_astream_delivers_on_the_event_loop() -> None:
    import asyncio

    async def run() -> str:
        with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 66))) as pipe:
            parts = [d.text async for d in pipe.astream("x", max_tokens=6, temperature=0)]
        return "".join(parts)

    assert asyncio.run(run()) == "BBBBBB"


def test_the_context_window_bounds_prompt_and_output() -> None:
    from pipeline.errors import InvalidValueError

    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 65), max_context=64)) as pipe:
        m = pipe.count_tokens("x")
        with pytest.raises(InvalidValueError, match="prompt is too long"):
            pipe.submit("x" * 80)
        done = pipe.generate("x", max_tokens=500, temperature=0)
        assert done.finish_reason is FinishReason.LENGTH and m + len(done.token_ids) == 64
        capped = pipe.generate("x", max_tokens=500, temperature=0,
                               limits={"max_context_tokens": m + 5})
        assert len(capped.token_ids) == 5


def test_a_request_may_override_the_processor_order_and_the_trace_records_it() -> None:
    from pipeline.errors import UnknownNameError

    with build_scripted(ScriptedBackend(V, hashed_logits(V, scale=1.0))) as pipe:
        default = pipe.generate("x", max_tokens=2, temperature=0.7, top_p=0.9, seed=3)
        custom = pipe.generate("x", max_tokens=2, temperature=0.7, top_p=0.9, seed=3,
                               processor_order=("top_p", "temperature"))
        with pytest.raises(UnknownNameError, match="top_q"):
            pipe.submit("x", processor_order=("top_q",))

    def order(done):
        return [e.payload["processors"] for e in done.trace
                if e.event_type == "selection.configured"][0]

    assert order(default).index("temperature") < order(default).index("top_p")
    assert order(custom) == ["top_p", "temperature"]
