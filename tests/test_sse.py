"""SSE framing: the pure encoder and decoder, split at every byte, against the openai SDK's
own SSE decoder as an independent oracle, and against the standard's worked examples."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from openai._streaming import SSEDecoder as OpenAIDecoder

from pipeline.errors import InvalidValueError
from transports.sse import SSEDecoder, SSEEvent, encode, encode_comment

EVENTS = [
    SSEEvent('{"type": "message_start", "text": "héllo wörld ✓ 🎉"}', "message_start"),
    SSEEvent("line one\nline two\n\nline four"),
    SSEEvent("[DONE]"),
    SSEEvent("", "ping", "7"),
    SSEEvent(json.dumps({"delta": "a\r\nb"}), None, "id-1"),
]


def decode_all(wire: bytes, cuts: list[int]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    out: list[SSEEvent] = []
    at = 0
    for cut in [*cuts, len(wire)]:
        out += decoder.feed(wire[at:cut])
        at = cut
    return out + decoder.close()


def oracle(wire: bytes) -> list[SSEEvent]:
    return [SSEEvent(e.data, e.event, e.id)
            for e in OpenAIDecoder().iter_bytes(iter([wire]))]


def test_every_single_split_decodes_the_same_events() -> None:
    wire = b"".join(encode(e) for e in EVENTS) + encode_comment("keep-alive")
    expected = EVENTS
    assert decode_all(wire, []) == expected
    for cut in range(len(wire) + 1):
        assert decode_all(wire, [cut]) == expected, cut
    assert decode_all(wire, list(range(1, len(wire)))) == expected  # one byte at a time


def test_encoder_agrees_with_the_openai_sdk_decoder() -> None:
    wire = b"".join(encode(e) for e in EVENTS)
    assert oracle(wire) == EVENTS


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(), st.sampled_from([None, "delta", "ping"])), min_size=1,
                max_size=4), st.lists(st.integers(0, 400), max_size=6))
def test_random_events_round_trip_at_random_splits(events: list[tuple[str, str | None]],
                                                   cuts: list[int]) -> None:
    sent = [SSEEvent(d.replace("\r\n", "\n").replace("\r", "\n"), e) for d, e in events]
    wire = b"".join(encode(e) for e in sent)
    cuts = sorted(min(c, len(wire)) for c in cuts)
    assert decode_all(wire, cuts) == sent
    assert oracle(wire) == sent


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_standard_examples_with_every_line_ending(eol: bytes) -> None:
    # WHATWG HTML 9.2.5 examples: comments, a field with no colon, a space after the colon
    lines = [b": test stream", b"", b"data: first event", b"id: 1", b"", b"data:second event",
             b"id", b"", b"data:  third event", b"", b"data", b"", b"data", b"data", b"",
             b"data:", b"event: x"]
    wire = b"\xef\xbb\xbf" + eol.join(lines) + eol
    expected = [SSEEvent("first event", None, "1"), SSEEvent("second event", None, ""),
                SSEEvent(" third event"), SSEEvent(""), SSEEvent("\n")]
    for cut in range(len(wire) + 1):
        assert decode_all(wire, [cut]) == expected, (eol, cut)


def test_an_unterminated_event_is_dropped_and_names_have_no_line_breaks() -> None:
    assert decode_all(b"data: partial", []) == []
    with pytest.raises(InvalidValueError, match="event"):
        encode(SSEEvent("x", "two\nlines"))
