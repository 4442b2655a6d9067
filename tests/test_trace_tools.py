"""Recording, `show`, the exporters, W3C trace context and the `pipeline trace` commands.

Oracles: the digests and top-k are recomputed from the backend's own logits with hashlib and
torch; the Perfetto output is checked against the Chrome trace-event format rules; the
OpenTelemetry export goes through the real SDK and its in-memory exporter.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import attrs
import pytest
import torch

from pipeline import build
from transports.cli import main
from pipeline.errors import TraceError
from pipeline.events import JsonlSink
from pipeline.contracts.model import PrefillChunk
from pipeline.trace import check, export_otel, load, show, to_perfetto, to_svg
from trace_runs import QUESTION

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def pipe():
    with build("tiny") as p:
        yield p


@pytest.fixture(scope="module")
def full(pipe):
    request = pipe.request(QUESTION, max_tokens=6, temperature=0.8, top_k=0, top_p=1.0,
                           repetition_penalty=1.0, seed=3, recording="full")
    return pipe.generate(attrs.evolve(request, client_metadata={"traceparent": TRACEPARENT}))


def _sha(row: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(row.float().contiguous().numpy().tobytes()).hexdigest()


def _beside(pipe: Any) -> Any:
    """A backend of one slot over the engine's model (the engine's own manages its KV blocks
    itself, so a bare slot call would be refused there)."""
    from backends.torch.backend import TorchBackend

    engine = pipe.engine.backend
    return TorchBackend(engine.model, engine.snapshot, num_slots=1,
                        max_context=min(engine.max_context, 512))


def test_prefill_logits_digest_and_top_k_are_those_of_the_backend(pipe, full) -> None:
    ids = [e for e in full.trace if e.event_type == "input.tokenized"][0].payload["input_ids"]
    backend = _beside(pipe)
    slot = backend.allocate()
    try:
        z1 = backend.prefill([PrefillChunk(slot, tuple(ids), 0, True)])[0]
    finally:
        backend.release(slot)
    record = [e for e in full.trace if e.event_type == "prefill.completed"][0].payload["logits"]
    assert record["digest"] == _sha(z1) and record["shape"] == [z1.shape[0]]
    values, top = torch.topk(z1.float(), 8)
    assert [t[0] for t in record["top"]] == top.tolist()
    # processed = z1 / T (temperature is the only active processor at step 1)
    selected = [e for e in full.trace if e.event_type == "token.selected"][0].payload
    assert selected["processed"]["digest"] == _sha(z1.float() / 0.8)
    probs = torch.softmax(z1.float() / 0.8, dim=0)
    assert selected["processed"]["top"][0][2] == pytest.approx(float(probs.max()), rel=1e-6)
    assert 0.0 <= selected["draw"] < 1.0


def test_greedy_processed_digest_is_the_raw_logits_digest(pipe) -> None:
    done = pipe.generate(QUESTION, max_tokens=3, temperature=0, repetition_penalty=1.0)
    ids = pipe.tokenize(QUESTION).input_ids
    backend = _beside(pipe)
    slot = backend.allocate()
    try:
        z1 = backend.prefill([PrefillChunk(slot, tuple(ids), 0, True)])[0]
    finally:
        backend.release(slot)
    selected = [e for e in done.trace if e.event_type == "token.selected"][0].payload
    assert selected["processed"] == {"digest": _sha(z1), "candidates": z1.shape[0]}


def test_digest_recording_keeps_digests_not_content(pipe) -> None:
    done = pipe.generate(QUESTION, max_tokens=4, temperature=0.8, seed=3)
    selected = [e for e in done.trace if e.event_type == "token.selected"]
    assert all("top" not in e.payload["processed"] and "draw" not in e.payload for e in selected)
    assert all(e.payload["processed"]["digest"].startswith("sha256:") for e in selected)


def test_traceparent_reaches_the_trace_and_both_exports(full) -> None:
    for name in ("request.accepted", "request.normalized"):
        event = [e for e in full.trace if e.event_type == name][0]
        assert event.payload["traceparent"]["trace_id"] == TRACEPARENT.split("-")[1]
    perfetto = to_perfetto(full)
    assert perfetto["otherData"]["traces"][0]["w3c_trace_id"] == TRACEPARENT.split("-")[1]

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    export_otel(full, provider.get_tracer("test"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans["pipeline.request"]
    assert f"{root.context.trace_id:032x}" == TRACEPARENT.split("-")[1]
    assert f"{root.parent.span_id:016x}" == TRACEPARENT.split("-")[2]
    assert spans["pipeline.prefill"].parent.span_id == root.context.span_id
    assert {s.context.trace_id for s in spans.values()} == {root.context.trace_id}
    assert [e.name for e in root.events] == [e.event_type for e in full.trace]
    assert root.start_time <= spans["pipeline.prefill"].start_time <= root.end_time


def test_an_invalid_traceparent_is_ignored_with_the_reason(pipe) -> None:
    request = pipe.request(QUESTION, max_tokens=2, temperature=0)
    done = pipe.generate(attrs.evolve(request, client_metadata={"traceparent": "00-zz-01"}))
    accepted = done.trace[0].payload
    assert "traceparent" not in accepted and "00-<32 hex>" in accepted["traceparent_ignored"]


def test_perfetto_export_follows_the_trace_event_format(full) -> None:
    data = json.loads(json.dumps(to_perfetto(full)))
    events = data["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "X", "i"}
    for e in events:
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["tid"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    named = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in events if e["ph"] != "M"} <= named
    instants = [e for e in events if e["ph"] == "i"]
    assert [e["args"]["event_id"] for e in instants] == [e.event_id for e in full.trace]
    phases = [e["name"] for e in events if e["ph"] == "X"]
    assert phases[:4] == ["request", "prepare", "queue", "prefill"]
    assert "select 1" in phases and "decode 1" in phases


def test_show_and_svg_render_the_timeline(full) -> None:
    text = show(full)
    assert "traceparent trace-id 4bf92f3577b34da6a3ce929d0e0e4736" in text
    for e in full.trace:
        assert f"e{e.event_id} " in text and e.event_type in text
    root = ElementTree.fromstring(to_svg(full))
    assert root.tag.endswith("svg")
    ns = "{http://www.w3.org/2000/svg}"
    bars = [r for r in root.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
    decoded = sum(e.event_type == "decode.completed" for e in full.trace)
    assert len(bars) == 3 + len(full.token_ids) + decoded  # prepare, queue, prefill + steps
    ticks = [line for line in root.iter(f"{ns}line") if line.find(f"{ns}title") is not None]
    assert len(ticks) == sum(e.event_type == "stream.delta" for e in full.trace)


def test_cli_check_diff_show_export_and_exit_status(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    with build("tiny", sinks=[JsonlSink(a)]) as p:
        p.generate(QUESTION, max_tokens=5, temperature=0, recording="full")
    with build("tiny", sinks=[JsonlSink(b)]) as p:
        p.generate(QUESTION, max_tokens=5, temperature=0.9, seed=4)
    assert main(["trace", "check", str(a)]) == 0
    assert "5. streamed bytes" in capsys.readouterr().out
    assert main(["trace", "diff", str(a), str(a)]) == 0
    assert main(["trace", "diff", str(a), str(b)]) == 1
    assert "earliest internal difference" in capsys.readouterr().out
    assert main(["trace", "diff", str(a), str(b), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["divergence"]["product"] == "processor order"  # T=0: none; T=0.9: temperature
    assert report["shared_level"] == "model"
    broken = tmp_path / "broken.jsonl"
    lines = a.read_text().splitlines()
    broken.write_text("\n".join(line for line in lines if "resources.released" not in line))
    assert main(["trace", "check", str(broken)]) == 1
    assert "invariant 0 violated" in capsys.readouterr().out
    assert main(["trace", "check", str(broken), "--json"]) == 1
    assert [v["invariant"] for v in json.loads(capsys.readouterr().out)["violations"]] == [0]
    out = tmp_path / "t.json"
    assert main(["trace", "export", str(a), "--format", "perfetto", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]
    assert main(["trace", "show", str(a), "--limit", "3"]) == 0
    svg = tmp_path / "t.svg"
    assert main(["trace", "export", str(a), "--format", "svg", "-o", str(svg)]) == 0
    assert ElementTree.parse(svg).getroot().tag.endswith("svg")
    capsys.readouterr()
    assert main(["trace", "export", str(a), "--format", "otel"]) == 0
    assert '"name": "pipeline.request"' in capsys.readouterr().out
    assert main(["trace", "check", str(tmp_path / "missing.jsonl")]) == 2
    assert "no such trace file" in capsys.readouterr().err


def test_load_names_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"trace_id": "x"}\nnot json\n')
    with pytest.raises(TraceError, match="lacks the field"):
        load(bad)
    two = tmp_path / "two.jsonl"
    with build("tiny", sinks=[JsonlSink(two)]) as p:
        first = p.generate(QUESTION, max_tokens=2, temperature=0)
        p.generate(QUESTION, max_tokens=2, temperature=0)
    with pytest.raises(TraceError, match="several traces"):
        load(two)
    assert check(two, trace_id=first.request_id).ok
