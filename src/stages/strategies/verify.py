"""Draft verification: which drafted tokens the target model's distribution accepts.

Owns the rejection rule of speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling") over a whole batch of verified positions at once, and the
RNG streams its uniform draws come from.

At a verified position with target distribution ``p`` (the processed logits' softmax) and a
draft token ``d`` drawn from ``q``: accept ``d`` with probability ``min(1, p(d) / q(d))``;
on rejection take a token from ``norm(max(0, p - q))``. A draft chosen deterministically
(n-gram lookup, a greedy draft model) is a point mass, ``q(d) = 1``: it is accepted with
probability ``p(d)`` and the residual is ``p`` without ``d``. Either way each committed token
is distributed exactly as ``p``. Positions the selector does not sample (greedy rows) accept a
draft only when it equals the selector's own choice, which makes the output token for token
that of plain decoding.

Randomness is counter-based (:mod:`stages.select.rng`): the acceptance test at step t uses
``uniform(seed, stream + ACCEPT, t)``, the residual draw ``uniform(seed, stream + RESIDUAL,
t)`` and a draft model's sampling ``uniform(seed, stream + DRAFT, t)``, so no draw depends on
the batch, the draft length or on another purpose's draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from pipeline.contracts.decode import Row, Selection
from stages.select.rng import BELOW_ONE, uniform

ACCEPT = 1 << 32
"""Offset of the acceptance tests' RNG stream from the row's own (selection) stream."""
RESIDUAL = 2 << 32
"""Offset of the residual draws' RNG stream."""
DRAFT = 3 << 32
"""Offset of a draft model's sampling stream."""


def stream_uniforms(rows: Sequence[Row], purpose: int, device: torch.device) -> torch.Tensor:
    """``[J]`` float64: each row's draw for ``purpose`` (``ACCEPT``, ``RESIDUAL``, ``DRAFT``)
    at its own step, scaled by :data:`~stages.select.rng.BELOW_ONE` as selection draws are."""
    return torch.tensor([uniform(r.seed, r.stream + purpose, r.step) * BELOW_ONE for r in rows],
                        dtype=torch.float64, device=device)


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[J]`` token drawn from unnormalized ``probs [J, V]`` by inverse CDF with ``u [J]``
    (the first token whose cumulative mass exceeds ``u * total``; a zero-mass token never)."""
    cdf = torch.cumsum(probs, dim=1, dtype=torch.float64)                      # [J, V]
    target = cdf[:, -1:] * u.unsqueeze(1)                                       # [J, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def residual(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q)`` per row (``[J, V]``, unnormalized); with ``q`` None the drafts
    ``[J]`` are point masses, so it is ``p`` with the draft removed. A row left with no mass
    (``q`` covers ``p``, where rejection has probability zero) falls back to ``p``."""
    if q is None:
        r = p.scatter(1, drafts.unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp_(min=0.0)
    empty = r.sum(dim=1) <= 0                                                   # [J]
    if bool(empty.any()):
        r[empty] = p[empty]
    return r


@attrs.frozen
class Position:
    """The verdict at one verified position: the token the rule puts there, the uniform it
    consumed (None for a deterministic choice), and whether that token is the draft."""

    token: int
    draw: float | None
    accepted: bool


@attrs.frozen
class Block:
    """One sequence's verified positions: the drafts fed after its pending token, and the
    probabilities ``q [k, V]`` they were drawn with (None: point masses)."""

    drafts: tuple[int, ...]
    q: torch.Tensor | None = attrs.field(default=None, eq=False)


def verify(processed: torch.Tensor, choice: Selection, rows: Sequence[Row],
           blocks: Sequence[Block]) -> list[list[Position]]:
    """The verdict at every position of every block.

    ``processed [N, V]`` are the target's processed logits (dense; their softmax is ``p``),
    ``choice`` the selector's picks and ``rows`` the rows (``step`` advanced per position) at
    the N positions, block by block: block b has ``len(drafts) + 1`` positions, the last one
    past every draft. A position the selector sampled is judged by the rejection rule, any
    other by equality with the selector's pick; the last position takes the selector's pick.
    """
    sampled: list[int] = []
    flat_drafts: list[int] = []
    q_draft: list[float] = []
    q_rows: list[torch.Tensor | None] = []
    at = 0
    for block in blocks:
        for j, d in enumerate(block.drafts):
            if choice.draws and choice.draws[at + j] is not None:
                sampled.append(at + j)
                flat_drafts.append(d)
                q_draft.append(1.0 if block.q is None else float(block.q[j, d]))
                q_rows.append(None if block.q is None else block.q[j])
        at += len(block.drafts) + 1
    judged = (_rejection(processed, rows, sampled, flat_drafts, q_draft, q_rows)
              if sampled else {})
    out, at = [], 0
    for block in blocks:
        positions = []
        for j in range(len(block.drafts) + 1):
            n = at + j
            if n in judged:
                positions.append(judged[n])
                continue
            token = choice.token_ids[n]
            draw = choice.draws[n] if choice.draws else None
            positions.append(Position(token, draw, j < len(block.drafts)
                                      and token == block.drafts[j]))
        out.append(positions)
        at += len(block.drafts) + 1
    return out


def _rejection(processed: torch.Tensor, rows: Sequence[Row], sampled: list[int],
               drafts: list[int], q_draft: list[float], q_rows: list[torch.Tensor | None]
               ) -> dict[int, Position]:
    """The rejection rule at the ``sampled`` positions (indices into ``processed``)."""
    device = processed.device
    index = torch.tensor(sampled, device=device)
    p = torch.softmax(processed.index_select(0, index).double(), dim=1)         # [J, V]
    d = torch.tensor(drafts, device=device)                                    # [J]
    p_d = p.gather(1, d.unsqueeze(1)).squeeze(1)                               # [J]
    picked = [rows[i] for i in sampled]
    u = stream_uniforms(picked, ACCEPT, device)                                # [J]
    accept = (u * torch.tensor(q_draft, dtype=torch.float64, device=device)) < p_d
    verdict: dict[int, Position] = {}
    rejected = [i for i, ok in enumerate(accept.tolist()) if not ok]
    for i, (ok, draw) in enumerate(zip(accept.tolist(), u.tolist())):
        if ok:
            verdict[sampled[i]] = Position(drafts[i], draw, True)
    if rejected:
        which = torch.tensor(rejected, device=device)
        q = None
        if any(q_rows[i] is not None for i in rejected):
            q = torch.stack([_dense_q(q_rows[i], drafts[i], p.shape[1]) for i in rejected])
        r = residual(p.index_select(0, which), None if q is None else q.to(p.device).double(),
                     d.index_select(0, which))
        ur = stream_uniforms([picked[i] for i in rejected], RESIDUAL, device)
        tokens = draw_from(r, ur).tolist()
        for i, token, draw in zip(rejected, tokens, ur.tolist()):
            verdict[sampled[i]] = Position(int(token), draw, False)
    return verdict


def _dense_q(q: torch.Tensor | None, draft: int, vocab: int) -> torch.Tensor:
    """A draft's ``q`` row ``[V]`` (a point mass at ``draft`` when None)."""
    out = torch.zeros(vocab, dtype=torch.float64)
    if q is None:
        out[draft] = 1.0
    else:  # a draft vocabulary of another width: its extra ids carry no target mass
        n = min(vocab, q.shape[0])
        out[:n] = q[:n].double()
    return out
