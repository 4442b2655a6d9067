"""The paged KV cache and the ragged batch that says where each sequence's keys live.

Owns the memory layout of keys and values (:class:`KVCache`: per layer a pool of blocks, and
each slot's logical length) and the per-call plan of where to write and read them
(:class:`RaggedBatch`, built from each sequence's block table). Which blocks a sequence uses
is decided elsewhere: by the backend's own :class:`~pipeline.engine.blocks.BlockManager` for
slot-only callers, or by the caller (:class:`~pipeline.contracts.model.PagedBackend`).

A sequence's keys are read for attention in one of three ways, chosen when the batch is
built: a prompt from position 0 attends to its own new keys (nothing is read back); a
sequence whose blocks are consecutive in the pool is read as one view (no copy); any other is
gathered: per layer, one ``index_select`` fetches the blocks of every such sequence of the
batch, and each reads its slice. Views and gathered slices have the same layout, so the
logits do not depend on where the blocks lie.

Keys and values are kept in the compute dtype, or in int8 (``quantized``): each written
position's key (and value) of each head is stored as int8 with one float32 scale, its largest
magnitude over 127 (symmetric, per token and head), and dequantized to the compute dtype when
attention reads it. That is D + 4 bytes a head and position instead of 4·D (float32) or 2·D
(bfloat16); what it costs in logits and greedy agreement is measured by
``benchmarks/kv_int8.py``.

Shapes: T tokens in the call, NB blocks of S positions, Hkv heads, D head_dim.

Example::

    cache = KVCache.empty(spec, num_blocks=64, block_size=16, num_slots=4, dtype=torch.float32)
    batch = RaggedBatch.build([(0, 0, prompt_ids)], tables=[(5, 6, 7)], block_size=16)
    cache.update(layer, batch, k, v)           # k, v [T, Hkv, D]
    keys, values = cache.read(layer, batch, 0, k, v)   # [1, Hkv, len(prompt_ids), D]
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from backends.torch.config import ModelSpec


class KVCache:
    """A pool of key/value blocks per layer, and each slot's logical length.

    ``k[l]``/``v[l]`` have shape ``[NB, S, Hkv, D]``: block, then position in the block, then
    head. Position ``p`` of a sequence with block table ``t`` is row ``t[p // S] * S + p % S``
    of the flattened pool ``[NB*S, Hkv, D]``, so a run of consecutive blocks is one contiguous
    range of rows that attention reads as a view. (A head-major block ``[Hkv, S, D]`` would
    keep each head's keys together, but then no sequence of more than one block could be read
    without a gather and a transpose copy.)

    ``lengths[s]`` is how many positions of slot ``s`` are valid; every layer's keys and
    values cover exactly those positions (docs/design.md §8, invariant 2). ``key_extent[l][s]`` and
    ``value_extent[l][s]`` are how far layer ``l`` has written keys and values of slot ``s``,
    committed with the lengths, so the invariant can be checked rather than assumed. Which
    blocks a slot uses is not the cache's business: each batch names them. Owned by one
    backend and mutated only by :meth:`update` (positions beyond the lengths), :meth:`commit`,
    :meth:`discard`, :meth:`truncate` and :meth:`reset`.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], num_slots: int,
                 scales: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.k = k
        self.v = v
        self._flat_k = [t.view(-1, *t.shape[2:]) for t in k]                   # [NB*S, Hkv, D]
        self._flat_v = [t.view(-1, *t.shape[2:]) for t in v]
        self.scales = scales
        """Per layer, the keys' and values' int8 scales ``[NB, S, Hkv]`` (None: the pools
        hold the compute dtype itself)."""
        self._flat_s = (None if scales is None else
                        ([t.view(-1, t.shape[2]) for t in scales[0]],
                         [t.view(-1, t.shape[2]) for t in scales[1]]))          # [NB*S, Hkv]
        self.dtype = dtype or k[0].dtype
        """The dtype attention reads keys and values in."""
        self.lengths = [0] * num_slots
        self.key_extent = [[0] * num_slots for _ in k]
        self.value_extent = [[0] * num_slots for _ in v]
        self._written: list[int] = []                 # layers written since the last commit
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None   # this layer's

    @classmethod
    def empty(cls, spec: ModelSpec, *, num_blocks: int, block_size: int, num_slots: int,
              dtype: torch.dtype, device: torch.device | str = "cpu",
              quantized: bool = False) -> KVCache:
        """A pool of ``num_blocks`` blocks of ``block_size`` positions per layer, for
        ``num_slots`` sequences.

        Keys (and values) of all layers are one uninitialised allocation, viewed per layer:
        on a CPU a block of that size is a fresh mapping whose pages the system provides when
        first written, so the process holds the positions written so far, not the whole pool
        (``docs/performance.md``: a 2,048-position window of the default model costs what the
        prompt and answer wrote). Nothing reads a position before it is written: attention
        reads a slot's first ``lengths`` positions only, and a gather copies whole blocks
        but reads back only those."""
        shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        stored = torch.int8 if quantized else dtype
        keys = torch.empty(shape, dtype=stored, device=device)
        values = torch.empty(shape, dtype=stored, device=device)
        scales = None
        if quantized:
            k_s = torch.empty(shape[:-1], dtype=torch.float32, device=device)
            v_s = torch.empty(shape[:-1], dtype=torch.float32, device=device)
            scales = (list(k_s.unbind(0)), list(v_s.unbind(0)))
        return cls(list(keys.unbind(0)), list(values.unbind(0)), num_slots, scales, dtype)

    @property
    def num_blocks(self) -> int:
        """Blocks in each layer's pool."""
        return int(self.k[0].shape[0])

    @property
    def block_size(self) -> int:
        """Positions per block."""
        return int(self.k[0].shape[1])

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Memory the keys and values of every layer's pool take."""
        pools = (*self.k, *self.v, *(() if self.scales is None else
                                     (*self.scales[0], *self.scales[1])))
        return sum(t.numel() * t.element_size() for t in pools)

    def update(self, layer: int, batch: RaggedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter the new ``k``/``v [T, Hkv, D]`` of the batch's writing sequences into their
        blocks (``batch.write_rows``), then gather the blocks of the sequences that
        :meth:`read` cannot view (one ``index_select`` each for keys and values). Call once
        per layer, before that layer's reads."""
        if batch.write_tokens is not None:
            k, v = k[batch.write_tokens], v[batch.write_tokens]
        if k.shape[0]:
            if self._flat_s is not None:
                (k, k_s), (v, v_s) = quantize(k), quantize(v)
                self._flat_s[0][layer].index_copy_(0, batch.write_rows, k_s)
                self._flat_s[1][layer].index_copy_(0, batch.write_rows, v_s)
            self._flat_k[layer].index_copy_(0, batch.write_rows, k)
            self._flat_v[layer].index_copy_(0, batch.write_rows, v)
        self._written.append(layer)
        self._gathered = None
        if batch.gather_blocks is not None:
            blocks = batch.gather_blocks
            keys = _rows_of(self.k[layer].index_select(0, blocks))
            values = _rows_of(self.v[layer].index_select(0, blocks))
            if self.scales is not None:
                keys = dequantize(keys, self.scales[0][layer].index_select(0, blocks)
                                  .reshape(-1, keys.shape[1]), self.dtype)
                values = dequantize(values, self.scales[1][layer].index_select(0, blocks)
                                    .reshape(-1, values.shape[1]), self.dtype)
            self._gathered = (keys, values)

    def read(self, layer: int, batch: RaggedBatch, b: int, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s keys and values ``[1, Hkv, start+n, D]`` for attention, given its
        new ``k``/``v [n, Hkv, D]`` (already written when it writes)."""
        plan = batch.reads[b]
        if plan.length:
            end = plan.base + plan.length
            if plan.gathered:
                keys, values = self._staged()
                cached_k, cached_v = keys[plan.base:end], values[plan.base:end]
            elif self._flat_s is not None:  # int8 rows, dequantized as attention reads them
                cached_k = dequantize(self._flat_k[layer][plan.base:end],
                                      self._flat_s[0][layer][plan.base:end], self.dtype)
                cached_v = dequantize(self._flat_v[layer][plan.base:end],
                                      self._flat_s[1][layer][plan.base:end], self.dtype)
            else:
                cached_k = self._flat_k[layer][plan.base:end]
                cached_v = self._flat_v[layer][plan.base:end]
            k = _join(cached_k, k, plan.append)                              # [L, Hkv, D]
            v = _join(cached_v, v, plan.append)
        return k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def _staged(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gathered is None:
            raise RuntimeError("KVCache.read of a gathered sequence before update")
        return self._gathered

    def commit(self, batch: RaggedBatch) -> None:
        """Extend each writing sequence's slot length by the tokens the batch wrote."""
        self._gathered = None
        for slot, start, n, write in zip(batch.slots, batch.starts, batch.lengths, batch.writes):
            if write:
                self.lengths[slot] = start + n
                for layer in self._written:
                    self.key_extent[layer][slot] = self.value_extent[layer][slot] = start + n
        self._written.clear()

    def discard(self) -> None:
        """Forget the writes of a call that failed (their positions stay beyond the lengths)."""
        self._written.clear()
        self._gathered = None

    def truncate(self, slot: int, length: int) -> None:
        """Keep ``slot``'s first ``length`` positions (at most its current length)."""
        length = min(length, self.lengths[slot])
        self.lengths[slot] = length
        for layer in range(len(self.k)):
            self.key_extent[layer][slot] = min(self.key_extent[layer][slot], length)
            self.value_extent[layer][slot] = min(self.value_extent[layer][slot], length)

    def reset(self, slot: int) -> None:
        """Empty ``slot`` (stale values stay but are never read)."""
        self.lengths[slot] = 0
        for layer in range(len(self.k)):
            self.key_extent[layer][slot] = self.value_extent[layer][slot] = 0


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [W, Hkv, D]`` as int8 and a float32 scale per row and head ``[W, Hkv]``: the
    largest magnitude over 127, symmetric (an all-zero row gets scale 1)."""
    scale = x.detach().abs().amax(-1).float() / 127.0                      # [W, Hkv]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [L, Hkv, D]`` int8 with ``scale [L, Hkv]`` back in ``dtype``."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def _join(cached: torch.Tensor, new: torch.Tensor, append: bool) -> torch.Tensor:
    return torch.cat([cached, new]) if append else cached


def _rows_of(blocks: torch.Tensor) -> torch.Tensor:
    """``[nb, S, Hkv, D]`` blocks as ``[nb*S, Hkv, D]`` rows (a view)."""
    return blocks.view(-1, *blocks.shape[2:])


@attrs.frozen(eq=False)
class ReadPlan:
    """Where one sequence's attention finds its keys: the first ``length`` positions of its
    blocks (0: only its new tokens, a prompt from position 0), which are the rows ``base ..
    base+length-1`` of the flattened pool, or with ``gathered`` of the layer's gathered
    blocks (:attr:`RaggedBatch.gather_blocks`); ``append``: its new tokens follow (they were
    not written)."""

    length: int
    base: int = 0
    gathered: bool = False
    append: bool = False


@attrs.frozen(eq=False)
class RaggedBatch:
    """B sequences' new tokens, concatenated, and where their keys and values live.

    ``token_ids``/``positions`` are ``[T]``; ``outputs`` (the rows of ``[T]`` whose logits are
    wanted, sequence by sequence) is ``[N]``; ``slots``, ``starts``, ``lengths`` and
    ``offsets`` (each sequence's first token in ``[T]``) are per-sequence Python ints, which
    the attention loop slices with; ``bidirectional[b]`` makes sequence b's new tokens attend
    to each other both ways; ``writes[b]`` false leaves its slot's length unchanged at
    :meth:`KVCache.commit` and its keys unwritten; ``prompts[b]`` marks a prompt chunk (a
    batch-invariant model attends it with :func:`~backends.torch.invariant.grid_attention`).
    ``write_rows [W]`` are the flattened-pool
    rows of the written tokens, which are rows ``write_tokens [W]`` of ``[T]`` (None: all of
    them, in order); ``reads[b]`` is sequence b's :class:`ReadPlan`; ``gather_blocks [G]``
    the blocks, in order, of the sequences read by gathering (None: none is). Build with
    :meth:`build`.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    outputs: torch.Tensor
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    bidirectional: tuple[bool, ...]
    writes: tuple[bool, ...]
    prompts: tuple[bool, ...]
    write_rows: torch.Tensor
    write_tokens: torch.Tensor | None
    reads: tuple[ReadPlan, ...]
    gather_blocks: torch.Tensor | None

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, Sequence[int]]], *,
              tables: Sequence[Sequence[int]], block_size: int,
              device: torch.device | str = "cpu",
              outputs: Sequence[Sequence[int]] | None = None,
              bidirectional: Sequence[bool] | None = None,
              writes: Sequence[bool] | None = None,
              prompts: Sequence[bool] | None = None) -> RaggedBatch:
        """From ``(slot, start, token_ids)`` per sequence (each with at least one token) and
        its block table (covering ``start + len`` positions, ``start`` if it does not write).

        ``outputs[b]`` are the offsets into sequence b's tokens whose logits are wanted
        (default: its last token); ``bidirectional``/``writes`` default to causal and writing;
        ``prompts[b]`` marks a prompt chunk (default: none is).
        """
        lengths = [len(ids) for _, _, ids in seqs]
        if not seqs or min(lengths) < 1:
            raise ValueError("every sequence of a batch needs at least one token")
        b = len(seqs)
        writes = tuple(writes) if writes is not None else (True,) * b
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        positions = [p for (_, start, _), n in zip(seqs, lengths) for p in range(start, start + n)]
        ids = [t for _, _, seq in seqs for t in seq]
        wanted = ([[n - 1] for n in lengths] if outputs is None else outputs)
        rows = [o + i for o, want in zip(offsets, wanted) for i in want]
        rows_w: list[int] = []
        for (_, start, _), n, table, write in zip(seqs, lengths, tables, writes):
            if write:
                rows_w += _rows(table, block_size, start, start + n)
        plans, gather = _read_plans(seqs, lengths, tables, writes, block_size)
        index = torch.tensor([*ids, *positions, *rows, *rows_w, *gather], dtype=torch.int64)
        index = index.to(device)
        cut = _cuts(index, [len(ids), len(positions), len(rows), len(rows_w), len(gather)])
        written = [t for o, n, w in zip(offsets, lengths, writes) if w for t in range(o, o + n)]
        return cls(token_ids=cut[0], positions=cut[1], outputs=cut[2],
                   slots=tuple(s for s, _, _ in seqs), starts=tuple(s for _, s, _ in seqs),
                   lengths=tuple(lengths), offsets=tuple(offsets),
                   bidirectional=(tuple(bidirectional) if bidirectional is not None
                                  else (False,) * b),
                   writes=writes,
                   prompts=tuple(prompts) if prompts is not None else (False,) * b,
                   write_rows=cut[3],
                   write_tokens=(None if len(written) == len(ids)
                                 else torch.tensor(written, dtype=torch.int64, device=device)),
                   reads=tuple(plans), gather_blocks=cut[4] if gather else None)


def _rows(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Flattened-pool rows of positions ``start .. end-1`` of a sequence with ``table``."""
    out: list[int] = []
    for i in range(start // block_size, -(-end // block_size)):
        base = table[i] * block_size
        lo, hi = max(start - i * block_size, 0), min(end - i * block_size, block_size)
        out += range(base + lo, base + hi)
    return out


def _read_plans(seqs: Sequence[tuple[int, int, Sequence[int]]], lengths: Sequence[int],
                tables: Sequence[Sequence[int]], writes: Sequence[bool], block_size: int
                ) -> tuple[list[ReadPlan], list[int]]:
    """Each sequence's plan, and the block ids to gather (those of every sequence whose
    blocks are not one run, in order)."""
    plans: list[ReadPlan] = []
    gather: list[int] = []
    for (_, start, _), n, table, write in zip(seqs, lengths, tables, writes):
        length = start + n if write and start else start
        used = list(table[:-(-length // block_size)])
        if not length or used == list(range(used[0], used[0] + len(used))):
            plans.append(ReadPlan(length, used[0] * block_size if used else 0,
                                  append=not write))
        else:
            plans.append(ReadPlan(length, len(gather) * block_size, gathered=True,
                                  append=not write))
            gather += used
    return plans, gather


def _cuts(index: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``index`` split into consecutive pieces of ``sizes`` (views, one transfer for all)."""
    out, at = [], 0
    for n in sizes:
        out.append(index[at:at + n])
        at += n
    return out
