"""Every benchmark script's smoke mode (``--smoke``) runs end to end and writes its report.

Each test has ``benchmarks/smoke.py --serve`` run its script as ``X.py --smoke --out FILE`` in
a process of its own, forked from the runner after it imported torch and the library once (a
fresh interpreter per script would cost more than most smoke runs; ``BENCH_SMOKE_SPAWN=1``
runs each as ``python benchmarks/X.py`` instead), on one OpenMP thread, killed after 120 s.
It then checks exit status 0, and that the JSON the script wrote parses and holds what its
report always holds, with figures that make sense (positive rates, counts that add up, greedy
outputs that agree).
A new script in ``benchmarks/`` fails :func:`test_every_benchmark_script_has_a_smoke_check`
until it has a smoke mode and a check here.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
LIBRARIES = ("iterative_bounds", "moe_common", "random_checkpoint", "smoke")
"""Modules in ``benchmarks/`` that are no benchmark: ``iterative_bounds`` (the likelihoods
``iterative.py`` computes, checked by tests/test_bench_iterative.py), ``moe_common`` (shared by
the two MoE scripts), ``random_checkpoint`` (the random Qwen3 checkpoints of the expert-tier
and parallel scripts) and ``smoke`` (the runner)."""
TIMEOUT_S = 120
Report = Any
Check = Callable[[Report, Path, str], None]


def _positive(*values: Any) -> None:
    for value in values:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, values


# --- one check per script: (the JSON, where it is, the script's output) -----------------------

def _answer_quality(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["max_tokens"] == 8
    assert set(r["summary"]) == {"greedy", "T=0.7 top_p=0.9"}
    assert len(r["answers"]) == 3 * 2                      # 3 questions, greedy + one seed
    for a in r["answers"]:
        assert 1 <= a["tokens"] <= 8 and isinstance(a["good"], bool)
        assert a["good"] == (not a["why"])
    for s in r["summary"].values():
        assert s["of"] == 3 and s["runs"] == 1 and 0 <= s["good_min"] <= s["good_max"] <= 3
    assert "wrote" in log


def _loops(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["max_tokens"] == 8
    names = set(r["candidates"])
    assert set(r["summary"]) == names and "pipeline default" in names
    for name, s in r["summary"].items():
        mine = [a for a in r["answers"] if a["candidate"] == name]
        assert s["answers"] == len(mine) == 3                 # 3 prompts, one seed
        assert s["ended"] == sum(a["ended"] for a in mine) / 3
        assert s["loops"] == sum(a["loop"] for a in mine)
    for a in r["answers"]:
        assert 1 <= a["tokens"] <= 8
        assert a["ended"] == (a["finish"] in ("EOS", "STOP_TOKEN", "STOP_STRING"))
        assert a["loop"] is False or a["finish"] in ("LENGTH", "REPETITION")
    assert r["candidates"]["pipeline default"]["dry_multiplier"] > 0
    assert "wrote" in log


def _batch_invariance(r: Report, out: Path, log: str) -> None:
    (row,) = r["rows"]
    assert row["model"] == "tiny" and set(row["cells"]) == {"prefill", "decode", "decode x8"}
    for cell in row["cells"].values():
        _positive(cell["off_ms"], cell["on_ms"])
        assert cell["ratio"] == pytest.approx(cell["on_ms"] / cell["off_ms"])


def _default_model(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and any("llama.cpp" in s for s in r["skipped"])
    run = r["threads"]["1"]
    assert run["llama_cpp"] is None and run["transformers"] == {}
    ours = run["ours"]
    _positive(ours["decode"]["decode_tok_s"], ours["batch2"]["aggregate_tok_s"],
              ours["prefill16"]["prefill_tok_s"], ours["memory"]["peak_rss_mb"],
              ours["history"]["at_8_tok_s"], ours["history"]["at_32_tok_s"],
              ours["run_peak_rss_mb"])
    assert "llama.cpp skipped" in log


def _fairness(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and set(r["summary"]) == {"paced"}
    (run,) = r["runs"]["paced"]
    assert run["solo"]["gaps"] > 0 and run["arrival"]["gaps"] > 0
    assert run["arrival"]["long_prompt_tokens"] >= 160
    _positive(run["solo"]["p99_s"], run["arrival"]["p99_s"], run["arrival"]["long_ttft_s"])
    assert run["ratio"] == pytest.approx(run["arrival"]["p99_s"] / run["solo"]["p99_s"])


def _gguf_model(r: Report, out: Path, log: str) -> None:
    assert r["model"].endswith("llama-q4_1.gguf") and "transformers" in r["skipped"]
    assert set(r["load"]) == set(r["rates"]) == {"ours-dequantized", "ours-quantized"}
    for kind in r["load"]:
        _positive(r["load"][kind]["load_s"], r["load"][kind]["peak_rss_mb"],
                  r["rates"][kind]["prefill_tok_s"], r["rates"][kind]["decode_b1_tok_s"],
                  r["rates"][kind]["decode_b8_tok_s"])
    assert "transformers skipped" in log


def _gguf_types(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True
    rows = r["rows"]
    assert [x["type"] for x in rows] == ["Q4_0", "Q4_K", "Q5_K", "Q6_K"]
    for x in rows:
        assert x["threads"] == 1 and x["llama_cpp"] is None and x["ratio"] is None
        _positive(x["ours"]["decode_tok_s"], x["ours"]["build_s"], x["ours"]["weight_bytes"])
    assert rows[0]["per_bit_vs_q4_0"] == 1.0
    assert "load before:" in log and "load after:" in log


def _gguf_quants(r: Report, out: Path, log: str) -> None:
    rows = r["rows"]
    assert len(rows) == 2 * 2 * 4                          # cases x T x variants
    assert {x["qtype"] for x in rows} == {"Q8_0", "Q4_K"} and {x["T"] for x in rows} == {1, 8}
    for x in rows:
        _positive(x["median_ms"], x["min_ms"], x["weight_mib"])
        assert x["peak_extra_mib"] >= 0 and x["calls"] >= 2
        if x["variant"] == "dequantize+linear":
            assert x["vs_dequantize"] == 1.0


def _grammar_cost(r: Report, out: Path, log: str) -> None:
    assert r["vocab"] == 6144 and r["model"] == "tiny"
    rows = r["rows"]
    assert len(rows) == 2 * 5 * 2                          # batches x kinds x budgets
    assert {x["kind"] for x in rows} == {"json_schema", "json_object", "regex", "choice",
                                         "tool_call"}
    for x in rows:
        _positive(x["decode_step_ms"], x["grammar_step_ms"], x["path_tokens"])
        assert x["ratio"] == pytest.approx(x["grammar_step_ms"] / x["decode_step_ms"])


def _grammar_engines(r: Report, out: Path, log: str) -> None:
    installed = {name for name, module in (("xgrammar", "xgrammar"),
                                           ("llguidance", "llguidance"),
                                           ("outlines-core", "outlines_core"))
                 if importlib.util.find_spec(module) is not None}
    assert {x["engine"] for x in r["rows"]} == installed and "llguidance" in installed
    assert set(r["skipped"]) == {"xgrammar", "llguidance", "outlines-core"} - installed
    for x in r["rows"]:
        assert x["tokenizer"] == "tiny" and x["vocab"] == 6144
        _positive(x["mask_us_b1"], x["mask_us_b8"], x["apply_us_b1"], x["compile_ms"])


def _http_load(r: Report, out: Path, log: str) -> None:
    local, remote = r["rounds"]
    assert (local["phase"], remote["phase"]) == ("in-process", "http")
    for row in (local, remote):
        assert row["requests_failed"] == 0, row["errors"]
        _positive(row["tokens"], row["tokens_per_s"])
    assert local["tokens"] == remote["tokens"] == 4 * 4    # greedy: the same tokens both ways
    d = r["disconnects"]
    assert d["disconnects"] == 2 and d["client_errors"] == 0
    assert d["active_slots_after"] == 0 and d["queue_depth_after"] == 0
    assert 0 <= d["cancelled_records"] <= 2


def _overload(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["smoke"] and r["config"]["clients"] == 8
    limit, over = r["rows"]
    assert (limit["phase"], limit["clients"]) == ("limit", 4)  # 2 slots + 2 queue places
    assert (over["phase"], over["clients"]) == ("overload", 8)
    for row in (limit, over):
        assert row["errors"] == 0, row["error_examples"]
        _positive(row["completed_per_s"], row["median_s"])
    assert limit["refused"] == 0 and over["refused"] > 0  # 8 clients, 4 places
    assert r["server_log"]["error_lines"] == 0
    _positive(r["summary"]["rate_ratio"], r["summary"]["median_ratio"],
              r["summary"]["app_cpu_ms_per_refusal"])


def _iterative(r: Report, out: Path, log: str) -> None:
    assert [x["label"] for x in r["rows"]] == ["AR greedy", "llada L8 S4", "ddim L16 S20",
                                               "flow heun L16 S8"]
    for x in r["rows"]:
        assert 1 <= x["tokens"] <= 6 and x["forwards"]["prefill"] >= 1
        _positive(x["forwards_per_token"], x["tokens_per_s"], x["ar_perplexity"])
    assert r["rows"][0]["forwards_per_token"] == pytest.approx(1.0)
    held = r["held_out"]
    whole, cut = held["scopes"]["whole conversations"], held["scopes"]["first 16 tokens"]
    assert held["data"]["conversations"] == 1
    assert whole["tiny"]["tokens"] == whole["tiny-masked"]["tokens"] == held["data"]["tokens"] - 1
    assert cut["tiny"]["tokens"] == 15
    _positive(whole["tiny"]["nats_per_token"], whole["tiny-masked"]["nats_per_token"])


def _llama_cpp(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["model"].endswith("llama-q4_1.gguf") and r["skipped"]
    commands = r["threads"]["1"]["commands"]
    assert commands["bench"][0].endswith("llama-bench")
    assert commands["batched"][0].endswith("llama-batched-bench")
    assert r["model"] in commands["bench"] and "-npl" in commands["batched"]
    assert "llama.cpp skipped" in log


def _moe_gpu(r: Report, out: Path, log: str) -> None:
    assert r["cpu_smoke"] is True and r["gpu_run"] is False
    assert r["goals"]["parity"] is True and r["tuned_tables"] == []
    shapes = {"qwen3-like-tiny": (16, 8, 64, 32), "mixtral-like-tiny": (4, 2, 64, 48)}
    assert [(x["shape"], x["M"], x["dtype"]) for x in r["rows"]] == [
        (s, 1, "float32") for s in shapes]
    for x in r["rows"]:
        e, k, h, i = shapes[x["shape"]]
        assert x["flops"] == 2 * 1 * k * 3 * h * i and x["parity_ok"]
        assert x["bytes"] == 4 * (x["experts_used"] * 3 * h * i + 2 * h)
        _positive(x["triton_us"], x["torch_us"])
    assert "GPU part was not run" in log


def _moe_tune(r: Report, out: Path, log: str) -> None:
    assert r["configs"].keys() == {"1"}                   # the table: M=1's launch config
    trials = json.loads((out / "trials.json").read_text())
    timed = [t for t in trials if t["M"] == 1 and t["us"] is not None]
    assert timed and all(t["rel_err"] <= 1e-5 for t in timed)
    assert r["configs"]["1"] == min(timed, key=lambda t: t["us"])["config"]
    assert "GPU part was not run" in log


def _paged_kv(r: Report, out: Path, log: str) -> None:
    modes = r["best"]["current"]["tiny"]
    assert set(modes) == {"slot", "run", "manager", "tight", "scattered"}
    assert "baseline" not in r["best"]
    for m in modes.values():
        _positive(m["b1"], m["b8"], m["runs_b1"], m["runs_b8"])
    assert modes["run"]["runs_b1"] == 1 and modes["scattered"]["runs_b1"] > 1


def _prefix_cache(r: Report, out: Path, log: str) -> None:
    (run,) = r["runs"]
    assert run["cold_cached_tokens"] == 0                  # a fresh pipeline: nothing cached
    assert 0 < run["cached_tokens"] < run["prompt_tokens"] and run["cached_tokens"] % 16 == 0
    _positive(run["cold_s"], run["warm_s"])
    assert r["ratio_median"] == pytest.approx(run["cold_s"] / run["warm_s"])


def _kv_int8(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["smoke"] is True and r["prompts"] == 3
    b = r["bytes_per_position"]
    assert b["int8"] < b["bfloat16"] < b["float32"] and b["float32"] == 2 * b["bfloat16"]
    assert r["context_in_1_gib"]["int8"] > r["context_in_1_gib"]["float32"]
    assert 0 < r["logits"]["mean_abs_over_std"] <= r["logits"]["max_abs_over_std"]  # int8 on
    assert 0 <= r["logits"]["argmax_agreement"] <= 1
    assert 0 <= r["greedy"]["same_sequences"] <= r["greedy"]["of"] == 3
    _positive(r["decode_tok_s"]["full"], r["decode_tok_s"]["int8"])


def _expert_tiers(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and {row["model"] for row in r["rows"]} == {"tiny"}
    settings = [(row["setting"], row["policy"]) for row in r["rows"]]
    assert settings == [("full", "-")] + [(f, p) for f in ("100%", "50%", "25%")
                                           for p in ("lfu", "lru")]
    full = r["rows"][0]["resident_bytes"]
    for row in r["rows"]:
        assert 0 <= row["hit_rate"] <= 1 and 0 < row["resident_bytes"] <= full
        _positive(row["tok_s"])
    assert all(row["same_tokens"] is True for row in r["rows"][1:])  # capped vs the full
    assert r["rows"][-1]["resident_bytes"] <= full / 4


def _engine_restart(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["model"] == "tiny" and r["streams"] == 2
    (one,) = r["rounds"]
    _positive(one["first_error_s"], one["served_s"])
    assert one["first_error_s"] <= one["last_error_s"] < one["served_s"]
    assert one["health_after_errors"] == "restarting"


def _parallel(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["device"] == "cpu"
    assert [(row["model"], row["ranks"]) for row in r["rows"]] == [("tiny", 1), ("tiny", 2)]
    one, two = r["rows"]
    for row in r["rows"]:
        assert len(row["tokens"]) == 5
        _positive(row["prefill_tok_s"], row["decode_tok_s"])
    assert two["tokens"] == one["tokens"] and two["same_tokens"] is True  # 2 ranks vs 1
    assert one["communication"] == {"decode_ms": 0.0, "prefill_ms": 0.0}
    _positive(two["communication"]["decode_ms"], two["communication"]["prefill_ms"])


def _penalty_history(r: Report, out: Path, log: str) -> None:
    assert r["vocab_size"] == 4096 and r["smoke"] is True
    assert [x["history"] for x in r["results"]] == [10, 200]
    for x in r["results"]:
        _positive(x["ids_ms"], x["state_ms"])
        assert x["same_scores"] is True and x["batch"] == 4


def _processors(r: Report, out: Path, log: str) -> None:
    assert r["vocab_size"] == 4096 and r["smoke"] is True
    assert [(x["config"], x["B"]) for x in r["results"]] == [
        (c, b) for c in ("greedy", "full", "top_p_dense") for b in (1, 4)]
    for x in r["results"]:
        _positive(x["ours_ms"], x["transformers_ms"], x["ours_alone_ms"],
                  x["transformers_alone_ms"])


def _serve_memory(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["statuses"] == {"200": 2 + 6}
    assert [x["requests"] for x in r["rows"]] == [0, 2, 4, 6]
    _positive(r["rss_loaded_mb"], *(x["rss_mb"] for x in r["rows"]))


def _speculative(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and set(r["tasks"]) == {"edit_code"}
    assert r["same_output"] == {"edit_code": True}        # greedy speculative == plain
    plain, spec = r["tasks"]["edit_code"]["plain"], r["tasks"]["edit_code"]["k4"]
    assert plain["tokens"] == spec["tokens"] == 16
    _positive(plain["decode_tok_s"], spec["decode_tok_s"], spec["tokens_per_call"])
    assert set(r["backend_call_ms"]) == {"1_tokens_ms", "5_tokens_ms"}
    _positive(*r["backend_call_ms"].values())


def _startup(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["model"].endswith("llama-q4_1.gguf")
    assert set(r["commands"]) == {"run: first token", "run: exit", "count",
                                  "import pipeline (floor)"}
    for row in r["commands"].values():
        assert len(row["runs"]) == 1
        _positive(row["median"])
    first, done = r["commands"]["run: first token"], r["commands"]["run: exit"]
    assert first["median"] <= done["median"]
    assert list(r["build_phases"])[-1] == "first token (prefill)"


def _structured(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and 0 < r["compiled"] <= r["schemas"]
    assert r["compile_rate"] == pytest.approx(r["compiled"] / r["schemas"])
    assert len(r["refused"]) == r["schemas"] - r["compiled"]
    counts = r["generation"]
    assert sum(counts.values()) == len(r["results"]) == 1
    assert counts["invalid"] == 0                          # constrained output validates
    assert r["forced_calls"]["seeds"] == 1


def _torch_backend(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["shape"]["hidden_size"] == 64
    _positive(r["params"], r["prefill"]["ours_tok_s"], r["prefill"]["hf_tok_s"],
              r["roofline"]["copy_GBps"], r["memory"]["ours_peak_rss_MB"])
    for key in ("decode_b1", "decode_b8"):                 # a difference of two timings
        assert all(math.isfinite(v) for v in r[key].values())


def _trace_durability(r: Report, out: Path, log: str) -> None:
    assert r["smoke"] is True and r["events"] == 200 and r["calls"] == 5
    assert set(r["levels"]) == {"memory", "none", "flush", "fsync-boundary", "fsync"}
    for row in r["levels"].values():
        _positive(row["us_per_event"], row["us_per_step"], row["us_per_tool_call"])
    _positive(r["events_per_step"], r["decode_step_us"], r["ledger_us_per_call"])


def _trace_overhead(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["vocab"] == 6144 and r["rounds"] == 1
    assert set(r["results"]) == {"batch1", "batch8"}
    for rows in r["results"].values():
        assert set(rows) == {"off", "digest", "full", "digest+jsonl"}
        for row in rows.values():
            _positive(row["wall_tokens_per_s"], row["cpu_tokens_per_s"])
        assert rows["off"]["recording_share"] == 0.0
    _positive(r["digest_us_per_row"])


def _layer_taps(r: Report, out: Path, log: str) -> None:
    assert r["model"] == "tiny" and r["rounds"] == 1
    assert set(r["levels"]) == {"digest", "taps", "taps+tensors"}
    for row in r["levels"].values():
        _positive(row["decode_ms"], row["vs_digest"])
    assert set(r["backends"]) == {"torch", "transformers"}
    for row in r["backends"].values():
        _positive(row["decode_ms"], row["batch_tokens_per_s"])


CHECKS: dict[str, Check] = {
    "answer_quality": _answer_quality, "batch_invariance": _batch_invariance,
    "default_model": _default_model, "engine_restart": _engine_restart,
    "expert_tiers": _expert_tiers, "fairness": _fairness, "gguf_model": _gguf_model,
    "gguf_quants": _gguf_quants, "gguf_types": _gguf_types, "grammar_cost": _grammar_cost,
    "grammar_engines": _grammar_engines, "http_load": _http_load, "iterative": _iterative,
    "overload": _overload,
    "llama_cpp": _llama_cpp, "loops": _loops, "moe_gpu": _moe_gpu, "moe_tune": _moe_tune,
    "kv_int8": _kv_int8, "layer_taps": _layer_taps, "paged_kv": _paged_kv, "parallel": _parallel,
    "penalty_history": _penalty_history,
    "prefix_cache": _prefix_cache, "processors": _processors,
    "serve_memory": _serve_memory, "speculative": _speculative, "startup": _startup,
    "structured": _structured, "torch_backend": _torch_backend,
    "trace_durability": _trace_durability, "trace_overhead": _trace_overhead,
}


# --- the runs -------------------------------------------------------------------------------

class Runner:
    """``benchmarks/smoke.py --serve``: one process that imported the library once and runs
    each script named to it (forked, or spawned with ``BENCH_SMOKE_SPAWN=1``)."""

    def __init__(self, folder: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
        spawn = ["--spawn"] if os.environ.get("BENCH_SMOKE_SPAWN") else []
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / "smoke.py"), "--serve", "--dir", str(folder),
             "--timeout", str(TIMEOUT_S), *spawn],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        """The runner's next JSON line (it bounds each run by ``TIMEOUT_S`` itself)."""
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer
        raise AssertionError(f"the smoke runner stopped (exit {self.proc.wait()})")

    def run(self, name: str) -> dict[str, Any]:
        """``name --smoke --out ...``: exit status (None: timed out), seconds, out, log."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the runner this fixture started, by its handle
            self.proc.wait()


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runner]:
    started = Runner(tmp_path_factory.mktemp("bench-smoke"))
    try:
        yield started
    finally:
        started.close()


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_smoke_run(name: str, runner: Runner,
                   record_property: Callable[[str, object], None]) -> None:
    run = runner.run(name)
    record_property("smoke_seconds", run["seconds"])
    log = Path(run["log"]).read_text(errors="replace")
    assert run["rc"] == 0, (f"{name} --smoke exited {run['rc']} (None: killed after "
                            f"{TIMEOUT_S} s):\n{log[-6000:]}")
    out = Path(run["out"])
    assert out.exists(), f"{name} --smoke wrote no {out}:\n{log[-3000:]}"
    report = json.loads(next(out.glob("E=*.json")).read_text() if out.is_dir()
                        else out.read_text())
    CHECKS[name](report, out, log)


def test_every_benchmark_script_has_a_smoke_check() -> None:
    """Every script in benchmarks/ but the library modules has a smoke mode and a check here,
    and the runner agrees on which modules are libraries."""
    found = {p.stem for p in BENCH.glob("*.py")} - set(LIBRARIES)
    assert found == set(CHECKS), (
        f"no smoke check for {sorted(found - set(CHECKS))}; checks for missing scripts "
        f"{sorted(set(CHECKS) - found)}: give a new script --smoke and a check in CHECKS (or "
        "list a library module in LIBRARIES)")
    lacking = sorted(n for n in found if '"--smoke"' not in (BENCH / f"{n}.py").read_text())
    assert not lacking, f"no --smoke flag in {lacking}"
    spec = importlib.util.spec_from_file_location("bench_smoke_runner", BENCH / "smoke.py")
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert tuple(runner.LIBRARIES) == LIBRARIES and runner.scripts() == sorted(CHECKS)
