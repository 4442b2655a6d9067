"""Expert tiers: the routed experts of an MoE model under a memory cap.

Owns :class:`ExpertCache` and the expert sources it reads from. A model loaded with a cap
(``BackendOptions.expert_cache_bytes``) keeps ``meta`` placeholders for its ``[E, 2I, H]`` and
``[E, H, I]`` expert stacks; every expert matrix a forward multiplies by comes from the cache.
Three tiers, as llama.cpp's ``--cpu-moe`` and the serving seed keep them:

1. **resident**: experts converted to the compute dtype on the model's device (and
   oneDNN-packed where the model packs its weights), at most ``cap_bytes`` of them;
2. **mapped**: the weight file itself, memory-mapped (:class:`SafetensorsExperts`,
   :class:`~backends.gguf.experts.GGUFExperts`): the operating system keeps the pages it
   read in its page cache while memory allows and drops them when it needs the memory;
3. **disk**: whatever the page cache dropped is read again from the file on the next miss.

A miss reads the expert's gate, up and down matrices from the mapping, converts them exactly
as the full load does (an elementwise cast), and evicts residents until it fits. The policy
decides whom: ``"lru"`` the least recently routed, ``"lfu"`` the least often routed in recent
history (counts halve every :data:`LFU_HALF_LIFE` routings per resident slot, so an expert that
was hot an hour ago does not stay forever). ``benchmarks/expert_tiers.py`` measures both.

The cached matrices are the values the fully loaded model multiplies by, multiplied by the
same products, so a capped model's logits are bit for bit those of the uncapped one and its
greedy output is identical (``tests/test_expert_tiers.py``, on the CPU); only speed changes.
One exception: in bfloat16 on a CUDA device that has ``torch._grouped_mm`` (sm90+), the
uncapped model runs a multi-row forward's experts as one grouped product while the capped one
runs them expert by expert (cuBLAS), which rounds differently; greedy output then agrees as a
different kernel's would, not bit for bit.

Example::

    ckpt = load_checkpoint(folder, mapped_experts=True)
    source = SafetensorsExperts(folder, ckpt.experts)
    cache = ExpertCache(source, ckpt.spec, cap_bytes=256 << 20, policy="lfu",
                        dtype=torch.float32, device=torch.device("cpu"), pack=True)
    gate_up, packed = cache.matrix(layer=0, expert=3, which=0)
"""

from __future__ import annotations

import json
import mmap
import struct
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import attrs
import torch

from backends.torch.config import ModelSpec
from pipeline.errors import ArtifactError, InvalidValueError
from pipeline.options import EXPERT_CACHE_POLICIES

LFU_HALF_LIFE = 64
"""LFU counts halve after this many routings per resident slot (recent frequency, not all
history)."""

GATE_UP, DOWN = 0, 1
"""``which`` of :meth:`ExpertCache.matrix`: the fused ``[2I, H]`` gate/up rows or ``[H, I]``."""


class ExpertSource(Protocol):
    """Where the non-resident experts live: one expert's matrices, read from the file."""

    def read(self, layer: int, expert: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [2I, H], down [H, I])`` of ``expert`` in MoE layer ``layer`` (the model's
        layer index), in ``dtype`` on the CPU, exactly as the full load converts them."""
        ...


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """A safetensors file mapped copy-on-write: its tensors are views of the mapping (the
    operating system reads their pages on first touch), nothing is read at open."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError, struct.error) as exc:
            raise ArtifactError(f"{path}: unreadable safetensors header: {exc}") from exc
        self._base = 8 + size
        self.header: dict[str, dict[str, object]] = {
            k: v for k, v in header.items() if k != "__metadata__"}

    def dtype(self, name: str) -> torch.dtype:
        """Tensor ``name``'s dtype; :class:`~pipeline.errors.ArtifactError` for one this module
        does not read."""
        stored = str(self.header[name]["dtype"])
        dtype = _SAFETENSORS_DTYPES.get(stored)
        if dtype is None:
            raise ArtifactError(f"{self.path}: tensor {name!r} has dtype {stored}, which "
                                "expert tiers do not read (F32, F16, BF16, F64, F8_E4M3 or "
                                "F8_E5M2)")
        return dtype

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the mapping (no copy)."""
        info = self.header[name]
        dtype = self.dtype(name)
        shape = [int(n) for n in info["shape"]]  # type: ignore[attr-defined]
        begin, end = (int(n) for n in info["data_offsets"])  # type: ignore[attr-defined]
        count = (end - begin) // dtype.itemsize
        return torch.frombuffer(self._map, dtype=dtype, count=count,
                                offset=self._base + begin).view(shape)


class SafetensorsExperts:
    """The routed experts of a Hugging Face checkpoint folder, read per expert from its mapped
    safetensors files (per-expert tensors or fused ``gate_up_proj``/``down_proj`` stacks, the
    two layouts :mod:`backends.torch.loader` reads)."""

    def __init__(self, folder: Path, names: Mapping[int, ExpertNames]) -> None:
        from pipeline.model_paths import weight_files

        self._files = [SafetensorsFile(p) for p in weight_files(folder)]
        self._where = {name: f for f in self._files for name in f.header}
        self._names = dict(names)
        prefixes = tuple(f"{n.prefix}.experts." for n in self._names.values())
        for name, f in self._where.items():  # a dtype it cannot read fails the load, not a
            if name.startswith(prefixes):    # request
                f.dtype(name)

    def _tensor(self, name: str) -> torch.Tensor:
        f = self._where.get(name)
        if f is None:
            raise ArtifactError(f"tensor {name!r} is missing from the checkpoint's files")
        return f.tensor(name)

    def read(self, layer: int, expert: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._names[layer]
        if n.fused:  # copies: a resident expert must not be a view of the file's pages
            gate_up = self._tensor(n.gate_up_stack)[expert].to(dtype, copy=True)
            down = self._tensor(n.down_stack)[expert].to(dtype, copy=True)
        else:
            gate, up, down_name = n.expert(expert)
            gate_up = torch.cat([self._tensor(gate).to(dtype), self._tensor(up).to(dtype)])
            down = self._tensor(down_name).to(dtype, copy=True)
        return gate_up, down


@attrs.frozen
class ExpertNames:
    """Where one MoE layer's routed experts are stored: ``fused`` stacks
    (``{prefix}.experts.gate_up_proj``, ``.down_proj``) or one tensor per expert and matrix
    (``{prefix}.experts.{e}.{gate}.weight``, with Mixtral's ``w1/w3/w2`` names)."""

    prefix: str
    fused: bool
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    @property
    def gate_up_stack(self) -> str:
        return f"{self.prefix}.experts.gate_up_proj"

    @property
    def down_stack(self) -> str:
        return f"{self.prefix}.experts.down_proj"

    def expert(self, e: int) -> tuple[str, str, str]:
        """The gate, up and down tensor names of expert ``e``."""
        p = f"{self.prefix}.experts.{e}"
        return f"{p}.{self.gate}.weight", f"{p}.{self.up}.weight", f"{p}.{self.down}.weight"

    def all(self, num_experts: int) -> list[str]:
        """Every tensor name the layer's experts take."""
        if self.fused:
            return [self.gate_up_stack, self.down_stack]
        return [name for e in range(num_experts) for name in self.expert(e)]


@attrs.define
class TierStats:
    """What the cache did: routed matrix lookups that found the expert resident (``hits``) or
    read it from the mapped file (``misses``), residents dropped (``evictions``), bytes read
    from the file and converted (``read_bytes``), and what is resident now."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    read_bytes: int = 0
    resident: int = 0
    resident_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over lookups (1.0 before any lookup)."""
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


@attrs.frozen(eq=False)
class _Entry:
    matrices: tuple[torch.Tensor, torch.Tensor]
    packed: bool
    nbytes: int


class ExpertCache:
    """Resident experts under ``cap_bytes``, filled from ``source`` on a miss and evicted by
    ``policy`` (see the module docstring). ``pack``: oneDNN-packed copies where
    :func:`~backends.torch.packed.packing_available` allows (the packed copy alone is kept).
    The cap must hold one expert (the forward runs an expert's two matrices back to back).
    Not thread-safe: the engine thread calls it, as it calls the backend."""

    def __init__(self, source: ExpertSource, spec: ModelSpec, *, cap_bytes: int,
                 policy: str = "lfu", dtype: torch.dtype, device: torch.device,
                 pack: bool = True) -> None:
        if policy not in EXPERT_CACHE_POLICIES:
            raise InvalidValueError("expert_cache_policy", policy, "must be 'lru' or 'lfu'")
        moe = spec.moe
        if moe is None or not spec.moe_layers:
            raise InvalidValueError("expert_cache_bytes", cap_bytes,
                                    "applies to mixture-of-experts models; this one has no "
                                    "routed experts")
        self.expert_bytes = 3 * moe.intermediate_size * spec.hidden_size * dtype.itemsize
        """One expert's gate, up and down matrices in the compute dtype."""
        if cap_bytes < self.expert_bytes:
            raise InvalidValueError("expert_cache_bytes", cap_bytes,
                                    f"must hold at least one expert ({self.expert_bytes} "
                                    "bytes)")
        self.source, self.cap_bytes, self.policy = source, cap_bytes, policy
        self.dtype, self.device, self.pack = dtype, device, pack
        self.total_bytes = len(spec.moe_layers) * moe.num_experts * self.expert_bytes
        """Every routed expert's bytes in the compute dtype (the uncapped model's)."""
        self.stats = TierStats()
        self._resident: OrderedDict[tuple[int, int], _Entry] = OrderedDict()  # LRU order
        self._uses: dict[tuple[int, int], float] = {}
        self._routings = 0

    def matrix(self, layer: int, expert: int, which: int) -> tuple[torch.Tensor, bool]:
        """Expert ``expert``'s ``which`` matrix (:data:`GATE_UP` or :data:`DOWN`) of MoE
        layer ``layer``, and whether it is oneDNN-packed. A :data:`GATE_UP` lookup is one
        routing (the forward asks for it first); it counts as a hit or a miss."""
        key = (layer, expert)
        entry = self._resident.get(key)
        if which == GATE_UP:
            self._route(key, entry is not None)
        elif entry is None:  # evicted between its two matrices: only a one-expert cap
            self.stats.misses += 1
        if entry is None:
            entry = self._load(key)
        else:
            self._resident.move_to_end(key)
        return entry.matrices[which], entry.packed

    def _route(self, key: tuple[int, int], hit: bool) -> None:
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        self._uses[key] = self._uses.get(key, 0.0) + 1.0
        self._routings += 1
        if self._routings >= LFU_HALF_LIFE * max(1, self.cap_bytes // self.expert_bytes):
            self._routings = 0
            self._uses = {k: v / 2 for k, v in self._uses.items() if v >= 0.25}

    def _load(self, key: tuple[int, int]) -> _Entry:
        from backends.torch.packed import packing_available

        while self._resident and self.stats.resident_bytes + self.expert_bytes > self.cap_bytes:
            self._evict()  # room first: the cap bounds what is held, the read included
        gate_up, down = self.source.read(key[0], key[1], self.dtype)
        self.stats.read_bytes += sum(t.numel() * t.element_size() for t in (gate_up, down))
        gate_up, down = gate_up.to(self.device), down.to(self.device)
        packed = self.pack and packing_available(gate_up)
        if packed:
            gate_up = torch.ops.mkldnn._reorder_linear_weight(gate_up, 1)
            down = torch.ops.mkldnn._reorder_linear_weight(down, 1)
        else:
            gate_up, down = gate_up.contiguous(), down.contiguous()
        nbytes = sum(t.numel() * t.element_size() for t in (gate_up, down))
        entry = _Entry((gate_up, down), packed, nbytes)
        self._resident[key] = entry
        self.stats.resident += 1
        self.stats.resident_bytes += nbytes
        return entry

    def _evict(self) -> None:
        if self.policy == "lru":
            key = next(iter(self._resident))
        else:  # least used in recent history; ties: least recently routed
            # (the residents are in routing order: a hit moves its entry to the end)
            key = min(enumerate(self._resident),
                      key=lambda ik: (self._uses.get(ik[1], 0.0), ik[0]))[1]
        entry = self._resident.pop(key)
        self.stats.evictions += 1
        self.stats.resident -= 1
        self.stats.resident_bytes -= entry.nbytes
