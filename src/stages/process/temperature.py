"""``temperature``: divide each row's logits by its temperature.

Owns :class:`Temperature`. Argmax-invariant. A greedy row (``temperature`` below
``GREEDY_BELOW``, 1e-5, zero included: dividing by less overflows float32) is left unchanged for the selector's argmax (the chain skips argmax-invariant processors for such
rows). Works on either layout, in place; dividing by 1.0 is exact, so rows at ``T == 1`` are
unchanged bit for bit.
"""

from __future__ import annotations

from pipeline.contracts.decode import Batch, Row, Scores
from stages.process.rows import row_floats


class Temperature:
    """``temperature``: ``s / T`` for sampled rows with ``T != 1``."""

    name: str = "temperature"
    argmax_invariant: bool = True

    def active(self, row: Row) -> bool:
        """Active for sampled rows whose temperature is not 1."""
        return not row.config.greedy and row.config.temperature != 1.0

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Divide the active rows by their temperature."""
        temps = [r.config.temperature if self.active(r) else 1.0 for r in batch.rows]
        if len(temps) == 1:
            scores.values.div_(temps[0])
        else:
            scores.values.div_(row_floats(temps, scores.values).unsqueeze(1))  # [B, 1]
        return scores
