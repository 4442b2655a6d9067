"""The worked-trace scripts in examples/ still run and write their pages (into a tmp folder),
so docs/worked_traces can always be regenerated from real runs."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def docs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _trace_doc

    monkeypatch.setattr(_trace_doc, "DOCS", tmp_path)
    return tmp_path


@pytest.mark.parametrize("script, pages", [
    ("trace_sky.py", ["1_sky.md", "1_sky_timeline.svg", "1_sky.perfetto.json"]),
    ("trace_endings.py", ["2_endings.md"]),
    ("trace_diverge.py", ["3_diverge.md"]),
    ("compare_layers.py", ["4_layers.md"]),
])
def test_worked_trace_script_writes_its_page(docs: Path, script: str, pages: list[str]) -> None:
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    for page in pages:
        assert (docs / page).stat().st_size > 0
    text = (docs / pages[0]).read_text()
    assert "VIOLATED" not in text
    if script == "compare_layers.py":
        assert "first layer beyond tolerance: layers.2.attention at step 1" in text
        assert "layers: every tap within noise at every step compared" in text
        assert "layers: first differ at step 1, from layers.2.attention" in text
    if script == "trace_diverge.py":
        assert text.count("earliest internal difference: the model's scores for the first "
                          "token (prefill logits) at step 1") == 2
