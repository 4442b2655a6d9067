"""Step pacing: how many prompt tokens a step may prefill beside decoding requests.

Owns :class:`Pacer`, the engine's model of its own step time (docs/design.md §6: "the step budget
bounds latency, not only tokens"). Every step of the engine produces one token for each
decoding request, so a decoding request's inter-token latency is the step time. A step that
also prefills a chunk of a new prompt takes longer; left unbounded (a 512-token chunk beside
four decoding requests) it multiplies their inter-token latency by ten or more.

The pacer measures, as the engine runs:

- ``decode_s``: the time of a step that only decodes (an exponential moving average);
- ``token_s``: the extra time per prefilled token of a step that also prefills (the step's
  time minus ``decode_s``, over its prefill tokens; a moving average that follows the cost
  rising as a long prompt's later chunks attend over more positions).

and allows a step with decoding requests ``(ratio - 1) * decode_s / token_s`` prompt tokens
(at least ``min_tokens``, so a prompt always progresses), so such a step takes about ``ratio``
times a decode-only step. With nothing decoding there is no one to wait and the engine's token
budget alone applies. Before the first measurements it allows ``min_tokens * 4``.

Example::

    pacer = Pacer(ratio=1.5)
    pacer.allowance(decoding=True)          # tokens this step may prefill
    pacer.observe(elapsed_s, decode_rows=4, prefill_tokens=64)
"""

from __future__ import annotations

import attrs

_ALPHA = 0.3  # weight of the newest measurement


@attrs.define
class Pacer:
    """A step-time model that sizes prefill beside decoding (see the module docstring)."""

    ratio: float
    min_tokens: int = 8
    decode_s: float | None = None
    token_s: float | None = None

    def allowance(self, decoding: bool) -> int | None:
        """Prompt tokens this step may prefill; None when unbounded (nothing decodes)."""
        if not decoding:
            return None
        if self.decode_s is None or self.token_s is None:
            return self.min_tokens * 4
        allowed = (self.ratio - 1.0) * self.decode_s / max(self.token_s, 1e-9)
        return max(self.min_tokens, int(allowed))

    def observe(self, elapsed_s: float, decode_rows: int, prefill_tokens: int) -> None:
        """Learn from one step: ``elapsed_s`` for ``decode_rows`` decoding sequences and
        ``prefill_tokens`` prompt tokens."""
        if elapsed_s <= 0:
            return
        if prefill_tokens == 0:
            if decode_rows:
                self.decode_s = _mix(self.decode_s, elapsed_s)
            return
        if not decode_rows:  # a prefill-only step: its whole time is prompt tokens
            self.token_s = _mix(self.token_s, elapsed_s / prefill_tokens)
        elif self.decode_s is not None:
            extra = max(elapsed_s - self.decode_s, 0.0)
            self.token_s = _mix(self.token_s, extra / prefill_tokens)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new
