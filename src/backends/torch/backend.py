"""``TorchBackend``: the :class:`~pipeline.protocols.Backend` over a Hugging Face checkpoint.

It owns a :class:`~backends.torch.model.Transformer` and a preallocated per-slot
:class:`~backends.torch.model.KVCache` (``num_slots x max_context`` positions per layer).
``forward`` runs every :class:`~pipeline.protocols.ModelCall` of an engine step (prompt
chunks, decode tokens, draft verification, bidirectional blocks) as one ragged batch and
returns float32 logits at the wanted outputs; ``prefill`` and ``decode`` are conveniences over
it. Every argument is checked before the model runs: a call that does not start at its slot's
cache length, an unallocated or repeated slot, a token id outside the vocabulary, an output
offset outside the call, or a sequence that would outgrow ``max_context`` raises
:class:`~pipeline.errors.SlotError` naming those slots, and no cache changes. Slot lengths
change only after the forward succeeded, so any failure leaves every cache as it was;
``truncate`` shrinks a length (rejected drafts).

Example::

    backend = TorchBackend.from_dir("Qwen3-0.6B/", num_slots=4, max_context=2048)
    slot = backend.allocate()
    z1 = backend.prefill([PrefillChunk(slot, ids, 0, True)])[0]     # cache length len(ids)
    z2 = backend.decode([slot], [int(z1.argmax())])[0]              # cache length len(ids)+1
    backend.release(slot)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from backends.torch.config import ModelSpec
from backends.torch.loader import load_checkpoint
from backends.torch.model import KVCache, MoeFunction, RaggedBatch, Transformer
from backends.torch.moe import moe_forward
from pipeline.errors import CapacityError, InvalidValueError, SlotError
from backends.torch.weights import tensors
from pipeline.options import check_device
from pipeline.protocols import Attention, CacheLayout, ModelCall, ModelInfo, PrefillChunk

if TYPE_CHECKING:
    from pipeline.protocols import Backend, CacheInspector, ModelDescriber


class TorchBackend:
    """A Hugging Face decoder-only model with a KV cache of ``num_slots`` slots.

    ``snapshot`` is the checkpoint's content digest (config + weight index). Not thread-safe:
    calls come from the engine's thread, as the Backend contract says.
    """

    def __init__(self, model: Transformer, snapshot: str, *, num_slots: int = 8,
                 max_context: int | None = None) -> None:
        spec = model.spec
        self.max_context = spec.max_position_embeddings if max_context is None else max_context
        if num_slots < 1:
            raise InvalidValueError("num_slots", num_slots, "must be >= 1")
        if not 1 <= self.max_context <= spec.max_position_embeddings:
            raise InvalidValueError("max_context", max_context,
                                    f"must be in 1..{spec.max_position_embeddings}")
        self.model = model
        self.snapshot = snapshot
        self.num_slots = num_slots
        self.vocab_size = spec.vocab_size
        self.cache = KVCache.empty(spec, num_slots=num_slots, max_len=self.max_context,
                                   dtype=model.dtype, device=model.weights.embed.device)
        self._allocated: set[int] = set()

    @classmethod
    def from_dir(cls, path: str | Path, *, num_slots: int = 8, max_context: int | None = None,
                 dtype: torch.dtype | str | None = None,
                 device: torch.device | str = "cpu",
                 moe: MoeFunction = moe_forward, pack: bool = True,
                 kv_cache_bytes: int | None = None) -> TorchBackend:
        """Load the checkpoint folder ``path``.

        ``max_context`` defaults to the model's ``max_position_embeddings`` (the cache is
        preallocated, so pick less for big models), or with ``kv_cache_bytes`` to the window
        whose keys and values fit in that many bytes (:func:`fitting_context`); ``dtype``
        defaults to the checkpoint's; ``moe`` computes MoE layers' routed experts; ``pack``
        gives float32 CPU weights oneDNN-packed copies (:mod:`backends.torch.packed`; twice
        the weight memory). Raises :class:`~pipeline.errors.InvalidValueError` for a device
        this machine lacks (before reading anything) and
        :class:`~pipeline.errors.ArtifactError` for an unusable folder.
        """
        check_device(device)
        if isinstance(dtype, str):
            dtype = torch_dtype(dtype)
        ckpt = load_checkpoint(Path(path), dtype=dtype, device=device)
        model = Transformer(ckpt.spec, ckpt.weights, moe=moe, pack=pack)
        if max_context is None and kv_cache_bytes is not None:
            max_context = fitting_context(ckpt.spec, num_slots, model.dtype, kv_cache_bytes)
        return cls(model, ckpt.snapshot, num_slots=num_slots, max_context=max_context)

    def model_info(self) -> ModelInfo:
        """Architecture, parameter count, dtype, device and memory
        (:class:`~pipeline.protocols.ModelDescriber`). A quantized weight (a ``meta``
        placeholder here) counts its parameters and its encoded bytes."""
        weights = list(tensors(self.model.weights))
        held = sum(t.numel() * t.element_size() for t in weights if not t.is_meta)
        linears = self.model.linears
        return ModelInfo(
            architecture=self.model.spec.architecture,
            parameters=sum(t.numel() for t in weights),
            dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.weights.embed.device),
            weight_bytes=held + linears.own_bytes, packed_bytes=linears.packed_bytes,
            cache_bytes=self.cache.nbytes)

    def allocate(self) -> int:
        """The lowest free slot, with an empty cache; :class:`CapacityError` when none is."""
        for slot in range(self.num_slots):
            if slot not in self._allocated:
                self._allocated.add(slot)
                self.cache.reset(slot)
                return slot
        raise CapacityError(f"all {self.num_slots} slots are busy")

    def release(self, slot: int) -> None:
        """Free ``slot`` and forget its cache."""
        self._allocated.discard(slot)
        if 0 <= slot < self.num_slots:
            self.cache.reset(slot)

    def cache_length(self, slot: int) -> int:
        """Positions ``slot``'s cache covers."""
        self._check_allocated([slot])
        return self.cache.lengths[slot]

    def cache_layout(self, slot: int) -> CacheLayout:
        """How far each layer has written ``slot``'s keys and values (DESIGN §8, invariant 2;
        :class:`~pipeline.protocols.CacheInspector`)."""
        self._check_allocated([slot])
        return CacheLayout(tuple(e[slot] for e in self.cache.key_extent),
                           tuple(e[slot] for e in self.cache.value_extent))

    def truncate(self, slot: int, length: int) -> None:
        """Keep ``slot``'s first ``length`` positions (``0 <= length <=`` its length)."""
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
        seqs = [(c.slot, c.start, c.token_ids) for c in calls]
        self._check(seqs)
        bad = [c.slot for c in calls
               if any(not 0 <= o < len(c.token_ids) for o in c.outputs)
               or list(c.outputs) != sorted(set(c.outputs))]
        if bad:
            raise SlotError(bad, "output offsets must be ascending and inside the call")
        if not any(c.outputs for c in calls):  # nothing wanted: still write the caches
            self._run(seqs, [(len(c.token_ids) - 1,) for c in calls], calls)
            return torch.empty((0, self.vocab_size))
        return self._run(seqs, [c.outputs for c in calls], calls)

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Append each chunk to its slot; logits ``[len(chunks), V]`` at each chunk's last token."""
        if not chunks:
            return torch.empty((0, self.vocab_size))
        seqs = [(c.slot, c.start, c.token_ids) for c in chunks]
        self._check(seqs)
        return self._run(seqs)

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """Append one token per slot; logits ``[len(slots), V]``."""
        if len(slots) != len(token_ids):
            raise InvalidValueError("token_ids", len(token_ids),
                                    f"need one token per slot ({len(slots)} slots)")
        if not slots:
            return torch.empty((0, self.vocab_size))
        self._check_allocated(slots)
        seqs = [(s, self.cache.lengths[s], (t,)) for s, t in zip(slots, token_ids)]
        self._check(seqs)
        return self._run(seqs)

    def _run(self, seqs: Sequence[tuple[int, int, Sequence[int]]],
             outputs: Sequence[Sequence[int]] | None = None,
             calls: Sequence[ModelCall] | None = None) -> torch.Tensor:
        batch = RaggedBatch.build(
            seqs, device=self.cache.device, outputs=outputs,
            blocks=None if calls is None else [c.attention is Attention.BLOCK for c in calls],
            writes=None if calls is None else [c.write for c in calls])
        self.cache.discard()
        logits = self.model.forward(self.cache, batch)                        # [N, V]
        self.cache.commit(batch)
        return logits  # stays on the model's device: selection and digests run there

    def _check_allocated(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if s not in self._allocated]
        if bad:
            raise SlotError(bad, "slot not allocated")

    def _check(self, seqs: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        slots = [s for s, _, _ in seqs]
        self._check_allocated(slots)
        repeated = sorted({s for s in slots if slots.count(s) > 1})
        if repeated:
            raise SlotError(repeated, "a slot appears more than once in one call")
        for kind, bad in self._problems(seqs):
            if bad:
                raise SlotError(bad, kind)

    def _problems(self, seqs: Sequence[tuple[int, int, Sequence[int]]]
                  ) -> list[tuple[str, list[int]]]:
        lengths = self.cache.lengths
        return [
            ("chunk start differs from the cache length",
             [s for s, start, _ in seqs if start != lengths[s]]),
            ("empty chunk", [s for s, _, ids in seqs if not ids]),
            (f"token id outside 0..{self.vocab_size - 1}",
             [s for s, _, ids in seqs if any(not 0 <= t < self.vocab_size for t in ids)]),
            (f"sequence would exceed max_context={self.max_context}",
             [s for s, start, ids in seqs if start + len(ids) > self.max_context]),
        ]


def fitting_context(spec: ModelSpec, slots: int, dtype: torch.dtype, budget: int) -> int:
    """The longest window (a multiple of 256, at least 256, at most the model's) whose keys
    and values for ``slots`` slots fit in ``budget`` bytes."""
    per_position = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype.itemsize
    fits = budget // (slots * per_position) // 256 * 256
    return max(256, min(spec.max_position_embeddings, fits))


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
