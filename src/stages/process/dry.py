"""The DRY ("don't repeat yourself") sequence penalty: ``dry_multiplier``, ``dry_base``,
``dry_allowed_length``.

Owns :class:`DryPenalty`, the guard against loops that is on by default
(:data:`pipeline.sampling_defaults.PIPELINE_DEFAULT`). The rule, as llama.cpp and
text-generation-webui define it: when the output so far ends with a run of ``L`` tokens that
also occurred earlier in the output, the token that followed the earlier occurrence would
extend the repetition, so its logit loses

    dry_multiplier * dry_base ** (L - dry_allowed_length)      for L >= dry_allowed_length

(the largest such penalty when several earlier occurrences propose the same token). A
repeated word or two costs nothing; a repeated phrase costs more with each token it runs
on, so a loop ("la femme au martyre, la femme au martyre, ...") is left within a few tokens
while ordinary text, whose repeats are short, is untouched.

What differs from llama.cpp's sampler: the history is the request's *output* only (the last
:data:`WINDOW` tokens), not the prompt, so an answer may quote its question freely; there are
no sequence breakers (the tokenizer is not known here), and a match is at most
:data:`MAX_MATCH` tokens long, which keeps a step's cost bounded and the penalty finite
(``1.75 ** 46`` is about 1.5e11: the token is out of reach either way). Not argmax-invariant:
greedy rows are penalized too, so a greedy loop ends as well.

Example::

    config = GenerationConfig(dry_multiplier=0.8)      # base 1.75, allowed length 2
    # output ... A B C D ... A B C  →  D loses 0.8 * 1.75 ** (3 - 2) = 1.4
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.contracts.decode import Batch, Row, Scores
from stages.process.rows import contiguous

WINDOW = 1024
"""How many of the last output tokens the penalty looks back over."""
MAX_MATCH = 48
"""The longest repeated run measured, in tokens."""


def repeat_penalties(output: np.ndarray, multiplier: float, base: float, allowed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The tokens that would extend a repetition of ``output [n]`` (int64) and the penalty of
    each (distinct tokens ``[k]``, float64 ``[k]``; empty when nothing repeats long enough).

    ``match[i]`` is the length of the longest run ending at position ``i`` that equals the run
    ending the output; the token at ``i + 1`` continues that earlier occurrence."""
    n = output.size
    if n < max(allowed, 1) + 1:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    at = np.arange(n - 1)                                      # candidate ends i < n - 1
    alive = output[:n - 1] == output[n - 1]
    match = alive.astype(np.int64)
    for j in range(1, min(MAX_MATCH, n - 1)):
        if not alive.any():
            break
        earlier = at - j
        alive &= earlier >= 0
        alive &= output[np.maximum(earlier, 0)] == output[n - 1 - j]
        match += alive
    ends = np.nonzero(match >= allowed)[0]
    if ends.size == 0:
        return np.empty(0, np.int64), np.empty(0, np.float64)
    tokens = output[ends + 1]
    lengths = match[ends]
    order = np.lexsort((-lengths, tokens))                     # per token, longest first
    tokens, lengths = tokens[order], lengths[order]
    first = np.ones(tokens.size, dtype=bool)
    first[1:] = tokens[1:] != tokens[:-1]
    tokens, lengths = tokens[first], lengths[first]
    return tokens, multiplier * np.power(base, (lengths - allowed).astype(np.float64))


class DryPenalty:
    """``dry_multiplier`` > 0: subtract the DRY penalty from the tokens that would extend a
    repeated run of the output (see the module docstring for the rule)."""

    name: str = "dry"
    argmax_invariant: bool = False

    def active(self, row: Row) -> bool:
        """Active when ``dry_multiplier > 0`` and the output can hold a repeat."""
        return row.config.dry_multiplier > 0 and len(row.output_ids) > \
            row.config.dry_allowed_length

    def __call__(self, scores: Scores, batch: Batch) -> Scores:
        """Penalize, per active row, the tokens that would continue a repetition."""
        scores = contiguous(scores)
        values = scores.values
        for b, row in enumerate(batch.rows):
            if not self.active(row):
                continue
            ids = row.output_ids
            tail = ids[max(0, len(ids) - WINDOW):]
            config = row.config
            tokens, penalty = repeat_penalties(
                np.asarray(tail, dtype=np.int64), config.dry_multiplier, config.dry_base,
                config.dry_allowed_length)
            keep = (tokens >= 0) & (tokens < batch.vocab_size)
            if not keep.any():
                continue
            tok = torch.from_numpy(tokens[keep]).to(values.device)          # [k]
            amount = torch.from_numpy(penalty[keep]).to(values.device, values.dtype)  # [k]
            if scores.indices is None:
                values[b, tok] -= amount
            else:                                       # the row's K columns that are hit
                hit = scores.indices[b].unsqueeze(1) == tok.unsqueeze(0)    # [K, k]
                values[b] -= (hit.to(values.dtype) * amount.unsqueeze(0)).amax(1)
        return scores
