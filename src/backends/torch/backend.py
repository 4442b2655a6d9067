"""``TorchBackend``: the :class:`~pipeline.contracts.model.Backend` over a Hugging Face checkpoint.

It owns a :class:`~backends.torch.model.Transformer` and a paged
:class:`~backends.torch.kv.KVCache`: per layer a pool of ``num_blocks`` blocks of
``block_size`` positions. ``forward`` runs every :class:`~pipeline.contracts.model.ModelCall` of an
engine step (prompt chunks, decode tokens, draft verification, bidirectional blocks) as one
ragged batch and returns float32 logits at the wanted outputs; ``prefill`` and ``decode`` are
conveniences over it.

**Who owns the blocks.** Until a call carries a block table, the backend manages the pool with
a :class:`~pipeline.engine.blocks.BlockManager` of its own: a slot's first call reserves it a whole
window (``ceil(max_context / block_size)`` blocks, a contiguous run whenever the pool allows,
so attention reads it as a view), kept until ``release``. A caller that only knows slots thus
sees the fixed-slot cache it always had. The first call that carries ``blocks`` hands the
pool to its caller (:class:`~pipeline.contracts.model.PagedBackend`: the engine's own manager
decides every table) for the backend's lifetime; that needs every slot's cache empty (empty
reservations are dropped), and from then on a call without ``blocks`` is refused.

**Memory rule.** The pool takes ``2 x layers x Hkv x head_dim x dtype size x block_size x
num_blocks`` bytes (:func:`block_bytes` per block). By default ``num_blocks = num_slots x
ceil(max_context / block_size)``: every slot can hold a whole window at once, as the
per-slot cache did (at most ``block_size - 1`` positions more per slot); ``kv_blocks`` sets
it (``kv_cache_bytes`` instead: the blocks that budget holds), less to bound memory, more to let a
block-managing engine keep more requests and cached prefixes. A pool of fewer than
``num_slots`` windows is for such an engine: without block tables, a slot whose first call
finds no free window fails with :class:`~pipeline.errors.SlotError`.

Every argument is checked before the model runs: a call that does not start at its slot's
cache length, an unallocated or repeated slot, a token id outside the vocabulary, an output
offset outside the call, a sequence that would outgrow ``max_context``, or a malformed block
table raises :class:`~pipeline.errors.SlotError` naming those slots, and no cache changes.
Slot lengths change only after the forward succeeded, so any failure leaves every cache as it
was; ``truncate`` shrinks a length (rejected drafts).

Example::

    backend = TorchBackend.from_dir("Qwen3-0.6B/", num_slots=4, max_context=2048)
    slot = backend.allocate()
    z1 = backend.prefill([PrefillChunk(slot, ids, 0, True)])[0]     # cache length len(ids)
    z2 = backend.decode([slot], [int(z1.argmax())])[0]              # cache length len(ids)+1
    backend.release(slot)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from backends.torch.conditioning import Piece, call_inputs, embedding_space
from backends.torch.config import ModelSpec
from backends.torch.experts import ExpertCache, SafetensorsExperts
from backends.torch.loader import load_checkpoint
from backends.torch.kv import KVCache, RaggedBatch
from backends.torch.model import MoeFunction, Transformer
from backends.torch.moe import ExpertSlice, moe_forward
from backends.torch.shard import Shard
from backends.torch.threads import ThreadChooser
from backends.torch.weights import tensors
from pipeline.engine.blocks import DEFAULT_BLOCK_SIZE, BlockManager
from pipeline.errors import CapacityError, InvalidValueError, OutOfBlocks, SlotError
from pipeline.options import check_device
from pipeline.contracts.model import (
    Attention, CacheLayout, ModelCall, ModelInfo, PrefillChunk, Tap, tap_names,
)

if TYPE_CHECKING:
    from pipeline.contracts.model import (
        Backend, CacheInspector, Embedder, EmbeddingInputs, ModelDescriber, PagedBackend,
    )


class TorchBackend:
    """A Hugging Face decoder-only model with a paged KV cache for ``num_slots`` sequences.

    ``snapshot`` is the checkpoint's content digest (config + weight index). ``kv_blocks``
    (or the blocks a byte budget ``kv_cache_bytes`` holds) and ``block_size`` size the pool
    (see the module docstring's memory rule). Not thread-safe:
    calls come from the engine's thread, as the Backend contract says.
    """

    def __init__(self, model: Transformer, snapshot: str, *, num_slots: int = 8,
                 max_context: int | None = None, kv_blocks: int | None = None,
                 kv_cache_bytes: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, kv_int8: bool = False,
                 threads: int | None = None) -> None:
        spec = model.spec
        self.max_context = spec.max_position_embeddings if max_context is None else max_context
        if num_slots < 1:
            raise InvalidValueError("num_slots", num_slots, "must be >= 1")
        if not 1 <= self.max_context <= spec.max_position_embeddings:
            raise InvalidValueError("max_context", max_context,
                                    f"must be in 1..{spec.max_position_embeddings}")
        if block_size < 1:
            raise InvalidValueError("block_size", block_size, "must be >= 1")
        self.window_blocks = -(-self.max_context // block_size)
        if kv_cache_bytes is not None:
            if kv_blocks is not None:
                raise InvalidValueError("kv_cache_bytes", kv_cache_bytes,
                                        "give the KV pool's size once: kv_blocks or "
                                        "kv_cache_bytes")
            kv_blocks = blocks_for_bytes(spec, model.dtype, kv_cache_bytes, block_size, kv_int8)
        if kv_blocks is not None and kv_blocks < self.window_blocks:
            field, value = (("kv_blocks", kv_blocks) if kv_cache_bytes is None
                            else ("kv_cache_bytes", kv_cache_bytes))
            raise InvalidValueError(field, value,
                                    f"must hold one window of max_context={self.max_context} "
                                    f"positions ({self.window_blocks} blocks of {block_size})")
        self.model = model
        self.snapshot = snapshot
        self.batch_invariant = model.batch_invariant
        """Whether a sequence's logits are independent of its batch (the trace records it)."""
        self.num_slots = num_slots
        self.vocab_size = spec.vocab_size
        self.hidden_size = spec.hidden_size
        """The width of :meth:`hidden_states` rows (:class:`~pipeline.contracts.model.Embedder`)."""
        self.block_size = block_size
        self.num_blocks = num_slots * self.window_blocks if kv_blocks is None else kv_blocks
        self.cache = KVCache.empty(spec, num_blocks=self.num_blocks, block_size=block_size,
                                   num_slots=num_slots, dtype=model.dtype,
                                   device=model.weights.embed.device, quantized=kv_int8)
        self.own_blocks: BlockManager | None = BlockManager(self.num_blocks, block_size,
                                                            snapshot=snapshot)
        self._allocated: set[int] = set()
        self._space: torch.Tensor | None = None
        self._tap: Tap | None = None
        if threads is not None and threads < 1:
            raise InvalidValueError("threads", threads, "must be >= 1")
        self.fixed_threads = threads if self.cache.device.type == "cpu" else None
        """The ``threads`` option: every forward runs on this many intra-op threads (None:
        :attr:`threads` chooses for decode steps)."""
        if self.fixed_threads is not None:
            torch.set_num_threads(self.fixed_threads)
        self.threads = (ThreadChooser(torch.get_num_threads())
                        if self.cache.device.type == "cpu" and threads is None else None)
        """Picks the intra-op thread count of one-token decode forwards by measuring them (CPU
        only, without a ``threads`` option; :mod:`backends.torch.threads`), between 1 and the
        process's setting, which is restored after each forward: torch's count is
        process-wide, so while such a forward runs on one thread, so does anything else the
        process runs in torch."""
        self._last_rows = 1
        self._lowered: int | None = None
        """The thread count a capped decode step left in place (other processes hold the
        rest of the cores, :attr:`ThreadChooser.capped`), until a step finds them free."""

    @classmethod
    def from_dir(cls, path: str | Path, *, num_slots: int = 8, max_context: int | None = None,
                 dtype: torch.dtype | str | None = None,
                 device: torch.device | str = "cpu",
                 moe: MoeFunction = moe_forward, pack: bool = True,
                 kv_blocks: int | None = None, kv_cache_bytes: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 batch_invariant: bool = False, kv_int8: bool = False,
                 expert_cache_bytes: int | None = None,
                 expert_cache_policy: str = "lfu", shard: Shard | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 threads: int | None = None) -> TorchBackend:
        """Load the checkpoint folder ``path``.

        ``max_context`` defaults to the model's ``max_position_embeddings`` (the default pool
        holds ``num_slots`` such windows, so pick less for big models), or with
        ``kv_cache_bytes`` to the window of which ``num_slots`` fit in that many bytes
        (:func:`fitting_context`); ``dtype`` defaults to the checkpoint's; ``moe`` computes
        MoE layers' routed experts; ``pack`` gives float32 CPU weights oneDNN-packed copies
        (:mod:`backends.torch.packed`; twice the weight memory); ``kv_blocks`` (or the byte
        budget ``kv_cache_bytes``) and ``block_size`` size the KV pool (``kv_int8``: keys and
        values kept in int8, :mod:`backends.torch.kv`); ``batch_invariant``
        makes each sequence's logits independent of its batch (:mod:`backends.torch.invariant`);
        ``expert_cache_bytes`` caps the memory of an MoE model's routed experts, the rest read
        from the mapped weight files as routing asks for them and kept by
        ``expert_cache_policy`` (``"lru"`` or ``"lfu"``; :mod:`backends.torch.experts`);
        ``shard`` loads one rank's part of a tensor/expert-parallel model, whose blocks'
        outputs ``reduce`` sums over the group (:mod:`backends.torch.parallel`); ``threads``
        fixes the CPU threads of every forward (None: decode steps choose by measuring).
        Raises
        :class:`~pipeline.errors.InvalidValueError` for a device this machine lacks (before
        reading anything) and :class:`~pipeline.errors.ArtifactError` for an unusable folder.
        """
        check_device(device)
        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        tiered = expert_cache_bytes is not None
        if shard is not None and (tiered or reduce is None):
            raise InvalidValueError("shard", shard, "a shard needs the group's reduce and "
                                    "cannot be combined with an expert cap")
        ckpt = load_checkpoint(Path(path), dtype=dtype, device=device, mapped_experts=tiered,
                               shard=shard)
        spec = ckpt.spec if shard is None else shard.local_spec(ckpt.spec)
        if shard is not None and spec.moe is not None:
            first, stop = shard.span(spec.moe.num_experts)
            moe = ExpertSlice(first, stop - first)
        experts = None
        if expert_cache_bytes is not None:
            experts = ExpertCache(SafetensorsExperts(Path(path), ckpt.experts), ckpt.spec,
                                  cap_bytes=expert_cache_bytes, policy=expert_cache_policy,
                                  dtype=ckpt.weights.norm.dtype,
                                  device=ckpt.weights.norm.device, pack=pack)
        model = Transformer(spec, ckpt.weights, moe=moe, pack=pack,
                            batch_invariant=batch_invariant, experts=experts, reduce=reduce)
        if max_context is None and kv_cache_bytes is not None:
            max_context = fitting_context(spec, num_slots, model.dtype, kv_cache_bytes,
                                          kv_int8)
        return cls(model, ckpt.snapshot, num_slots=num_slots, max_context=max_context,
                   kv_blocks=kv_blocks, kv_cache_bytes=kv_cache_bytes, block_size=block_size,
                   kv_int8=kv_int8, threads=threads)

    def model_info(self) -> ModelInfo:
        """Architecture, parameter count, dtype, device and memory
        (:class:`~pipeline.contracts.model.ModelDescriber`). A quantized weight (a ``meta``
        placeholder here) counts its parameters and its encoded bytes."""
        weights = list(tensors(self.model.weights))
        held = sum(t.numel() * t.element_size() for t in weights if not t.is_meta)
        if self.model.experts is not None:  # tiered experts: what is resident now
            held += self.model.experts.stats.resident_bytes
        linears = self.model.linears
        return ModelInfo(
            architecture=self.model.spec.architecture,
            parameters=sum(t.numel() for t in weights),
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.weights.embed.device),
            weight_bytes=held + linears.own_bytes, packed_bytes=linears.packed_bytes,
            cache_bytes=self.cache.nbytes, threads=self.thread_policy)

    @property
    def thread_policy(self) -> str | None:
        """How decode steps choose their CPU threads: ``"2"`` (the ``threads`` option) or
        ``"1-2 by measuring"``; None on another device."""
        if self.fixed_threads is not None:
            return str(self.fixed_threads)
        if self.threads is None:
            return None
        return f"1-{self.threads.most} by measuring" if self.threads.most > 1 else "1"

    def threads_report(self) -> str | None:
        """The thread count decode steps use now and why, for ``pipeline run --verbose``:
        ``"2 (the threads option)"``, or ``"1 of 2, chosen by measuring decode steps (1:
        9.8 ms, 2: 14.1 ms a step)"``; None on another device."""
        if self.fixed_threads is not None:
            return f"{self.fixed_threads} (the threads option)"
        chooser = self.threads
        if chooser is None:
            return None
        if chooser.most == 1:
            return "1 (torch's count is 1)"
        if chooser.capped and chooser.load is not None:
            busy = chooser.load() or 0.0
            return (f"{chooser.free_cores()} of {chooser.most}: other processes keep "
                    f"{busy:.1f} of {chooser.cores} cores busy")
        now = chooser.chosen(self._last_rows)
        measured = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in
                             sorted(chooser.averages(self._last_rows).items()))
        return (f"{now} of {chooser.most}, chosen by measuring decode steps"
                + (f" ({measured} a step)" if measured else ""))

    @property
    def embedding_dim(self) -> int:
        """d of embedding inputs: the hidden size (:class:`EmbeddingInputs`)."""
        return self.model.spec.hidden_size

    @property
    def time_conditioned(self) -> bool:
        """Whether the model reads a call's ``time`` (its config's embedding_conditioning)."""
        cond = self.model.weights.conditioning
        return cond is not None and cond.time_in is not None

    @property
    def self_conditioned(self) -> bool:
        """Whether the model reads a call's ``self_condition``."""
        cond = self.model.weights.conditioning
        return cond is not None and cond.self_condition is not None

    def embedding_space(self) -> torch.Tensor:
        """Every token's embedding, rows at unit RMS, ``[V, H]`` float32 (computed once)."""
        if self._space is None:
            self._space = embedding_space(self.model.weights.embed)
        return self._space

    def _inputs(self, calls: Sequence[ModelCall], batch: RaggedBatch) -> torch.Tensor | None:
        """The first hidden states when a call brings embeddings, a time or a
        self-condition (None: the plain token embeddings)."""
        pieces = [Piece(at, len(c.token_ids), c.embeddings, c.time, c.self_condition)
                  for c, at in zip(calls, batch.offsets)
                  if c.embeddings is not None or c.time is not None
                  or c.self_condition is not None]
        if not pieces:
            return None
        h = self.model.embed(batch.token_ids)                                      # [T, H]
        return call_inputs(self.model.weights.conditioning, h, pieces)

    @property
    def caller_owns_blocks(self) -> bool:
        """True once a call carried block tables: the caller manages the pool from then on."""
        return self.own_blocks is None

    def allocate(self) -> int:
        """The lowest free slot, with an empty cache; :class:`CapacityError` when all are
        busy. (Blocks are reserved at the slot's first call, if the backend owns them.)"""
        slot = next((s for s in range(self.num_slots) if s not in self._allocated), None)
        if slot is None:
            raise CapacityError(f"all {self.num_slots} slots are busy")
        self._allocated.add(slot)
        self.cache.reset(slot)
        return slot

    def release(self, slot: int) -> None:
        """Free ``slot``, its cache, and the blocks the backend gave it."""
        self._allocated.discard(slot)
        if self.own_blocks is not None and slot in self.own_blocks:
            self.own_blocks.free(slot)
        if 0 <= slot < self.num_slots:
            self.cache.reset(slot)

    def cache_length(self, slot: int) -> int:
        """Positions ``slot``'s cache covers."""
        self._check_allocated([slot])
        return self.cache.lengths[slot]

    def cache_layout(self, slot: int) -> CacheLayout:
        """How far each layer has written ``slot``'s keys and values (docs/design.md §8,
        invariant 2; :class:`~pipeline.contracts.model.CacheInspector`)."""
        self._check_allocated([slot])
        return CacheLayout(tuple(e[slot] for e in self.cache.key_extent),
                           tuple(e[slot] for e in self.cache.value_extent))

    def truncate(self, slot: int, length: int) -> None:
        """Keep ``slot``'s first ``length`` positions (``0 <= length <=`` its length). The
        backend's own blocks stay reserved; a caller that owns the blocks frees its own."""
        self._check_allocated([slot])
        if not 0 <= length <= self.cache.lengths[slot]:
            raise SlotError([slot], f"cannot truncate a cache of {self.cache.lengths[slot]} "
                                    f"positions to {length}")
        self.cache.truncate(slot, length)

    @torch.inference_mode()
    def forward(self, calls: Sequence[ModelCall]) -> torch.Tensor:
        """Run ``calls`` as one batch; logits ``[N, V]`` at their wanted outputs."""
        if not calls:
            return torch.empty((0, self.vocab_size))
        self._check(calls)
        bad = [c.slot for c in calls
               if any(not 0 <= o < len(c.token_ids) for o in c.outputs)
               or list(c.outputs) != sorted(set(c.outputs))]
        if bad:
            raise SlotError(bad, "output offsets must be ascending and inside the call")
        tables = self._tables(calls)
        if not any(c.outputs for c in calls):  # nothing wanted: still write the caches
            self._run(calls, tables, [(len(c.token_ids) - 1,) for c in calls])
            return torch.empty((0, self.vocab_size))
        return self._run(calls, tables, [c.outputs for c in calls])

    @torch.inference_mode()
    def hidden_states(self, token_ids: Sequence[int]) -> torch.Tensor:
        """The final hidden states ``[T, hidden_size]`` float32 of ``token_ids`` as one
        causal sequence (:class:`~pipeline.contracts.model.Embedder`): no slot, no KV block, no
        cache length is touched. Call it from the engine's thread."""
        ids = list(token_ids)
        if not 1 <= len(ids) <= self.max_context:
            raise InvalidValueError("token_ids", len(ids),
                                    f"must hold 1..{self.max_context} tokens")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidValueError("token_ids", bad,
                                    f"outside the vocabulary (size {self.vocab_size})")
        tokens = torch.tensor(ids, dtype=torch.long, device=self.cache.device)   # [T]
        return self.model.hidden_states(tokens).cpu()                           # [T, H]

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Append each chunk to its slot; logits ``[len(chunks), V]`` at each chunk's last token."""
        calls = [ModelCall(c.slot, c.token_ids, c.start, (len(c.token_ids) - 1,), prompt=True)
                 for c in chunks]
        return self.forward(calls)

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Append one token per slot; logits ``[len(slots), V]``."""
        if len(slots) != len(token_ids):
            raise InvalidValueError("token_ids", len(token_ids),
                                    f"need one token per slot ({len(slots)} slots)")
        self._check_allocated(slots)
        return self.forward([ModelCall(s, (t,), self.cache.lengths[s], (0,))
                             for s, t in zip(slots, token_ids)])

    def _run(self, calls: Sequence[ModelCall], tables: Sequence[Sequence[int]],
             outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        batch = RaggedBatch.build(
            [(c.slot, c.start, c.token_ids) for c in calls], tables=tables,
            block_size=self.block_size, device=self.cache.device, outputs=outputs,
            bidirectional=[c.attention is Attention.BLOCK for c in calls],
            writes=[c.write for c in calls], prompts=[c.prompt for c in calls])
        self.cache.discard()
        inputs = self._inputs(calls, batch)
        if self._tap is not None:
            self.model.tap = _split_tap(self._tap, batch)
        try:
            return self._forward(batch, calls, inputs)
        finally:
            self.model.tap = None

    def _forward(self, batch: RaggedBatch, calls: Sequence[ModelCall],
                 inputs: torch.Tensor | None) -> torch.Tensor:
        chooser = self.threads
        if self.fixed_threads is not None:
            _use_threads(self.fixed_threads)  # this thread may have set up its pool earlier
        if chooser is None or not all(_plain_decode(c) for c in calls) or inputs is not None:
            logits = self.model.forward(self.cache, batch, inputs)                 # [N, V]
        else:  # one token per sequence: the kernels whose bits are checked on any count
            rows, current = len(calls), torch.get_num_threads()
            self._last_rows = rows
            if current == self._lowered:  # the count this backend left at the last step
                current = chooser.most
            elif current != chooser.most:  # the process's setting changed: measure anew
                chooser = self.threads = ThreadChooser(current, load=chooser.load)
            threads = _use_threads(chooser.threads_for(rows))
            started = time.perf_counter()
            try:
                logits = self.model.forward(self.cache, batch, inputs)
            finally:
                # the rest of the step as it always runs; but while other processes hold
                # cores, on what they leave: a sampling op on two threads would wait at its
                # barrier for the descheduled one (measured: 11 tok/s against 33)
                self._lowered = threads if chooser.capped and threads < current else None
                if self._lowered is None:
                    _use_threads(current)
            chooser.record(rows, threads, time.perf_counter() - started)
        self.cache.commit(batch)
        return logits  # stays on the model's device: selection and digests run there

    def tap_names(self) -> tuple[str, ...]:
        """The layer taps' names (:class:`~pipeline.contracts.model.LayerTaps`)."""
        return tap_names(len(self.model.weights.layers))

    def set_tap(self, tap: Tap | None) -> None:
        """Send later forwards' hidden states to ``tap``, call by call (None: stop)."""
        self._tap = tap

    def _tables(self, calls: Sequence[ModelCall]) -> list[Sequence[int]]:
        """Each call's block table: its own, or (while the backend manages the blocks) the
        slot's window, reserved at its first call."""
        own = self.own_blocks
        if own is None:
            return [c.blocks for c in calls if c.blocks is not None]
        short = []
        for c in calls:
            if c.slot not in own:
                try:
                    own.allocate(c.slot, self.window_blocks * self.block_size)
                except OutOfBlocks:
                    short.append(c.slot)
        if short:
            raise SlotError(short, f"no free KV window ({self.window_blocks} blocks) in a pool "
                                   f"of {self.num_blocks}: pass block tables, or raise kv_blocks")
        return [own.table(c.slot) for c in calls]

    def _check_allocated(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._allocated]
        if bad:
            raise SlotError(bad, "slot not allocated")

    def _check(self, calls: Sequence[ModelCall]) -> None:
        slots = [c.slot for c in calls]
        self._check_allocated(slots)
        repeated = sorted({s for s in slots if slots.count(s) > 1})
        if repeated:
            raise SlotError(repeated, "a slot appears more than once in one call")
        self._take_blocks_if_paged(calls)
        for kind, bad in self._problems(calls):
            if bad:
                raise SlotError(bad, kind)

    def _take_blocks_if_paged(self, calls: Sequence[ModelCall]) -> None:
        """Hand the pool to the caller at its first call with block tables (every slot's own
        cache must be empty then); refuse calls without tables afterwards."""
        paged = [c.blocks is not None for c in calls]
        if self.own_blocks is None:
            if not all(paged):
                raise SlotError([c.slot for c in calls if c.blocks is None],
                                "the caller manages this backend's KV blocks: every call "
                                "needs its block table")
            return
        if not any(paged):
            return
        if not all(paged):
            raise SlotError([c.slot for c in calls if c.blocks is None],
                            "calls with and without block tables in one forward")
        busy = sorted(s for s in self._allocated if self.cache.lengths[s])
        if busy:
            raise SlotError(busy, "a call with block tables takes the KV pool from the "
                                  "backend, but these slots still hold caches in its blocks")
        self.own_blocks = None          # empty reservations go with it: the caller owns all

    def _problems(self, calls: Sequence[ModelCall]) -> list[tuple[str, list[int]]]:
        lengths, bs = self.cache.lengths, self.block_size
        paged = self.own_blocks is None
        return [
            ("chunk start differs from the cache length",
             [c.slot for c in calls if c.start != lengths[c.slot]
              and not (paged and lengths[c.slot] == 0 and c.start % bs == 0)]),
            ("empty chunk", [c.slot for c in calls if not c.token_ids]),
            (f"token id outside 0..{self.vocab_size - 1}",
             [c.slot for c in calls if any(not 0 <= t < self.vocab_size for t in c.token_ids)]),
            (f"sequence would exceed max_context={self.max_context}",
             [c.slot for c in calls if c.start + len(c.token_ids) > self.max_context]),
            *(_table_problems(calls, bs, self.num_blocks) if paged else []),
            *self._input_problems(calls),
        ]

    def _input_problems(self, calls: Sequence[ModelCall]) -> list[tuple[str, list[int]]]:
        """Embedding inputs of the wrong shape, and conditioning the model does not read."""
        shape = [c.slot for c in calls for x in (c.embeddings, c.self_condition)
                 if x is not None and tuple(x.shape) != (len(c.token_ids), self.embedding_dim)]
        return [
            (f"embeddings and self_condition must be [len(token_ids), {self.embedding_dim}]",
             sorted(set(shape))),
            ("time must be a number in [0, 1]",
             [c.slot for c in calls if c.time is not None and not 0.0 <= c.time <= 1.0]),
            ("the model has no time conditioning (its config.json's embedding_conditioning)",
             [c.slot for c in calls if c.time is not None and not self.time_conditioned]),
            ("the model has no self-conditioning (its config.json's embedding_conditioning)",
             [c.slot for c in calls
              if c.self_condition is not None and not self.self_conditioned]),
        ]


def position_bytes(spec: ModelSpec, dtype: torch.dtype, kv_int8: bool = False) -> int:
    """Bytes one position's keys and values take over all layers: ``dtype``'s, or int8 with
    a float32 scale per head."""
    per_head = spec.head_dim + 4 if kv_int8 else spec.head_dim * dtype.itemsize
    return 2 * spec.num_layers * spec.num_kv_heads * per_head


def fitting_context(spec: ModelSpec, slots: int, dtype: torch.dtype, budget: int,
                    kv_int8: bool = False) -> int:
    """The longest window (a multiple of 256, at least 256, at most the model's) whose keys
    and values for ``slots`` slots fit in ``budget`` bytes."""
    per_position = position_bytes(spec, dtype, kv_int8)
    fits = budget // (slots * per_position) // 256 * 256
    return max(256, min(spec.max_position_embeddings, fits))
def _table_problems(calls: Sequence[ModelCall], block_size: int, num_blocks: int
                    ) -> list[tuple[str, list[int]]]:
    """What is wrong with the calls' block tables (:class:`~pipeline.contracts.model.PagedBackend`)."""
    tables = [c.blocks or () for c in calls]
    needed = [c.start + len(c.token_ids) if c.write else c.start for c in calls]
    writes = [set(t[c.start // block_size:-(-n // block_size)]) if c.write else set()
              for c, t, n in zip(calls, tables, needed)]
    writer: dict[int, int] = {}
    clash: set[int] = set()
    for c, own in zip(calls, writes):                     # two calls write one block
        for b in own:
            if writer.setdefault(b, c.slot) != c.slot:
                clash |= {c.slot, writer[b]}
    for c, t, own in zip(calls, tables, writes):          # a call reads what another writes
        foreign = writer.keys() & set(t) - own
        if foreign:
            clash |= {c.slot, *(writer[b] for b in foreign)}
    return [
        (f"block id outside 0..{num_blocks - 1}",
         [c.slot for c, t in zip(calls, tables) if t and (min(t) < 0 or max(t) >= num_blocks)]),
        ("a block appears twice in one table",
         [c.slot for c, t in zip(calls, tables) if len(set(t)) != len(t)]),
        (f"block table too short for the call's positions (blocks of {block_size})",
         [c.slot for c, t, n in zip(calls, tables, needed) if len(t) * block_size < n]),
        ("one call of the forward writes a block that another holds",
         [c.slot for c in calls if c.slot in clash]),
    ]


def block_bytes(spec: ModelSpec, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE,
                kv_int8: bool = False) -> int:
    """Bytes one KV block takes over all layers (keys and values)."""
    return position_bytes(spec, dtype, kv_int8) * block_size


def blocks_for_bytes(spec: ModelSpec, dtype: torch.dtype, budget: int,
                     block_size: int = DEFAULT_BLOCK_SIZE, kv_int8: bool = False) -> int:
    """The KV blocks that ``budget`` bytes hold."""
    return budget // block_bytes(spec, dtype, block_size, kv_int8)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` ("float32", "bfloat16", ...)."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise InvalidValueError("dtype", name, "not a torch dtype name")
    return value


if TYPE_CHECKING:
    def _satisfies_backend(backend: TorchBackend) -> Backend:
        """mypy proves structurally that TorchBackend is a Backend (isinstance checks names)."""
        return backend

    def _satisfies_cache_inspector(backend: TorchBackend) -> CacheInspector:
        """... and a CacheInspector."""
        return backend

    def _satisfies_model_describer(backend: TorchBackend) -> ModelDescriber:
        """... and a ModelDescriber."""
        return backend

    def _satisfies_paged_backend(backend: TorchBackend) -> PagedBackend:
        """... and a PagedBackend."""
        return backend

    def _satisfies_embedding_inputs(backend: TorchBackend) -> EmbeddingInputs:
        """... and takes embedding inputs."""
        return backend

    def _satisfies_embedder(backend: TorchBackend) -> Embedder:
        """... and gives final hidden states (embeddings)."""
        return backend


def _plain_decode(call: ModelCall) -> bool:
    """A one-token causal decode call: the only calls whose thread count is chosen (their
    products, attention and norms give the same bits on one thread as on several; other
    calls, prompt chunks, blocks and embedding inputs, run as they always do)."""
    return (len(call.token_ids) == 1 and not call.prompt
            and call.attention is not Attention.BLOCK)


def _use_threads(count: int) -> int:
    """Set torch's intra-op thread count to ``count`` (when it differs); returns ``count``."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    return count


def _split_tap(tap: Tap, batch: RaggedBatch) -> Callable[[str, torch.Tensor], None]:
    """The model's whole-batch tap, handing each call its own rows."""
    spans = list(zip(batch.offsets, batch.lengths))

    def split(name: str, hidden: torch.Tensor) -> None:
        for call, (at, n) in enumerate(spans):
            tap(call, name, hidden[at:at + n])
    return split
