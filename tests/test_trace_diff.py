"""`pipeline.trace.diff` on pairs of real runs of the default model that differ in exactly one
thing: it names the product that one thing changes first, and the level the runs share.

Each expectation comes from outside the differ: which artifact or parameter was changed, the
runs' own token ids and texts compared directly, or a plain re-check of the stop rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import build
from pipeline.events import MemorySink
from pipeline.trace import diff, load
from trace_runs import QUESTION, copy_model, edit, is_, perturb_weight


@pytest.fixture(scope="module")
def pipe():
    with build("tiny") as p:
        yield p


def _run(pipe, **options):
    return pipe.generate(QUESTION, **{"max_tokens": 8, "temperature": 0, **options})


def test_identical_runs_share_every_level(pipe) -> None:
    a, b = _run(pipe, recording="full"), _run(pipe, recording="full")
    report = diff(a, b)
    assert report.divergence is None and report.shared_level == "system"
    assert report.steps_compared == len(a.token_ids)


def test_another_chat_template_diverges_at_the_rendered_bytes(pipe, tmp_path: Path) -> None:
    folder = copy_model(tmp_path / "model")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{- 'Answer briefly.\\n' }}" + config["chat_template"]
    config_path.write_text(json.dumps(config))
    with build(folder) as other:
        b = _run(other, recording="full")
    a = _run(pipe, recording="full")
    report = diff(a, b)
    assert report.divergence.product == "rendered bytes"
    assert report.shared_level == "none"
    assert "template_version" in {key for key, _, _ in report.declared}
    assert "'Answer briefly" in report.divergence.detail


def _drop_merge_used_by(folder: Path, pipe) -> list[str]:
    """Remove the BPE merge that forms the longest token of the question; returns it."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    inverse = {i: s for s, i in data["model"]["vocab"].items()}
    ids = pipe.tokenize(QUESTION).input_ids
    pieces = sorted((inverse[i] for i in ids if i in inverse), key=len, reverse=True)
    merges = data["model"]["merges"]
    merge = next(m for piece in pieces for m in merges if m[0] + m[1] == piece)
    merges.remove(merge)
    path.write_text(json.dumps(data))
    return merge


def test_another_tokenizer_diverges_at_the_token_ids(pipe, tmp_path: Path) -> None:
    folder = copy_model(tmp_path / "model")
    _drop_merge_used_by(folder, pipe)
    with build(folder) as other:
        b = _run(other, recording="full")
        assert other.tokenize(QUESTION).input_ids != pipe.tokenize(QUESTION).input_ids
    a = _run(pipe, recording="full")
    report = diff(a, b)
    assert report.divergence.product == "token ids"
    assert report.shared_level == "none"
    assert "tokenizer_version" in {key for key, _, _ in report.declared}


def test_one_weight_perturbed_by_1e_3_diverges_at_the_prefill_logits(pipe, tmp_path) -> None:
    folder = copy_model(tmp_path / "model")
    old, new = perturb_weight(folder, "model.layers.0.self_attn.q_proj.weight")
    assert 0 < abs(new - old) <= 1.1e-3
    # float32 activations: in the shipped bfloat16 the top logits are rounded to 1/16 near 10,
    # which hides a shift this small
    with build(folder, options={"dtype": "float32"}) as other:
        b = _run(other, recording="full")
    with build("tiny", options={"dtype": "float32"}) as same:
        a = _run(same, recording="full")
    report = diff(a, b)
    d = report.divergence
    assert (d.product, d.step, d.level) == ("prefill logits", 1, "model")
    assert report.shared_level == "input"
    # full traces explain it: the top-k values moved by a small, nonzero amount
    assert "max |Δ|" in d.detail
    tops = [next(e for e in run.trace if e.event_type == "prefill.completed").payload["logits"]
            ["top"] for run in (a, b)]
    shift = max(abs(x[1] - y[1]) for x in tops[0] for y in tops[1] if x[0] == y[0])
    assert 0 < shift < 0.5
    # within a tolerance above the shift the model level holds (greedy: same tokens after)
    # (the difference grows over the steps, ~5x by step 5, so the tolerance is not 2x the shift)
    assert diff(a, b, atol=0.01).divergence is None
    assert diff(a, b, atol=shift / 2).divergence.product == "prefill logits"


def test_temperature_before_or_after_top_p_diverges_at_the_processor_order(pipe) -> None:
    options = dict(temperature=0.5, top_p=0.8, seed=11, recording="full")
    a = _run(pipe, processor_order=("temperature", "top_p"), **options)
    b = _run(pipe, processor_order=("top_p", "temperature"), **options)
    report = diff(a, b)
    assert (report.divergence.product, report.divergence.step) == ("processor order", 1)
    assert report.shared_level == "model"
    first = [next(e for e in run.trace if e.event_type == "token.selected") for run in (a, b)]
    # and the order really changed the candidate set the selector saw
    assert first[0].payload["processed"]["candidates"] != first[1].payload["processed"]["candidates"]


def test_another_seed_diverges_at_the_rng(pipe) -> None:
    a = _run(pipe, temperature=0.9, seed=1)
    b = _run(pipe, temperature=0.9, seed=2)
    report = diff(a, b)
    assert (report.divergence.product, report.divergence.step) == ("rng", 1)
    assert report.shared_level == "model"


def _stop_step(pieces: list[str]) -> tuple[str, int]:
    """A stop string inside one step's text that no earlier text could start (no hold-back)."""
    for k in range(2, len(pieces)):
        stop = pieces[k - 1].strip()
        before = "".join(pieces[:k - 1])
        if len(stop) >= 2 and stop[0] not in before:
            return stop, k
    raise AssertionError(f"no usable stop string in {pieces}")


def test_a_stop_string_diverges_at_the_stop(pipe) -> None:
    a = _run(pipe, max_tokens=16, ignore_eos=True, recording="full")
    pieces = [e.payload["text"] for e in a.trace if e.event_type == "stream.delta"]
    stop, k = _stop_step(pieces)
    b = _run(pipe, max_tokens=16, ignore_eos=True, recording="full", stop=[stop])
    assert len(b.token_ids) == k and stop not in b.text
    report = diff(a, b)
    assert (report.divergence.product, report.divergence.step) == ("stop", k)
    assert report.divergence.b == "stop_string"


def _cancelled_after(pipe, sink: MemorySink, n: int):
    """A run cancelled the moment its n-th delta is pushed (a listener runs on the engine
    thread, so the moment does not depend on how fast a consumer reads)."""
    handle = pipe.submit(QUESTION, max_tokens=200, temperature=0, ignore_eos=True)
    seen = []

    def listener(delta) -> None:
        seen.append(delta)
        if len(seen) == n:
            handle.cancel()

    handle.add_listener(listener)
    handle.result()
    return load(sink.events, handle.request_id)


def test_the_moment_of_cancellation_is_where_runs_diverge() -> None:
    sink = MemorySink()
    with build("tiny", sinks=[sink]) as pipe:
        a = _cancelled_after(pipe, sink, 3)
        b = _cancelled_after(pipe, sink, 7)
    assert [len(t.of("token.selected")) for t in (a, b)] == [3, 7]
    report = diff(a, b)
    d = report.divergence
    assert (d.product, d.step, d.level) == ("cancellation", 3, "system")
    assert d.a == "cancelled" and d.b == "continued" and report.shared_level == "selection"


def test_an_environment_ending_names_the_product_over_a_stop(pipe) -> None:
    # A run whose last token coincided with a cancel: same tokens, another ending reason.
    a = _run(pipe, max_tokens=5, ignore_eos=True)
    b = edit(a.trace, is_("generation.finished"),
             lambda p: p.update(reason="cancelled", state="cancelled"))
    for x, y in ((a.trace, b), (b, a.trace)):
        d = diff(list(x), y).divergence
        assert (d.product, d.step, d.level) == ("cancellation", 5, "system")
