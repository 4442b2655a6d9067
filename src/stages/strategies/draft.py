"""``draft``: a smaller model with the target's tokenizer proposes the drafts.

Owns :class:`DraftModelProposer` (a :class:`~stages.strategies.proposers.Proposer`) and its
per-sequence :class:`DraftState`. The proposer owns a second
:class:`~pipeline.contracts.model.Backend`, shared by every sequence: each sequence gets a slot of
its own when it starts and gives it back when its request ends. Each step, for all the
sequences that want drafts at once:

1. catch up: the draft cache keeps the longest prefix it shares with the committed tokens
   (rejected drafts are truncated away) and is fed the rest in one call, whose last logits
   give the first draft;
2. k - 1 more one-token calls, each feeding the previous draft, give the others.

Each call is one batched ``forward`` over every sequence still drafting. A draft is the
argmax of the draft model's processed logits for greedy rows, and otherwise a sample from
its processed distribution q with the ``DRAFT`` RNG stream (:mod:`stages.strategies.verify`),
q kept for the rejection rule. Processors see each draft position's own row, as in the
verification. A draft call that fails ends drafting for the sequences it concerns (their
requests go on without drafts; the next ``spec.drafted`` event says why).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from pipeline.errors import CapacityError, SlotError
from pipeline.contracts.decode import Batch, Row, Scores
from pipeline.contracts.model import Backend, ModelCall
from pipeline.contracts.text import Tokenizer
from stages.process.chain import ProcessorChain
from stages.select.greedy import argmax_columns
from stages.strategies.proposers import Proposal
from stages.strategies.speculative import advanced
from stages.strategies.verify import DRAFT, draw_from, stream_uniforms


@attrs.define
class DraftState:
    """A sequence's draft slot (None: drafting is off for it), the token ids its cache
    holds, how many of them are known to be committed tokens, and why drafting stopped."""

    slot: int | None
    ids: list[int] = attrs.field(factory=list)
    synced: int = 0
    error: str | None = None
    reported: bool = False


@attrs.define
class _Drafting:
    """One sequence's drafting this step."""

    state: DraftState
    row: Row
    limit: int
    feed: list[int]
    start: int
    drafts: list[int] = attrs.field(factory=list)
    q: list[torch.Tensor | None] = attrs.field(factory=list)


class DraftModelProposer:
    """Drafts from ``backend`` (a model with the target's tokenizer), processed by ``chain``.

    ``vocab`` is the width of the target's logits (draft logits are cut or padded to it) and
    ``decodable`` the tokenizer's vocabulary (ids at or above it are never proposed).

    Example::

        proposer = DraftModelProposer(draft_backend, chain, vocab=49152)
        state = proposer.start(row)                  # allocates a draft slot
        proposer.propose([state], [row], [4])        # [Proposal((d1, d2, d3, d4), q or None)]
        proposer.finish(state)                       # releases it
    """

    name: str = "draft"

    def __init__(self, backend: Backend, chain: ProcessorChain, vocab: int,
                 decodable: int | None = None) -> None:
        self.backend = backend
        self.chain = chain
        self.vocab = vocab
        self.decodable = decodable

    def start(self, row: Row) -> DraftState:
        """A draft slot for the sequence (none free: it goes on without drafts)."""
        try:
            return DraftState(self.backend.allocate())
        except CapacityError as exc:
            return DraftState(None, error=f"no free draft slot ({exc})")

    def finish(self, state: DraftState) -> None:
        """Give the draft slot back."""
        if state.slot is not None:
            slot, state.slot = state.slot, None
            self.backend.release(slot)

    def propose(self, states: Sequence[DraftState], rows: Sequence[Row],
                limits: Sequence[int]) -> list[Proposal]:
        """Up to ``limits[i]`` drafts per sequence, the draft model's calls batched."""
        work: dict[int, _Drafting] = {}
        for i, (state, row, limit) in enumerate(zip(states, rows, limits)):
            seq = [*row.prompt_ids, *row.output_ids]
            limit = min(limit, self.backend.max_context - len(seq) + 1)
            if limit > 0 and state.slot is not None and state.error is None:
                start = self._sync(state, seq)
                if state.error is None:
                    work[i] = _Drafting(state, row, limit, seq[start:], start)
        for r in range(max((w.limit for w in work.values()), default=0)):
            self._round([w for w in work.values() if w.limit > r and w.state.error is None], r)
        return [self._proposal(work.get(i), state) for i, state in enumerate(states)]

    def _proposal(self, work: _Drafting | None, state: DraftState) -> Proposal:
        if state.error is not None and not state.reported:
            state.reported = True
            return Proposal(note={"error": state.error})
        if work is None or state.error is not None or not work.drafts:
            return Proposal()
        q = None
        if any(row is not None for row in work.q):
            q = torch.stack([row if row is not None else self._point(d)
                             for row, d in zip(work.q, work.drafts)])            # [k, V]
        return Proposal(tuple(work.drafts), q)

    def _point(self, token: int) -> torch.Tensor:
        out = torch.zeros(self.vocab)
        out[token] = 1.0
        return out

    def _sync(self, state: DraftState, seq: list[int]) -> int:
        """Keep the draft cache's longest prefix shared with ``seq`` (at least one token of
        ``seq`` must be fed, for its logits); returns where feeding starts."""
        i, ids = state.synced, state.ids
        end = min(len(ids), len(seq))
        while i < end and ids[i] == seq[i]:
            i += 1
        keep = min(i, len(seq) - 1)
        if keep < len(ids):
            try:
                assert state.slot is not None
                self.backend.truncate(state.slot, keep)
            except Exception as exc:
                state.error = f"the draft cache could not be rolled back: {exc!r}"
                return keep
            del ids[keep:]
        state.synced = keep
        return keep

    def _round(self, work: list[_Drafting], r: int) -> None:
        """Draft number r + 1 of every sequence in ``work``: one batched draft call."""
        calls = {}
        for w in work:
            assert w.state.slot is not None
            if r == 0:
                calls[id(w)] = ModelCall(w.state.slot, tuple(w.feed), w.start,
                                         (len(w.feed) - 1,))
            else:
                calls[id(w)] = ModelCall(w.state.slot, (w.drafts[-1],), len(w.state.ids), (0,))
        ran = self._forward(work, calls)
        if not ran:
            return
        done = [w for w, _ in ran]
        for w in done:
            w.state.ids.extend(w.feed if r == 0 else w.drafts[-1:])
            if r == 0:
                w.state.synced = len(w.state.ids)
        rows = [advanced(w.row, w.drafts) for w in done]
        tokens, q = self._pick(torch.cat([z for _, z in ran]), rows)
        for w, token, dist in zip(done, tokens, q):
            w.drafts.append(token)
            w.q.append(dist)

    def _forward(self, work: list[_Drafting], calls: dict[int, ModelCall]
                 ) -> list[tuple[_Drafting, torch.Tensor]]:
        """Run the calls; a failure turns drafting off for the sequences it concerns (all
        of them, unless a :class:`SlotError` names some), and the rest are run again."""
        while work:
            try:
                logits = self.backend.forward([calls[id(w)] for w in work])    # [B, Vd]
            except SlotError as exc:
                named = [w for w in work if w.state.slot in set(exc.slots)] or work
                for w in named:
                    w.state.error = f"the draft model failed: {exc.cause!r}"
                work = [w for w in work if w not in named]
                continue
            except Exception as exc:
                for w in work:
                    w.state.error = f"the draft model failed: {exc!r}"
                return []
            return [(w, logits[i:i + 1]) for i, w in enumerate(work)]
        return []

    def _pick(self, logits: torch.Tensor, rows: list[Row]
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's draft from the draft logits ``[B, Vd]``: argmax (greedy rows) or a
        sample from the processed distribution, which is returned with it."""
        z = _width(logits.float(), self.vocab)                                 # [B, V]
        if self.decodable is not None and self.decodable < self.vocab:
            z[:, self.decodable:] = float("-inf")
        batch = Batch(tuple(rows), self.vocab)
        dense = self.chain(Scores(z), batch).to_dense(self.vocab)              # [B, V]
        tokens = argmax_columns(Scores(dense)).tolist()
        q: list[torch.Tensor | None] = [None] * len(rows)
        sampled = [i for i, row in enumerate(rows) if not row.config.greedy]
        if sampled:
            index = torch.tensor(sampled, device=dense.device)
            probs = torch.softmax(dense.index_select(0, index).double(), dim=1)  # [S, V]
            drawn = draw_from(probs, stream_uniforms([rows[i] for i in sampled], DRAFT,
                                                     dense.device)).tolist()
            for j, i in enumerate(sampled):
                tokens[i], q[i] = int(drawn[j]), probs[j].float()
        return tokens, q


def _width(z: torch.Tensor, vocab: int) -> torch.Tensor:
    """``z [B, Vd]`` cut or padded (with ``-inf``) to ``[B, vocab]``."""
    if z.shape[1] >= vocab:
        return z[:, :vocab].clone()
    pad = torch.full((z.shape[0], vocab - z.shape[1]), float("-inf"), dtype=z.dtype,
                     device=z.device)
    return torch.cat([z, pad], dim=1)


def vocabulary_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why ``draft`` does not tokenize as ``target`` does (None when it does): the same
    artifact digest, or the same vocabulary size with every id decoding to the same text."""
    if target.digest == draft.digest:
        return None
    if target.vocab_size != draft.vocab_size:
        return f"{draft.vocab_size} token ids, the target's tokenizer has {target.vocab_size}"
    for i in range(target.vocab_size):
        a = target.decode([i], skip_special_tokens=False)
        b = draft.decode([i], skip_special_tokens=False)
        if a != b:
            return f"token {i} is {b!r} for the draft model and {a!r} for the target"
    return None
