"""The GPU benchmark and the tuner of the Triton MoE, run on the CPU (``--cpu-smoke``).

Both scripts run as subprocesses through the Triton interpreter on tiny shapes; the tests
check their logic against independent arithmetic: bytes and FLOPs from the layer shapes,
roofline fractions from the H200 peaks, and the tuner's choice from its own trial log.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SMOKE_SHAPES = {"qwen3-like-tiny": (16, 8, 64, 32), "mixtral-like-tiny": (4, 2, 64, 48)}


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--cpu-smoke",
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_gpu_benchmark_smoke_run_reports_consistent_figures(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    printed = _run("moe_gpu.py", "--tokens", "1", "5", "--dtypes", "float16", "--tune",
                   "--out", str(out))
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["cpu_smoke"] is True
    assert sorted(Path(p).name for p in report["tuned_tables"]) == [
        "E=16,N=32,device_name=interpreter,dtype=float16.json",
        "E=4,N=48,device_name=interpreter,dtype=float16.json"]
    assert all(Path(p).parent == tmp_path / "moe_tables" for p in report["tuned_tables"])
    rows = report["rows"]
    assert [(r["shape"], r["M"]) for r in rows] == [
        (s, m) for s in SMOKE_SHAPES for m in (1, 5)]
    for r in rows:
        e, k, h, i = SMOKE_SHAPES[r["shape"]]
        m, used = r["M"], r["experts_used"]
        assert k <= used <= min(e, m * k)
        assert r["bytes"] == 2 * (used * 3 * h * i + 2 * m * h)
        assert r["flops"] == 2 * m * k * 3 * h * i
        assert r["triton_graph_us"] is None and r["triton_us"] == r["triton_eager_us"]
        seconds = r["triton_us"] * 1e-6
        assert r["hbm_fraction"] == pytest.approx(r["bytes"] / seconds / 4.8e12)
        assert r["peak_fraction"] == pytest.approx(r["flops"] / seconds / 989e12)
        assert r["speedup"] == pytest.approx(r["torch_us"] / r["triton_us"])
        assert r["parity_ok"] and r["rel_err_vs_torch"] <= 2e-2
        assert r["dtype"] == "float16" and r["timing"] == "wall"
    goals = report["goals"]
    assert goals["parity"] is True
    assert goals["never_slower_than_torch"] == all(r["triton_us"] <= r["torch_us"] for r in rows)
    assert "| mixtral-like-tiny | 5 | wall |" in printed and "goals:" in printed


def test_tuner_writes_the_fastest_correct_config_and_the_model_finds_it(
        tmp_path: Path) -> None:
    import torch

    from backends.triton_moe import TritonMoe
    from backends.triton_moe.configs import LaunchConfig, read_table

    trials_file = tmp_path / "trials.json"
    _run("moe_tune.py", "--experts", "4", "--top-k", "2", "--hidden", "64",
         "--intermediate", "32", "--dtype", "float32", "--batch-sizes", "1", "6",
         "--out", str(tmp_path), "--trials", str(trials_file))
    table = read_table(tmp_path / "E=4,N=32,device_name=interpreter,dtype=float32.json")
    trials = json.loads(trials_file.read_text())
    assert sorted(table) == [1, 6]
    for m, chosen in table.items():
        timed = [t for t in trials if t["M"] == m and t["us"] is not None]
        assert timed and all(t["rel_err"] <= 1e-5 for t in timed)
        assert chosen == LaunchConfig.from_dict(min(timed, key=lambda t: t["us"])["config"])
    moe = TritonMoe([tmp_path])
    w_gate_up = torch.zeros((4, 64, 64))
    assert moe.pick(torch.zeros((2, 64)), w_gate_up, 2) == table[1]
    assert moe.pick(torch.zeros((5, 64)), w_gate_up, 2) == table[6]
