"""Stoppers: stop strings against an independent oracle, token stoppers, the chain, registry."""

from __future__ import annotations

import random
import sys
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import RegistryError, UnknownNameError
from pipeline.contracts.text import StopContext, Stopper, StopVerdict
from pipeline.contracts.output import FinishReason
from pipeline.contracts.request import GenerationConfig, Request, RuntimeLimits
from stages.stop import (
    DEFAULT_STOPPERS, STOPPERS, DeadlineState, DeadlineStopper, EosState, EosStopper,
    MaxTokensStopper, StopperChain, StopStringState, StopStringStopper, make_stopper,
)

EOS = 2
CTX = StopContext(frozenset({EOS}), accepted_ns=1_000)
PROPERTY = settings(max_examples=200, deadline=None)


def request(**config: Any) -> Request:
    limits = config.pop("limits", {})
    return Request(prompt="x", generation_config=GenerationConfig(**config),
                   runtime_limits=RuntimeLimits(**limits))


# --- stop strings: oracle and property ------------------------------------------------------


def oracle(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """Released text and matched stop, by scanning end positions: the first position where a
    stop string ends wins, and the longest stop ending there (the earliest start)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[:end - len(stop)], stop
    return text, None


def held_by_oracle(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def split(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def feed(chunks: Sequence[str], stops: Sequence[str]) -> tuple[list[str], StopVerdict | None]:
    """Feed chunks then a final empty call; the released pieces and the verdict."""
    stopper = StopStringStopper()
    state = stopper.start(request(stop=list(stops)), CTX)
    released: list[str] = []
    seen = ""
    for i, chunk in enumerate([*chunks, ""]):
        final = i == len(chunks)
        seen += chunk
        state, out, verdict = stopper.check_text(state, chunk, final)
        released.append(out)
        if verdict is not None:
            return released, verdict
        if not final:  # liveness: only a possible stop-string prefix is ever held
            assert "".join(released) == seen[:len(seen) - held_by_oracle(seen, stops)]
    return released, None


stop_lists = st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3,
                      unique=True)


@PROPERTY
@given(st.data())
def test_stop_strings_match_the_oracle_under_any_chunking(data: st.DataObject) -> None:
    stops = data.draw(stop_lists)
    text = data.draw(st.text("abcd", max_size=30))
    if data.draw(st.booleans()):  # make a match likely
        at = data.draw(st.integers(0, len(text)))
        text = text[:at] + data.draw(st.sampled_from(stops)) + text[at:]
    chunks = split(text, data.draw(st.lists(st.integers(0, 64), max_size=12)))
    released, verdict = feed(chunks, stops)
    expected, stop = oracle(text, stops)
    assert "".join(released) == expected
    assert (verdict.detail if verdict else None) == stop
    if verdict is not None:
        assert verdict.reason is FinishReason.STOP_STRING
        assert len(expected) + len(stop or "") <= len(text)


@PROPERTY
@given(st.text(st.sampled_from("xy中文🤗</>"), max_size=30),
       st.lists(st.integers(0, 64), max_size=12))
def test_unicode_stop_string_split_anywhere(text: str, cuts: list[int]) -> None:
    stops = ["</文>", "🤗🤗"]
    released, verdict = feed(split(text, cuts), stops)
    expected, stop = oracle(text, stops)
    assert "".join(released) == expected
    assert (verdict.detail if verdict else None) == stop


def test_overlapping_stops_prefer_the_longer_one_ending_at_the_same_place() -> None:
    assert feed(["x", "a", "b", "zz"], ["ab", "b"]) == (
        ["x", "", ""], StopVerdict(FinishReason.STOP_STRING, "ab"))
    released, verdict = feed(["xb"], ["ab", "b"])
    assert released == ["x"] and verdict is not None and verdict.detail == "b"


def test_a_stop_inside_a_longer_one_ends_first() -> None:
    released, verdict = feed(["a", "b", "c", "d"], ["abcd", "bc"])
    assert "".join(released) == "a" and verdict is not None and verdict.detail == "bc"


def test_stop_split_over_many_chunks_is_trimmed_whole() -> None:
    chunks = ["Hello ", "<", "/", "s", "t", "o", "p", ">", " tail"]
    released, verdict = feed(chunks, ["</stop>"])
    assert "".join(released) == "Hello "
    assert not any(c in "".join(released[1:]) for c in "</stop>")
    assert verdict == StopVerdict(FinishReason.STOP_STRING, "</stop>")


def test_stop_at_the_very_beginning_releases_nothing() -> None:
    released, verdict = feed(["STOP", "more"], ["STOP"])
    assert released == [""] and verdict is not None and verdict.detail == "STOP"


def test_a_prefix_that_never_completes_is_released_at_final() -> None:
    released, verdict = feed(["ok </st", "op"], ["</stop>"])
    assert released == ["ok ", "", "</stop"] and verdict is None


def test_text_after_a_match_is_dropped() -> None:
    stopper = StopStringStopper()
    state = stopper.start(request(stop=["##"]), CTX)
    state, out, verdict = stopper.check_text(state, "a##b", final=False)
    assert (out, verdict is not None) == ("a", True)
    assert stopper.check_text(state, "more", final=True)[1:] == ("", verdict)


def test_no_stop_strings_pass_text_through() -> None:
    stopper = StopStringStopper()
    state = stopper.start(request(), CTX)
    assert stopper.check_text(state, "<", final=False) == (state, "<", None)
    assert stopper.check_token(state, EOS, 1) is None


def brute_force(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """A second, deliberately naive oracle: list every occurrence of every stop string, take
    the one with the smallest (end, start), and release the text before it."""
    found = [(at + len(s), at, s) for s in stops for at in range(len(text))
             if text[at:at + len(s)] == s]
    if not found:
        return text, None
    _, at, stop = min(found)
    return text[:at], stop


def random_pieces(text: str, cuts: Sequence[int]) -> list[str]:
    """``text`` cut at ``cuts`` (taken modulo its length); repeated cuts give empty pieces."""
    points = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(points, points[1:])]


ab_stops = st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4)


@PROPERTY
@given(st.data())
def test_streaming_automata_match_a_brute_force_oracle_on_a_tiny_alphabet(
        data: st.DataObject) -> None:
    """Two letters make overlaps, repeats and self-overlapping stops ("aab", "abab") common;
    after every call exactly the naive longest suffix that is a proper prefix is held."""
    stops = data.draw(ab_stops)
    text = data.draw(st.text("ab", max_size=40))
    pieces = random_pieces(text, data.draw(st.lists(st.integers(0, 64), max_size=16)))
    stopper = StopStringStopper()
    state = stopper.start(request(stop=stops), CTX)
    released, seen, verdict = "", "", None
    for i, piece in enumerate([*pieces, ""]):
        final = i == len(pieces)
        seen += piece
        state, out, verdict = stopper.check_text(state, piece, final)
        released += out
        if verdict is not None:
            break
        held = 0 if final else held_by_oracle(seen, stops)
        assert len(state.held) == held and state.held == seen[len(seen) - held:]
        assert released == seen[:len(seen) - held]
    assert (released, verdict.detail if verdict else None) == brute_force(text, stops)
    assert state.held == ""
    if verdict is not None:  # everything after a match is dropped
        assert stopper.check_text(state, "ab", final=False) == (state, "", verdict)


@contextmanager
def address_space_cap(extra: int) -> Iterator[None]:
    """Lower this process's address-space limit to its current size plus ``extra`` bytes, so
    that a memory blow-up raises MemoryError in the test instead of getting the whole run
    killed by the kernel. Does nothing where the limit or /proc is unavailable."""
    try:
        import resource

        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
    except (ImportError, OSError):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = min(c for c in (size + extra, soft, hard) if c != resource.RLIM_INFINITY)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_long_stop(stop: str, text: str) -> tuple[str, StopVerdict | None]:
    """Start a request with the one stop string and feed ``text`` a few characters at a time,
    as tokens arrive, then a final call."""
    stopper = StopStringStopper()
    state = stopper.start(request(stop=[stop]), CTX)
    pieces = random_pieces(text, random.Random(1).choices(range(len(text)), k=len(text) // 3))
    released: list[str] = []
    for i, piece in enumerate([*pieces, ""]):
        state, out, verdict = stopper.check_text(state, piece, final=i == len(pieces))
        released.append(out)
    return "".join(released), verdict


def test_a_one_mebibyte_stop_string_costs_linear_memory_and_time() -> None:
    """A 1 MiB stop string once made a quadratic table of all its prefixes, and the server was
    killed for memory. Its state plus 10,000 characters of text must now stay well inside a
    small multiple of the string (the failure table is 4 bytes a character), and be quick."""
    stop = "ab" * 2**19  # periodic, so the failure table holds large values
    text = "".join(random.Random(0).choices("ab", k=10_000))
    size = sys.getsizeof(stop)
    with address_space_cap(2**30):
        tracemalloc.start()
        try:
            assert run_long_stop(stop, text) == (text, None)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        # timed apart (tracemalloc slows allocation a lot), on this process's CPU clock: the
        # work it did, not how long a loaded machine made it wait
        began = time.process_time()
        run_long_stop(stop, text)
        seconds = time.process_time() - began
    assert peak < 8 * size, f"peak {peak / size:.1f} x the stop string"
    assert seconds < 2.0


# --- token stoppers --------------------------------------------------------------------------


def eos_verdicts(stopper: EosStopper, state: EosState, token: int, upto: int
                 ) -> list[StopVerdict | None]:
    return [stopper.check_token(state, token, g) for g in range(1, upto + 1)]


def test_eos_ends_with_the_token_id_and_drops_its_text() -> None:
    stopper = EosStopper()
    state = stopper.start(request(), CTX)
    assert stopper.check_token(state, EOS, 1) == StopVerdict(FinishReason.EOS, EOS, False)
    assert stopper.check_token(state, 5, 1) is None
    assert stopper.check_text(state, "t", True) == (state, "t", None)


def test_ignore_eos_and_stop_token_ids() -> None:
    stopper = EosStopper()
    state = stopper.start(request(ignore_eos=True, stop_token_ids=[7, EOS]), CTX)
    assert stopper.check_token(state, 7, 1) == StopVerdict(FinishReason.STOP_TOKEN, 7, False)
    assert stopper.check_token(state, EOS, 1) == StopVerdict(FinishReason.STOP_TOKEN, EOS)
    state = stopper.start(request(ignore_eos=True), CTX)
    assert stopper.check_token(state, EOS, 1) is None


def test_eos_that_is_also_a_stop_token_reports_eos() -> None:
    stopper = EosStopper()
    state = stopper.start(request(stop_token_ids=[EOS]), CTX)
    verdict = stopper.check_token(state, EOS, 1)
    assert verdict is not None and verdict.reason is FinishReason.EOS


@pytest.mark.parametrize("token", [EOS, 7])
def test_min_tokens_outputs_must_exist_before_a_stop(token: int) -> None:
    stopper = EosStopper()
    state = stopper.start(request(min_tokens=3, stop_token_ids=[7]), CTX)
    verdicts = eos_verdicts(stopper, state, token, 5)
    assert verdicts[:3] == [None, None, None]  # outputs 1..3 cannot stop
    assert all(v is not None for v in verdicts[3:])  # output 4 has 3 outputs before it


def test_max_tokens_keeps_the_last_token() -> None:
    stopper = MaxTokensStopper()
    state = stopper.start(request(max_tokens=3), CTX)
    assert [stopper.check_token(state, 9, g) for g in (1, 2)] == [None, None]
    assert stopper.check_token(state, 9, 3) == StopVerdict(FinishReason.LENGTH, 3, True)
    assert stopper.check_text(state, "x", False) == (state, "x", None)


def test_deadline_measured_from_acceptance() -> None:
    now = [CTX.accepted_ns]
    stopper = DeadlineStopper(clock=lambda: now[0])
    state = stopper.start(request(limits={"deadline_s": 0.5}), CTX)
    assert stopper.check_token(state, 9, 1) is None
    now[0] = CTX.accepted_ns + 499_999_999
    assert stopper.check_token(state, 9, 2) is None
    now[0] = CTX.accepted_ns + 500_000_000
    verdict = stopper.check_token(state, 9, 3)
    assert verdict == StopVerdict(FinishReason.DEADLINE, "deadline_s=0.5", True)


def test_no_deadline_never_stops() -> None:
    stopper = DeadlineStopper(clock=lambda: 10**30)
    state = stopper.start(request(), CTX)
    assert state == DeadlineState(None, None)
    assert stopper.check_token(state, 9, 1) is None


def test_deadline_default_clock_is_monotonic() -> None:
    import time

    stopper = DeadlineStopper()
    ctx = StopContext(frozenset(), time.monotonic_ns() - 2_000_000_000)
    state = stopper.start(request(limits={"deadline_s": 1.0}), ctx)
    assert stopper.check_token(state, 9, 1) is not None


# --- chain and registry ----------------------------------------------------------------------


def test_registry_names_and_unknown_name() -> None:
    assert set(STOPPERS) == set(DEFAULT_STOPPERS)
    assert [make_stopper(n).name for n in DEFAULT_STOPPERS] == list(DEFAULT_STOPPERS)
    with pytest.raises(UnknownNameError) as e:
        make_stopper("nope")
    assert isinstance(e.value, RegistryError) and "eos" in e.value.available
    with pytest.raises(TypeError):
        STOPPERS["x"] = EosStopper  # type: ignore[index]


def test_every_stopper_satisfies_the_protocol() -> None:
    typed: list[Stopper[Any]] = [EosStopper(), MaxTokensStopper(), DeadlineStopper(),
                                 StopStringStopper(), StopperChain.from_names()]
    eos: Stopper[EosState] = EosStopper()
    strings: Stopper[StopStringState] = StopStringStopper()
    assert all(isinstance(s, Stopper) for s in [*typed, eos, strings])


def test_chain_token_verdicts_in_order() -> None:
    chain = StopperChain.from_names()
    state = chain.start(request(max_tokens=2), CTX)
    assert chain.check_token(state, 9, 1) is None
    eos = chain.check_token(state, EOS, 2)
    assert eos is not None and eos.reason is FinishReason.EOS  # eos comes before max_tokens
    length = chain.check_token(state, 9, 2)
    assert length is not None and length.reason is FinishReason.LENGTH


def test_chain_flushes_later_stoppers_when_an_earlier_one_matches() -> None:
    chain = StopperChain([StopStringStopper(), StopStringStopper()])
    first, second = chain.stoppers
    req = request(stop=["END"])
    state = (first.start(req, CTX), second.start(request(stop=["<x>"]), CTX))
    state, out, verdict = chain.check_text(state, "ab<", final=False)
    assert (out, verdict) == ("ab", None)  # "<" held by the second stopper
    state, out, verdict = chain.check_text(state, "END", final=False)
    assert out == "<" and verdict is not None and verdict.detail == "END"


def test_chain_prefers_the_earlier_match_of_a_later_stopper() -> None:
    chain = StopperChain([StopStringStopper(), StopStringStopper()])
    first, second = chain.stoppers
    state = (first.start(request(stop=["END"]), CTX), second.start(request(stop=["<x"]), CTX))
    state, out, verdict = chain.check_text(state, "a<", final=False)
    state, out2, verdict = chain.check_text(state, "xEND", final=False)
    assert out + out2 == "a" and verdict is not None and verdict.detail == "<x"
