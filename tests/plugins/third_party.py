"""A stand-in third-party plugin: one processor that removes every odd token id."""

from __future__ import annotations

from pipeline import Batch, Component, Row, Scores, hookimpl


class NoOddTokens:
    """Removes odd token ids (the argmax can move, so not argmax-invariant)."""

    name = "no_odd_tokens"
    argmax_invariant = False

    def active(self, row: Row) -> bool:
        return True

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        values = scores.to_dense(batch.vocab_size).clone()
        values[:, 1::2] = float("-inf")
        return Scores(values)


@hookimpl
def pipeline_components() -> list[Component]:
    return [Component("processor", "no_odd_tokens", lambda ctx: NoOddTokens(),
                      "removes odd token ids")]
