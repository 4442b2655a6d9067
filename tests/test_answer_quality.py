"""The answer-quality rubric (``benchmarks/answer_quality.py`` over
``tests/data/everyday_questions.json``) on hand-written answers: good ones pass, and each kind
of bad one fails for its own reason. The benchmark itself (the model over every question and
candidate) is not run here."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import answer_quality as aq  # noqa: E402

RUBRIC, QUESTIONS = aq.load_questions()
BY_ID = {q["id"]: q for q in QUESTIONS}


def test_the_data_is_thirty_everyday_questions_with_valid_patterns() -> None:
    assert len(QUESTIONS) == 30 and len(BY_ID) == 30
    assert {q["category"] for q in QUESTIONS} == {"facts", "arithmetic", "code", "translation",
                                                 "lists"}
    for q in QUESTIONS:
        assert q.get("must") or q.get("some"), q["id"]
        patterns = [*q.get("must", ()), *q.get("must_not", ()),
                    *q.get("some", {}).get("patterns", ())]
        for p in patterns:
            re.compile(p)
    assert set(RUBRIC["forbidden"]) == {"empty", "non_english_script", "foreign_words",
                                        "repetition"}


@pytest.mark.parametrize("qid, answer", [
    ("capital-france", "The capital of France is Paris."),
    ("spider-legs", "A spider has eight legs."),
    ("multiply", "7 times 8 is 56."),
    ("py-sum", "```python\ndef add(a, b):\n    return a + b\n```"),
    ("py-list", "numbers = [1, 2, 3]"),
    ("fr-thanks", "In French, \"thank you\" is \"merci\"."),
    ("de-morning", "Good morning in German is \"Guten Morgen\"."),
    ("fruits", "1. Apple\n2. Banana\n3. Mango"),
    ("seasons", "Spring, summer, autumn and winter."),
    ("primary-colors", "The primary colors are red, yellow and blue."),
    ("weekend", "The weekend is Saturday and Sunday."),
    ("es-cat", "El gato: the Spanish word for cat is \"gato\"."),  # Latin-1 letters are fine
])
def test_good_answers_pass(qid: str, answer: str) -> None:
    good, why = aq.judge(answer, BY_ID[qid])
    assert good, why


@pytest.mark.parametrize("qid, answer, reason", [
    ("capital-france", "The capital of France is Lyon.", "missing"),
    ("capital-france", "Paris. 法国的首都是巴黎。", "non_english_script"),
    ("capital-france", "Столица Франции — Париж (Paris).", "non_english_script"),
    ("capital-france", "Berlin is the capital of France, not Paris.", "forbidden"),
    ("capital-france", "La femme à l'étoile, le capital de France, est Paris.",
     "foreign_words"),
    ("multiply", "7 times 8 is 54.", "missing"),
    ("fruits", "Apples and bananas are fruits.", "2 of the 3"),
    ("seasons", "Spring, summer and winter.", "3 of the 4"),
    ("week-days", "", "empty"),
    ("week-days", "7 days. " + "The week has seven days and more. " * 3, "repetition"),
    ("sky-color", "blue\nthe sky is blue\nthe sky is blue\nthe sky is blue\nthe sky is "
                  "blue", "repetition"),
])
def test_bad_answers_fail_for_their_reason(qid: str, answer: str, reason: str) -> None:
    good, why = aq.judge(answer, BY_ID[qid])
    assert not good
    assert any(w.startswith(reason) or reason in w for w in why), why


def test_the_summary_counts_good_answers_per_seed() -> None:
    answers = [{"candidate": "greedy", "seed": 1000, "id": q["id"], "category": q["category"],
                "good": i < 12, "why": [] if i < 12 else ["repetition"], "tokens": 10,
                "text": ""} for i, q in enumerate(QUESTIONS)]
    summary = aq.summarize(answers, len(QUESTIONS))["greedy"]
    assert (summary["good_mean"], summary["good_min"], summary["of"]) == (12, 12, 30)
    assert summary["fault_rates"]["repetition"] == pytest.approx(18 / 30)
    assert "greedy" in aq.table({"greedy": summary})
