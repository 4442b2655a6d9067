"""Loading a Hugging Face checkpoint folder: ``config.json`` plus safetensors weights.

Weights come from ``model.safetensors`` or from the shards named by
``model.safetensors.index.json``, opened with ``safetensors.safe_open`` (memory-mapped; only
the tensors the model uses are read). Routed experts may be stored per expert — Qwen MoE's
``mlp.experts.{e}.{gate,up,down}_proj.weight`` or Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, which is what transformers 5.x
``save_pretrained`` writes — or fused as ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]`` (transformers' in-memory layout); both load to the fused form.

Every problem is an :class:`~pipeline.errors.ArtifactError` that names the file and, where
there is one, the tensor: an unreadable config, a missing or truncated shard, a missing
tensor, a wrong shape, or a tensor the config does not account for.

On a terminal (standard error is a TTY) loading draws a progress bar by bytes read; pass
``progress=`` any text stream to draw it there, or ``progress=False`` for none.

``snapshot`` is the content digest of the config and the weight index (every tensor's name,
shape and dtype), so it does not depend on the folder's name or location.

Example::

    ckpt = load_checkpoint(Path("model/"), dtype=torch.bfloat16)
    model = Transformer(ckpt.spec, ckpt.weights)
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import attrs
import torch
from safetensors import safe_open

from backends.torch.config import ModelSpec
from backends.torch.experts import ExpertNames
from backends.torch.shard import Shard
from backends.torch.weights import (
    AttentionWeights, ConditioningWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)
from pipeline.errors import ArtifactError
from pipeline.model_paths import checkpoint_snapshot, read_config, weight_files

_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some older checkpoints saved


@attrs.frozen
class Checkpoint:
    """What :func:`load_checkpoint` returns: the spec, the weights and the snapshot digest."""

    spec: ModelSpec
    weights: ModelWeights = attrs.field(eq=False)
    snapshot: str
    experts: dict[int, ExpertNames] = attrs.field(factory=dict, eq=False)
    """Where each MoE layer (by layer index) stores its routed experts."""


@attrs.frozen
class TensorInfo:
    """Where a tensor is stored, and its header shape and dtype."""

    file: Path
    shape: tuple[int, ...]
    dtype: str


class ProgressBar:
    """``Loading weights [#####.....] 52% 1.2/2.3 GB`` redrawn in place on ``stream``.

    Redraws at most every 0.1 s and once at 100 %; :meth:`close` ends the line.
    """

    def __init__(self, stream: TextIO, total: int, label: str = "Loading weights") -> None:
        self.stream, self.total, self.label = stream, max(total, 1), label
        self.done = 0
        self._drawn = -1.0

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes and redraw if due."""
        self.done = min(self.done + n, self.total)
        now = time.monotonic()
        if self.done == self.total or now - self._drawn >= 0.1:
            self._drawn = now
            frac = self.done / self.total
            bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
            self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} "
                              f"{self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class _Reader:
    """Open safetensors files, a name -> :class:`TensorInfo` index, and which names were used."""

    def __init__(self, folder: Path, stack: contextlib.ExitStack) -> None:
        self.folder = folder
        self.index: dict[str, TensorInfo] = {}
        self._handles: dict[Path, Any] = {}
        self.used: set[str] = set()
        self.progress: ProgressBar | None = None
        for path in weight_files(folder):
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                for name in handle.keys():
                    meta = handle.get_slice(name)
                    self.index[name] = TensorInfo(path, tuple(meta.get_shape()),
                                                  str(meta.get_dtype()))
            except Exception as exc:  # safetensors raises its own untyped SafetensorError
                raise ArtifactError(f"{path}: unreadable safetensors file: {exc}") from exc
            self._handles[path] = handle

    def has(self, name: str) -> bool:
        return name in self.index

    def take(self, name: str, shape: tuple[int, ...],
             index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name``, checked against ``shape``; only its part ``index`` is read when
        given (a shard)."""
        info = self.index.get(name)
        if info is None:
            files = ", ".join(sorted({i.file.name for i in self.index.values()})) or "no files"
            raise ArtifactError(f"{self.folder}: tensor {name!r} is missing (looked in {files})")
        if info.shape != shape:
            raise ArtifactError(f"{info.file}: tensor {name!r} has shape {list(info.shape)}, "
                                f"expected {list(shape)}")
        self.used.add(name)
        try:
            handle = self._handles[info.file]
            tensor: torch.Tensor = (handle.get_tensor(name) if index is None
                                    else handle.get_slice(name)[index])
        except Exception as exc:
            raise ArtifactError(f"{info.file}: cannot read tensor {name!r}: {exc}") from exc
        if self.progress is not None:
            self.progress.advance(self.nbytes(name))
        return tensor

    def check(self, names: list[str], stacks: dict[str, tuple[int, ...]],
              *matrices: tuple[int, ...]) -> None:
        """Mark ``names`` used without reading them, after checking each exists with its
        shape: a fused stack's from ``stacks``, a per-expert matrix's one of ``matrices``
        (gate and up, then down: ``names`` come in gate, up, down triples)."""
        for k, name in enumerate(names):
            info = self.index.get(name)
            if info is None:
                raise ArtifactError(f"{self.folder}: tensor {name!r} is missing")
            want = stacks.get(name, matrices[0] if k % 3 < 2 else matrices[1])
            if info.shape != want:
                raise ArtifactError(f"{info.file}: tensor {name!r} has shape "
                                    f"{list(info.shape)}, expected {list(want)}")
            self.used.add(name)

    def nbytes(self, name: str) -> int:
        """Stored size of tensor ``name`` in bytes."""
        info = self.index[name]
        count = 1
        for n in info.shape:
            count *= n
        return count * _DTYPE_BYTES.get(info.dtype, 4)

    def unused(self) -> list[str]:
        return sorted(n for n in self.index
                      if n not in self.used and not n.endswith(_IGNORED_SUFFIXES))


def load_checkpoint(folder: Path, *, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu",
                    progress: TextIO | bool | None = None,
                    mapped_experts: bool = False, shard: Shard | None = None) -> Checkpoint:
    """Spec, weights (cast to ``dtype``, default the config's, on ``device``) and snapshot.

    ``progress``: a stream to draw the loading bar on, ``False`` for none, ``None`` (default)
    for standard error when it is a terminal. ``mapped_experts``: the routed experts' stacks
    are ``meta`` placeholders and their tensors are only checked, not read (expert tiers read
    them per expert, :mod:`backends.torch.experts`; ``Checkpoint.experts`` names them).
    ``shard``: read only this rank's part of a tensor/expert-parallel model
    (:mod:`backends.torch.shard`; ``Checkpoint.spec`` stays the whole model's).
    """
    config = read_config(folder)
    spec = ModelSpec.from_hf_config(config)
    target = dtype or getattr(torch, spec.dtype)
    stream = _progress_stream(progress)
    with contextlib.ExitStack() as stack:
        reader = _Reader(folder, stack)
        if stream is not None:
            reader.progress = ProgressBar(stream, sum(reader.nbytes(n) for n in reader.index))
            stack.callback(reader.progress.close)
        if shard is not None:
            shard.check(spec)
        builder = _Builder(spec, reader, target, device, mapped_experts, shard)
        weights = builder.model()
        names = {i: builder.expert_names(i) for i in spec.moe_layers}
        if reader.progress is not None:  # tensors the model skips (a tied head) count as read
            reader.progress.advance(reader.progress.total)
        extra = reader.unused()
        if spec.tie_word_embeddings:
            extra = [n for n in extra if n != "lm_head.weight"]
        if extra:
            shown = ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")
            raise ArtifactError(f"{folder}: {len(extra)} tensor(s) the config does not account "
                                f"for: {shown}")
        index = [(n, list(i.shape), i.dtype) for n, i in reader.index.items()]
    return Checkpoint(spec, weights, checkpoint_snapshot(config, index), names)


def _progress_stream(progress: TextIO | bool | None) -> TextIO | None:
    if progress is None:
        return sys.stderr if sys.stderr.isatty() else None
    if isinstance(progress, bool):
        return sys.stderr if progress else None
    return progress


class _Builder:
    """Turns checkpoint tensors into :mod:`~backends.torch.weights` containers."""

    def __init__(self, spec: ModelSpec, reader: _Reader, dtype: torch.dtype,
                 device: torch.device | str, mapped_experts: bool = False,
                 shard: Shard | None = None) -> None:
        self.mapped_experts = mapped_experts
        self.shard = shard
        self.s = spec
        self.r = reader
        self.dtype = dtype
        self.device = device

    def get(self, name: str, *shape: int, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` of ``shape``, only ``rows`` (of its first dim) and ``cols`` (of its
        last) read when given."""
        index = None
        if rows is not None or cols is not None:
            whole = slice(None)
            picked = [slice(*rows) if rows is not None else whole]
            if len(shape) > 1:
                picked.append(slice(*cols) if cols is not None else whole)
            index = tuple(picked)
        return self.r.take(name, shape, index).to(device=self.device, dtype=self.dtype)

    def split(self, n: int) -> tuple[int, int] | None:
        """This rank's span of ``n`` (None: the whole, no shard)."""
        return self.shard.span(n) if self.shard is not None else None

    def first_rank(self) -> bool:
        """Whether this rank adds a row-parallel projection's bias (rank 0, or no shard)."""
        return self.shard is None or self.shard.rank == 0

    def maybe(self, present: bool, name: str, *shape: int) -> torch.Tensor | None:
        return self.get(name, *shape) if present else None

    def model(self) -> ModelWeights:
        s = self.s
        embed = self.get("model.embed_tokens.weight", s.vocab_size, s.hidden_size)
        layers = tuple(self.layer(i) for i in range(s.num_layers))
        norm = self.get("model.norm.weight", s.hidden_size)
        head = embed if s.tie_word_embeddings else self.get(
            "lm_head.weight", s.vocab_size, s.hidden_size)
        return ModelWeights(embed, layers, norm, head, self.conditioning())

    def conditioning(self) -> ConditioningWeights | None:
        """``model.time_mlp.{0,2}`` and ``model.self_condition`` where the spec has them."""
        c, h = self.s.conditioning, self.s.hidden_size
        if c is None:
            return None
        return ConditioningWeights(
            self.maybe(c.time, "model.time_mlp.0.weight", h, h),
            self.maybe(c.time, "model.time_mlp.0.bias", h),
            self.maybe(c.time, "model.time_mlp.2.weight", h, h),
            self.maybe(c.time, "model.time_mlp.2.bias", h),
            self.maybe(c.self_condition, "model.self_condition.weight", h, h))

    def layer(self, i: int) -> LayerWeights:
        p, h = f"model.layers.{i}", self.s.hidden_size
        mlp = self.moe(i) if i in self.s.moe_layers else self.mlp(
            f"{p}.mlp", self.s.intermediate_size, self.s.mlp_bias)
        return LayerWeights(self.get(f"{p}.input_layernorm.weight", h), self.attention(p),
                            self.get(f"{p}.post_attention_layernorm.weight", h), mlp)

    def attention(self, p: str) -> AttentionWeights:
        s, a = self.s, f"{p}.self_attn"
        h, dq, dkv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        qs, kvs = self.split(dq), self.split(dkv)  # this rank's heads' rows (whole heads)

        def bias(name: str, n: int, span: tuple[int, int] | None) -> torch.Tensor | None:
            return self.get(name, n, rows=span) if s.qkv_bias else None

        return AttentionWeights(
            q=self.get(f"{a}.q_proj.weight", dq, h, rows=qs),
            k=self.get(f"{a}.k_proj.weight", dkv, h, rows=kvs),
            v=self.get(f"{a}.v_proj.weight", dkv, h, rows=kvs),
            o=self.get(f"{a}.o_proj.weight", h, dq, cols=qs),
            q_bias=bias(f"{a}.q_proj.bias", dq, qs),
            k_bias=bias(f"{a}.k_proj.bias", dkv, kvs),
            v_bias=bias(f"{a}.v_proj.bias", dkv, kvs),
            o_bias=self.row_bias(s.o_bias, f"{a}.o_proj.bias", h),
            q_norm=self.maybe(s.qk_norm, f"{a}.q_norm.weight", s.head_dim),
            k_norm=self.maybe(s.qk_norm, f"{a}.k_norm.weight", s.head_dim))

    def mlp(self, p: str, inter: int, bias: bool) -> MlpWeights:
        h = self.s.hidden_size
        part = self.split(inter)  # this rank's rows of gate and of up, columns of down
        gate_up = torch.cat([self.get(f"{p}.gate_proj.weight", inter, h, rows=part),
                             self.get(f"{p}.up_proj.weight", inter, h, rows=part)])  # [2I, H]
        gate_up_bias = None
        if bias:
            gate_up_bias = torch.cat([self.get(f"{p}.gate_proj.bias", inter, rows=part),
                                      self.get(f"{p}.up_proj.bias", inter, rows=part)])
        return MlpWeights(gate_up, self.get(f"{p}.down_proj.weight", h, inter, cols=part),
                          gate_up_bias, self.row_bias(bias, f"{p}.down_proj.bias", h))

    def row_bias(self, present: bool, name: str, n: int) -> torch.Tensor | None:
        """A row-parallel projection's bias: read (marked used) by every rank, kept by the
        first (the ranks' partial sums are added up once)."""
        value = self.maybe(present, name, n)
        return value if self.first_rank() else None

    def expert_names(self, i: int) -> ExpertNames:
        """Where MoE layer ``i`` stores its routed experts."""
        layer = f"model.layers.{i}"
        mixtral = self.s.architecture == "MixtralForCausalLM"
        p = f"{layer}.mlp"
        if mixtral and self.r.has(f"{layer}.block_sparse_moe.gate.weight"):
            p = f"{layer}.block_sparse_moe"
        if self.r.has(f"{p}.experts.gate_up_proj"):
            return ExpertNames(p, fused=True)
        if mixtral:
            return ExpertNames(p, fused=False, gate="w1", up="w3", down="w2")
        return ExpertNames(p, fused=False)

    def moe(self, i: int) -> MoeWeights:
        moe, h = self.s.moe, self.s.hidden_size
        assert moe is not None  # moe_layers is non-empty only with a MoeSpec
        names = self.expert_names(i)
        p = names.prefix
        e, inter = moe.num_experts, moe.intermediate_size
        if self.mapped_experts:  # tiers: the matrices stay in the file until routed to
            self.r.check(names.all(e), {names.gate_up_stack: (e, 2 * inter, h),
                                        names.down_stack: (e, h, inter)}, (inter, h), (h, inter))
            gate_up = torch.empty(e, 2 * inter, h, dtype=self.dtype, device="meta")
            down = torch.empty(e, h, inter, dtype=self.dtype, device="meta")
        elif names.fused:
            mine = self.split(e)  # expert parallelism: this rank's experts, whole
            gate_up = self.get(names.gate_up_stack, e, 2 * inter, h, rows=mine)
            down = self.get(names.down_stack, e, h, inter, rows=mine)
        else:
            first, stop = self.split(e) or (0, e)
            for j in [*range(first), *range(stop, e)]:  # another rank's: checked, not read
                self.r.check(list(names.expert(j)), {}, (inter, h), (h, inter))
            gate_up = torch.stack([torch.cat([
                self.get(names.expert(j)[0], inter, h),
                self.get(names.expert(j)[1], inter, h)]) for j in range(first, stop)])
            down = torch.stack([self.get(names.expert(j)[2], h, inter)
                                for j in range(first, stop)])
        shared, shared_gate = None, None
        if moe.shared_intermediate_size:
            shared = self.mlp(f"{p}.shared_expert", moe.shared_intermediate_size, False)
            shared_gate = self.get(f"{p}.shared_expert_gate.weight", 1, h)
        return MoeWeights(self.get(f"{p}.gate.weight", e, h), gate_up, down, shared, shared_gate)
