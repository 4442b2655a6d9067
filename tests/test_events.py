"""Events: JSONL sink round trip, digest-only payloads by default, content on request."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.events import JsonlSink, MemorySink, read_jsonl
from pipeline.testing import ByteTokenizer, ScriptedBackend, build_scripted, peaked

V = ByteTokenizer.VOCAB


def test_jsonl_and_memory_sinks_receive_the_whole_trace(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    memory = MemorySink()
    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 67)),
                        sinks=[memory, JsonlSink(path)]) as pipe:
        done = pipe.generate("secret words", max_tokens=4, temperature=0)
    from_file = read_jsonl(path)
    assert list(done.trace) == memory.events

    def normal(e):  # JSON turns tuples into lists; compare in JSON form
        return json.loads(json.dumps(e.to_json(), default=str))

    assert [normal(e) for e in from_file] == [normal(e) for e in done.trace]
    assert {e.trace_id for e in from_file} == {done.request_id}


def test_payloads_hold_digests_unless_full_recording_is_asked() -> None:
    with build_scripted(ScriptedBackend(V, peaked(V, lambda t: 67))) as pipe:
        plain = pipe.generate("secret words", max_tokens=4, temperature=0)
        full = pipe.generate("secret words", max_tokens=4, temperature=0, recording="full")
    assert "secret" not in repr([e.payload for e in plain.trace])
    rendered = [e for e in full.trace if e.event_type == "context.rendered"][0]
    assert "secret words" in rendered.payload["text"]
    deltas = [e.payload["text"] for e in full.trace if e.event_type == "stream.delta"]
    assert "".join(deltas) == full.text == "CCCC"
    instance = [e for e in plain.trace if e.event_type == "request.normalized"][0].payload
    for key in ("model_snapshot", "template_version", "tokenizer_version", "seed",
                "environment", "generation_config"):
        assert instance[key] is not None, key
