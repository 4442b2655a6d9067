"""From a step's logits to committed tokens: the half of an engine step after the forward.

Owns :class:`Committer` (docs/design.md §4, §6): one batched
:meth:`~pipeline.contracts.strategy.Strategy.update` per strategy (per processor order) over the
sequences that got logits, the check that each update commits token ids of the vocabulary, the
records of the processed distributions the tokens were chosen from (digests, top-k at ``full``),
and each update's commit through its :class:`~pipeline.engine.job.Job`: tokens in order,
stopping at the first that ends the request, then the rollback of positions the strategy dropped
(the backend's ``truncate`` and, over a paged backend, the block tables). Also
:func:`logits_records`, the records of the raw logits of every wanted output. Failures stay
contained: a strategy that raises or answers nonsense fails its group (the step's jobs of one
strategy; a job with a grammar is a group of its own, so a grammar the engine fails on fails
only its request), a job whose commit raises fails alone. The committer calls nothing back in
the engine: :meth:`Committer.update` returns what ended (:class:`Ended`: a request a stop
finished, or one that failed and why), and the engine releases or fails those. Also
:func:`cache_state`, a slot's cache length as the trace records it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from pipeline.engine.job import Job
from pipeline.engine.paging import KVMemory
from pipeline.contracts.decode import Row
from pipeline.contracts.model import Backend, CacheInspector, CacheLayout
from pipeline.contracts.strategy import Strategy, Update
from pipeline.recording import logits_record, processed_record, record_rows, same_bits


def logits_records(done: list[tuple[Job, torch.Tensor]]) -> list[list[dict[str, Any]]]:
    """Digest (and, for ``full`` jobs, top-k) of each wanted row of each job's fresh raw
    logits (z_t; z_t .. z_{t+k} after k drafts)."""
    if not done:
        return []
    rows = record_rows(torch.cat([logits for _, logits in done]))  # [sum outputs, V]
    flat = logits_record(rows, [job.recorder.full for job, logits in done for _ in logits])
    out, at = [], 0
    for _, logits in done:
        out.append(flat[at:at + len(logits)])
        at += len(logits)
    return out



def cache_state(backend: Backend, inspector: CacheInspector | None, slot: int
                ) -> tuple[int, CacheLayout | None]:
    """The slot's cache length, and its per-layer lengths when the backend reports them."""
    layout = inspector.cache_layout(slot) if inspector is not None else None
    return backend.cache_length(slot), layout


@attrs.frozen
class Ended:
    """A request that ended during a commit: a stop finished it (``error`` None: release it)
    or it failed (``error`` says why: fail it)."""

    job: Job
    error: str | None = None


class Committer:
    """The engine's commit half; called on the engine thread only. ``inspector`` is the
    backend when it reports per-layer cache lengths (None otherwise)."""

    def __init__(self, backend: Backend, memory: KVMemory,
                 inspector: CacheInspector | None) -> None:
        self._backend = backend
        self._memory = memory
        self._inspector = inspector
        self._ended: list[Ended] = []

    def update(self, ready: list[tuple[Job, torch.Tensor]]) -> list[Ended]:
        """Hand each strategy its sequences' logits; commit what it took, roll back what it
        dropped. One batched ``update`` per strategy (per processor order). Returns the
        requests that ended, in the order they did, for the engine to release or fail."""
        self._ended = []
        groups: dict[tuple[int, int], list[tuple[Job, torch.Tensor]]] = {}
        for job, rows in ready:
            groups.setdefault(_group(job), []).append((job, rows))
        for items in groups.values():
            strategy = items[0][0].strategy
            assert strategy is not None
            states = {job: job.row() for job, _ in items}  # one Row per job per step
            orders: dict[Job, tuple[str, ...] | None] = {}
            kept = []
            for job, rows in items:
                try:
                    orders[job] = _configure(job, states[job], strategy)
                except Exception as exc:  # this request's state is broken, not the others'
                    self._fail(job, f"configuring selection failed: {exc!r}")
                    continue
                kept.append((job, rows))
            items = kept
            if not items:
                continue
            try:
                updates = list(strategy.update([j.decode_state for j, _ in items],
                                               [states[j] for j, _ in items],
                                               [rows for _, rows in items]))
            except Exception as exc:
                for job, _ in items:
                    self._fail(job, f"selection failed: {exc!r}")
                continue
            bad = _bad_updates(updates, len(items), self._backend.vocab_size)
            if bad is not None:
                for job, _ in items:
                    self._fail(job, f"selection failed: {bad}")
                continue
            processed = self._processed_records(updates, items)
            for (job, _), update, records in zip(items, updates, processed):
                self._commit(job, update, records, orders[job])
        return self._ended

    def _fail(self, job: Job, error: str) -> None:
        self._ended.append(Ended(job, error))

    def _commit(self, job: Job, update: Update[Any], records: list[dict[str, Any] | None],
                order: tuple[str, ...] | None) -> None:
        """Take the update's tokens in order (stopping at the first that ends the request),
        then roll the cache back if the strategy dropped fed positions."""
        try:
            job.decode_state = update.state
            job.recorder.noted(update.events)
            for k, taken in enumerate(update.taken):
                reason = job.take(taken, self._backend.max_context, records[k],
                                  order if k == 0 else None)
                if reason is not None:
                    self._ended.append(Ended(job))
                    return
            if update.rollback:
                self._backend.truncate(job.slot_id, job.cache_len - update.rollback)
                job.rolled_back(update.rollback, cache_state(self._backend, self._inspector,
                                                             job.slot_id))
                self._memory.truncate(job)
        except Exception as exc:  # this request's state is broken, not the others'
            self._fail(job, f"taking token failed: {exc!r}")

    def _processed_records(self, updates: list[Update[Any]],
                           items: list[tuple[Job, torch.Tensor]]
                           ) -> list[list[dict[str, Any] | None]]:
        """Per update, per taken token: digest (and top-k for ``full`` jobs) of the processed
        distribution it was chosen from."""
        out: list[list[dict[str, Any] | None]] = [[None] * len(u.taken) for u in updates]
        having = [(i, u) for i, u in enumerate(updates) if u.processed is not None and u.taken]
        if not having:
            return out
        rows = record_rows(torch.cat([u.processed for _, u in having
                                    if u.processed is not None]))             # [sum taken, V]
        full, known, where = [], [], []
        at = 0
        for i, update in having:
            job, raw = items[i]
            for k in range(len(update.taken)):
                full.append(job.recorder.full)
                # A row no processor changed is its raw logits: reuse that digest (an
                # equality test costs a fraction of a sha256 pass).
                digest = job.recorder.raw_digests[k] if k < len(job.recorder.raw_digests) else None
                known.append(digest if digest and same_bits(rows[at], raw[k]) else None)
                where.append((i, k))
                at += 1
        for (i, k), record in zip(where, processed_record(rows, full, known)):
            out[i][k] = record
        return out


def _group(job: Job) -> tuple[int, int]:
    """The update ``job`` shares: one per strategy, but a job with a grammar updates alone.
    A grammar is the client's input, and the grammar engine may still fail on one that
    passed its checks (a parser limit): that must fail the one request, not every request
    batched beside it. Draws are per row (:mod:`stages.select.rng`), so the tokens are those
    a batched update would choose."""
    return id(job.strategy), id(job) if job.config.grammar is not None else 0


def _configure(job: Job, state: Row, strategy: Strategy) -> tuple[str, ...] | None:
    """The processor order to record for this step (and the step-1 configuration event).
    It is recorded at step 1, and at every step for ``full`` recordings (it costs ~20 µs
    per row; an order can change, e.g. with min_tokens)."""
    order = strategy.order(state) if state.step == 1 or job.recorder.full else None
    if state.step == 1:
        job.recorder.configured(strategy.name, order or (), job.spec.seed)
    return order


def _bad_updates(updates: list[Update[Any]], rows: int, vocab: int) -> str | None:
    """Why ``updates`` is not one update per sequence committing token ids of the
    vocabulary (None when it is)."""
    if len(updates) != rows:
        return f"the strategy returned {len(updates)} updates for {rows} sequences"
    for update in updates:
        for taken in update.taken:
            token = taken.token_id
            if type(token) is not int or not 0 <= token < vocab:
                return f"the selector returned {token!r}, not a token id below {vocab}"
        if update.rollback < 0:
            return f"the strategy asked to roll back {update.rollback} positions"
    return None
