"""The worked example plugin (``examples/no_repeat_ngram.py``, docs/plugins.md) really works.

Oracle: transformers' ``NoRepeatNGramLogitsProcessor`` on the same ids and logits. Then the
plugin in a pipeline by name (a real model, greedy: no n-gram of prompt + output repeats),
installed through an entry point (``pipeline plugins`` lists it, ``build()`` finds it). mypy
--strict proves it a ``LogitProcessor`` in ``tests/test_protocols.py``, in the one mypy run
that also checks the other implementations.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pipeline import Batch, GenerationConfig, LogitProcessor, Row, Scores, build
from pipeline.errors import InvalidValueError
from stages.process import DEFAULT_ORDER

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CHAIN = [*DEFAULT_ORDER[:4], "no_repeat_ngram", *DEFAULT_ORDER[4:]]  # a whole chain


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import no_repeat_ngram

        yield no_repeat_ngram
    finally:
        sys.path.remove(str(EXAMPLES))


def _row(ids: list[int], split: int, index: int = 0) -> Row:
    return Row(f"r{index}", GenerationConfig(), ids[:split], ids[split:], len(ids) - split + 1,
               seed=0, eos_token_ids=frozenset())


def _repeats(ids: list[int], n: int) -> bool:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matches_transformers(example: ModuleType, n: int) -> None:
    from transformers import NoRepeatNGramLogitsProcessor

    rng = random.Random(n)
    vocab = 12
    oracle = NoRepeatNGramLogitsProcessor(n)
    for _ in range(40):
        rows = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
        batch = Batch(tuple(_row(ids, rng.randrange(len(ids) + 1), i)
                            for i, ids in enumerate(rows)), vocab)
        logits = torch.randn(3, vocab)
        ours = example.NoRepeatNGram(n)(Scores(logits.clone()), batch).to_dense(vocab)
        for i, ids in enumerate(rows):
            want = oracle(torch.tensor([ids]), logits[i:i + 1].clone())[0]
            assert torch.equal(ours[i], want), (n, ids)


def test_sparse_scores_get_the_same_bans(example: ModuleType) -> None:
    vocab = 10
    batch = Batch((_row([1, 2, 3, 1, 2], 3), _row([4, 5, 4], 1, 1)), vocab)
    logits = torch.randn(2, vocab)
    dense = example.NoRepeatNGram(2)(Scores(logits.clone()), batch).to_dense(vocab)
    indices = torch.tensor([[9, 3, 0, 1], [4, 5, 8, 2]])
    sparse = example.NoRepeatNGram(2)(
        Scores(torch.gather(logits, 1, indices), indices), batch).to_dense(vocab)
    kept = torch.full_like(logits, float("-inf")).scatter_(1, indices, 0.0)  # -inf off the set
    assert torch.equal(sparse, dense + kept)
    assert dense[0, 3] == float("-inf") and dense[1, 5] == float("-inf")  # "2 3", "4 5"


def test_bad_n_is_refused_when_built(example: ModuleType) -> None:
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(InvalidValueError, match="n-gram size"):
            example.NoRepeatNGram(bad)
    assert isinstance(example.NoRepeatNGram(3), LogitProcessor)


def test_in_a_pipeline_by_name_no_ngram_repeats(example: ModuleType) -> None:
    question = "What is a list comprehension?"
    with build("tiny", plugins=[example], processors=["no_repeat_ngram"]) as pipe:
        done = pipe.generate(question, max_tokens=40, temperature=0)
        prompt = pipe.tokenize(question).input_ids
    assert not _repeats([*prompt, *done.token_ids], 3)
    with build("tiny", plugins=[example], processors=CHAIN, replace_processors=True) as whole:
        assert whole.generate(question, max_tokens=40, temperature=0).text == done.text
    configured = next(e for e in done.trace if e.event_type == "selection.configured")
    assert "no_repeat_ngram" in configured.payload["processors"]
    # Without the processor: the processor changes a greedy answer exactly when that answer
    # repeats a 3-gram (which answers loop depends on the CPU's arithmetic; the rule does not)
    loops = 0
    with build("tiny", plugins=[example], processors=["no_repeat_ngram"]) as pipe, \
            build("tiny") as plain:
        for text in (question, "What does the with statement do?", "Explain exceptions."):
            ids = pipe.tokenize(text).input_ids
            free = plain.generate(text, max_tokens=40, temperature=0)
            kept = pipe.generate(text, max_tokens=40, temperature=0)
            repeats = _repeats([*ids, *free.token_ids], 3)
            assert repeats == (free.token_ids != kept.token_ids), text
            assert not _repeats([*ids, *kept.token_ids], 3)
            loops += repeats
    assert loops  # the tiny model does loop on at least one of them


def test_installed_through_an_entry_point(tmp_path: Path) -> None:
    """What ``pip install`` of a package with the entry point leaves: a dist-info folder."""
    info = tmp_path / "no_repeat_ngram_example-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: no-repeat-ngram-example\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text("[pipeline]\nno_repeat_ngram = no_repeat_ngram\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), str(EXAMPLES), str(ROOT / "src")])}
    listed = subprocess.run([sys.executable, "-m", "pipeline", "plugins"], env=env,
                            capture_output=True, text=True, check=True).stdout
    assert any("no_repeat_ngram" in line and "[no_repeat_ngram]" in line
               for line in listed.splitlines())
    script = textwrap.dedent(f"""
        from pipeline import build
        with build("tiny", processors=["no_repeat_ngram"]) as pipe:
            print(pipe.generate("hi", max_tokens=3, temperature=0).usage.completion_tokens)
    """)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() in {"1", "2", "3"}
