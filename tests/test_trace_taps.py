"""Traces recorded with layer taps (``recording="taps"``): what each step records, the
tensors a window keeps and its bound, ``pipeline trace diff`` locating a planted layer, and
the refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import build
from pipeline.contracts.request import Request, TapWindow
from pipeline.errors import InvalidValueError
from pipeline.trace.diff import diff
from pipeline.trace.load import load
from test_compare import save, stages

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    def perturb(model: Any) -> None:
        w = model.model.layers[1].self_attn.o_proj.weight
        w.add_(0.01 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))

    return (save(tmp_path_factory.mktemp("base")),
            save(tmp_path_factory.mktemp("perturbed"), perturb))


def run(folder: Path, **options: Any) -> Any:
    with build(folder, **stages()) as pipe:
        return pipe.generate("Why is the sky blue?", max_tokens=4, temperature=0, **options)


def test_each_step_records_every_layer_and_the_window_keeps_its_tensors(folders) -> None:
    done = run(folders[0], recording="taps", tap_tensors="2:1-2")
    trace = load(done)
    names = ["embed"] + [f"layers.{i}{part}" for i in range(4)
                         for part in (".attention", ".mlp", "")]
    for t in range(1, 5):
        taps = trace.sources()[t][0].payload["taps"]
        assert taps["step"] == t and taps["dtype"] == "float32" and taps["width"] == 64
        assert [r["name"] for r in taps["layers"]] == names
        kept = [r["name"] for r in taps["layers"] if "values" in r]
        assert kept == (names[4:10] if t == 2 else [])
        for record in taps["layers"]:
            assert record["digest"].startswith("sha256:") and record["rms"] > 0
            if "values" in record:
                values = torch.tensor(record["values"])
                assert values.shape == (64,)
                assert float(values.abs().max()) == pytest.approx(record["max_abs"])


@pytest.mark.parametrize("step", [1, 3])
def test_the_recorded_layers_are_transformers_own_hidden_states(folders, step: int) -> None:
    """The oracle: transformers' ``output_hidden_states`` on the same folder, at the position
    whose logits the step produced (the prompt's last, then each fed token): ``embed`` is
    its entry 0 and ``layers.i`` its entry i + 1 (the last layer's entry is after the final
    norm, so it is left out)."""
    import transformers

    done = run(folders[0], recording="taps", tap_tensors=f"{step}:0-3")
    trace = load(done)
    with build(folders[0], **stages()) as pipe:
        prompt = list(pipe.tokenize("Why is the sky blue?").input_ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folders[0])).eval()
    ids = prompt + list(done.token_ids[:step - 1])
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    taps = {r["name"]: r for r in trace.sources()[step][0].payload["taps"]["layers"]}
    expected = {"embed": states[0][0, -1], **{f"layers.{i}": states[i + 1][0, -1]
                                               for i in range(3)}}
    for name, oracle in expected.items():
        ours = torch.tensor(taps[name]["values"])
        torch.testing.assert_close(ours, oracle, atol=2e-5, rtol=1e-4)
        assert taps[name]["max_abs"] == pytest.approx(float(oracle.abs().max()), rel=1e-4)
        assert taps[name]["rms"] == pytest.approx(float(oracle.pow(2).mean().sqrt()), rel=1e-4)


def test_taps_change_no_result(folders) -> None:
    plain, tapped = run(folders[0], recording="full"), run(folders[0], recording="taps")
    assert plain.token_ids == tapped.token_ids
    report = diff(plain, tapped)
    assert report.divergence is None and report.layers is None


def test_the_window_is_bounded(folders, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipeline.engine.recorder as recorder

    monkeypatch.setattr(recorder, "MAX_TAP_VALUES", 150)  # two rows of 64
    done = run(folders[0], recording="taps", tap_tensors="1:0-3")
    layers = load(done).sources()[1][0].payload["taps"]["layers"]
    assert [r["name"] for r in layers if "values" in r] == ["embed", "layers.0.attention"]


def test_trace_diff_locates_a_planted_layer(folders) -> None:
    a = run(folders[0], recording="taps", tap_tensors="1:0-3")
    b = run(folders[1], recording="taps", tap_tensors="1:0-3")
    report = diff(a, b)
    assert report.layers is not None
    assert (report.layers.step, report.layers.first) == (1, "layers.1.attention")
    beyond = report.layers.first_beyond
    assert beyond is not None and beyond.name == "layers.1.attention"
    same = [t.name for t in report.layers.taps if t.same]
    assert same == ["embed", "layers.0.attention", "layers.0.mlp", "layers.0"]
    text = report.render()
    assert "layers: first differ at step 1, from layers.1.attention" in text
    assert report.to_json()["layers"]["first_beyond"] == "layers.1.attention"
    # without tensors the digests still name the layer, the statistics bound the change
    c = run(folders[1], recording="taps")
    plain = diff(run(folders[0], recording="taps"), c)
    assert plain.layers is not None and plain.layers.first == "layers.1.attention"
    assert plain.layers.first_beyond is None
    assert "layers.1.attention: differs (max |x|" in plain.render()


def test_taps_on_a_backend_without_them_are_refused() -> None:
    from pipeline.testing import ScriptedBackend, build_scripted, peaked

    with build_scripted(ScriptedBackend(300, peaked(300, lambda ids: 65))) as pipe:
        with pytest.raises(InvalidValueError, match="no layer taps"):
            pipe.generate("hi", max_tokens=2, recording="taps")


@pytest.mark.parametrize("value, words", [
    ("x", "STEP:FIRST-LAST"), ("0:1", "steps count from 1"), ("3:5-2", "first layer comes"),
    ("3:-1", "STEP:FIRST-LAST")])
def test_a_bad_window_is_refused_naming_it(value: str, words: str) -> None:
    with pytest.raises(InvalidValueError, match=words):
        Request(messages=[{"role": "user", "content": "hi"}], recording="taps",
                tap_tensors=value)


def test_a_window_needs_a_taps_recording() -> None:
    with pytest.raises(InvalidValueError, match="recording='taps'"):
        Request(messages=[{"role": "user", "content": "hi"}], recording="full",
                tap_tensors="1:0")
    assert TapWindow.parse("3:7") == TapWindow(3, 7, 7)
    assert TapWindow.parse({"step": 1, "first": 0, "last": 2}).holds("embed")


def test_the_command_line_records_taps_on_both_backends_and_diffs_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transports.cli.commands import main

    for backend in ("torch", "transformers"):
        assert main(["run", "--model", "tiny", "--backend", backend, "--temperature", "0",
                     "--max-tokens", "3", "--trace", str(tmp_path / f"{backend}.jsonl"),
                     "--record", "taps", "--tap-tensors", "1:0-1", "What is 2+2?"]) == 0
    capsys.readouterr()
    assert main(["trace", "diff", str(tmp_path / "torch.jsonl"),
                 str(tmp_path / "transformers.jsonl")]) == 1  # 1: the traces differ
    out = capsys.readouterr().out
    assert "layers: first differ at step 1" in out
    assert "layers.0.attention: differs by" in out and "within noise" in out
    assert main(["run", "--model", "tiny", "--tap-tensors", "1:0", "hi"]) == 1
    assert "give --record taps too" in capsys.readouterr().err


def test_a_requests_taps_are_bounded(folders, monkeypatch: pytest.MonkeyPatch) -> None:
    """A served trace stays bounded: past MAX_TAP_RECORDS the step says the budget is
    spent and no later step carries taps."""
    import pipeline.engine.recorder as recorder

    monkeypatch.setattr(recorder, "MAX_TAP_RECORDS", 30)  # two steps of 13 taps
    trace = load(run(folders[0], recording="taps"))
    taps = [trace.sources()[t][0].payload.get("taps") for t in range(1, 5)]
    assert [len(t["layers"]) for t in taps[:2]] == [13, 13]
    assert taps[2] == {"step": 3, "spent": 30} and taps[3] is None
