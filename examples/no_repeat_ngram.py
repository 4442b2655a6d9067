"""A worked example plugin: ``no_repeat_ngram``, a logit processor that never lets a sequence
repeat an n-gram.

At each step it bans every token that would complete an n-gram already present in the
sequence so far (prompt and output, as transformers' ``NoRepeatNGramLogitsProcessor`` does
for a decoder-only model). It owns :class:`NoRepeatNGram` and the ``pipeline_components``
hook that registers it under the name ``no_repeat_ngram`` (with n = 3). A pipeline gets it in
one of three ways:

- as a plugin object: ``build("tiny", plugins=[no_repeat_ngram], processors=["no_repeat_ngram"])``
  (``processors=`` adds to the default chain);
- as an instance, with any n: ``build("tiny", processors=[NoRepeatNGram(2)])``;
- installed with an entry point in the ``pipeline`` group (``docs/plugins.md``): then every
  ``build()`` can name it and ``pipeline plugins`` lists it.

Run ``python examples/no_repeat_ngram.py`` to see the tiny model's greedy answer without and
with the processor; ``tests/test_example_plugin.py`` checks it against transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pipeline import Batch, Component, Row, Scores, hookimpl
from pipeline.errors import InvalidValueError

if TYPE_CHECKING:
    from pipeline import LogitProcessor


def banned_tokens(ids: Sequence[int], n: int) -> set[int]:
    """The tokens that would complete an n-gram ``ids`` already holds: the last token of every
    earlier n-gram whose first ``n - 1`` tokens equal the last ``n - 1`` of ``ids``."""
    if len(ids) < n:
        return set()
    prefix = tuple(ids[len(ids) - n + 1:]) if n > 1 else ()
    return {ids[i + n - 1] for i in range(len(ids) - n + 1)
            if tuple(ids[i:i + n - 1]) == prefix}


class NoRepeatNGram:
    """Bans tokens that would repeat an n-gram of the prompt and output (a mask: it can move
    the argmax, so it is not argmax-invariant).

    ``n`` is fixed when the processor is built; a request that does not want it leaves it out
    of its ``processor_order``. Works on dense ``[B, V]`` and sparse ``[B, K]`` scores, in
    place, touching only the rows it bans something in. Cost: O(prompt + output) per row per
    step, in Python; fine for a worked example, slow for prompts of many thousand tokens.

    Example::

        proc = NoRepeatNGram(2)
        batch = Batch((row,), vocab_size=V)          # row.prompt_ids + row.output_ids: 5 7 5
        proc(Scores(logits), batch)                  # token 7 is now -inf (5 7 would repeat)
    """

    name = "no_repeat_ngram"
    argmax_invariant = False

    def __init__(self, n: int = 3) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidValueError("n", n, "the n-gram size must be an integer >= 1")
        self.n = n

    def active(self, row: Row) -> bool:
        """Active once the row holds at least one whole n-gram."""
        return len(row.prompt_ids) + len(row.output_ids) >= self.n

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Set the score of every banned token to ``-inf``, row by row."""
        for i, row in enumerate(batch.rows):
            if not self.active(row):
                continue
            banned = banned_tokens([*row.prompt_ids, *row.output_ids], self.n)
            if not banned:
                continue
            ids = torch.tensor(sorted(banned), device=scores.values.device)
            if scores.indices is None:                      # dense: column j is token j
                scores.values[i, ids] = float("-inf")
            else:                                           # sparse: indices name the columns
                hit = torch.isin(scores.indices[i], ids)
                scores.values[i, hit] = float("-inf")
        return scores


@hookimpl
def pipeline_components() -> list[Component]:
    """The one component this plugin adds."""
    return [Component("processor", "no_repeat_ngram", lambda ctx: NoRepeatNGram(3),
                      "ban tokens that would repeat a 3-gram of prompt and output")]


if TYPE_CHECKING:
    def _satisfies(processor: NoRepeatNGram) -> LogitProcessor:
        """mypy --strict proves the class is a LogitProcessor (isinstance checks only names)."""
        return processor


def main() -> None:
    """The tiny model's greedy answer without and with the processor."""
    import sys

    from pipeline import build

    question = "What is a list comprehension?"
    with build("tiny") as plain, build("tiny", plugins=[sys.modules[__name__]],
                                       processors=["no_repeat_ngram"]) as guarded:
        for label, pipe in (("without", plain), ("with", guarded)):
            print(f"{label}: {pipe.generate(question, max_tokens=40, temperature=0).text!r}")


if __name__ == "__main__":
    main()
