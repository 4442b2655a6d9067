"""A GGUF file's tensors as the torch backend's :class:`~backends.torch.weights.ModelWeights`.

Owns :func:`load_weights`: llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q``, ...)
mapped onto the backend's layout, each tensor dequantized to the compute dtype one at a time
(so the file's mapped bytes and one dequantized tensor are all that is held besides the weights
built so far: never two full copies). With ``quantized=True`` (the default on a CPU) the
matrices of quantized types stay in their GGML encoding and the weights hold ``meta``
placeholders of their shape; the returned ``products`` pair each placeholder with its matrix
product, its encoded size and a decoder of the whole matrix for
:class:`~backends.torch.model.Transformer`: on a CPU, Q4_0, Q4_1, Q4_K, Q5_K and Q8_0
matrices are repacked for torch's int4 kernel (:mod:`backends.gguf.int4`; bfloat16
activations, several times faster than dequantizing), Q6_K ones become a oneDNN-packed
bfloat16 copy (:meth:`_Loader._kept`), and elsewhere every type is multiplied chunk by chunk
(:func:`~backends.gguf.quants.quantized_linear`); the decoder reads the file's mapped bytes
again for the rows of prompt chunks (:class:`~backends.torch.packed.PromptRows`), split by
rows over torch's threads (:func:`decode_rows`). A quantized token table and output head
become float16 (:data:`TABLE_DTYPE`), the head with a oneDNN-packed copy; a packed product
that computes each row on its own (:func:`rows_alone`, checked at load) runs untiled in the
batch-invariant mode. Norms and float matrices are dequantized either way. llama.cpp's
converter permutes the rows of ``attn_q`` and ``attn_k`` of ``llama``-architecture models
for its RoPE layout; they are permuted back here, as transformers' GGUF loader does. Separate ``ffn_gate`` and ``ffn_up`` become the fused
``gate_up``; expert stacks ``ffn_{gate,up,down}_exps`` keep their ``[E, ...]`` layout, or,
under an expert cap (``mapped_experts``), stay in the file and :class:`GGUFExperts` reads one
expert at a time for :class:`~backends.torch.experts.ExpertCache`.

Example::

    f = GGUFFile.open(path)
    spec = ModelSpec.from_hf_config(hf_config(f))
    weights = load_weights(f, spec, dtype=torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType as QT

from backends.gguf.quants import NUMPY_DECODED, dequantize, dequantize_into
from backends.torch.config import ModelSpec
from backends.torch.model import OwnProduct
from backends.torch.packed import LinearFn
from backends.torch.weights import (
    AttentionWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)
from pipeline.errors import ArtifactError
from pipeline.gguf_file import GGUFFile, GGUFTensor

Product = OwnProduct
"""A kept-quantized matrix: its placeholder, its product, the bytes it holds, whether the
product computes each row on its own, and the weight decoded whole from the file for prompt
rows (:meth:`~backends.torch.packed.Linears.register`)."""
_FLOAT_TYPES = ("F32", "F16", "BF16")
TABLE_DTYPE = torch.float16
"""Quantized mode's dtype for a quantized token table and output head. The head is the
largest product of a small model's step (49,152 x 576 for SmolLM2): with 8 rows a float16
product takes 7.2 ms on one thread of this project's 2-core test machine where float32 takes
20 ms (docs/performance.md). bfloat16 is faster still (4.0 ms) but its products come out in
bfloat16, which puts logits near 32 on a grid of 0.25 and turns near-ties into exact ones;
float16 results are on a grid of 0.03 there, within the error that quantizing the table
already made. Q8_0 codes times their float16 scale round to float16's 11 bits."""
HEAD_ROWS = 8
"""The row count the packed head's layout is chosen for (a decode step's tile)."""
TABLE_SLICE = 4096
"""Rows decoded at a time into a float16 table (bounds the float32 scratch)."""


DENSE_DTYPE = torch.bfloat16
"""The dtype prompt rows multiply a kept-quantized matrix in, decoded whole (the int4
kernel's activations are bfloat16 too)."""


def bfloat16_fast(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: any GPU, or a CPU whose oneDNN has
    bfloat16 instructions (AVX512-BF16 or AMX)."""
    return _native(device, "_is_mkldnn_bf16_supported")


def float16_fast(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies float16 natively: any GPU, or a CPU whose oneDNN has
    float16 instructions (AVX512-FP16 or AMX-FP16)."""
    return _native(device, "_is_mkldnn_fp16_supported")


def _native(device: torch.device | str, check_name: str) -> bool:
    if torch.device(device).type != "cpu":
        return True
    check = getattr(torch.ops.mkldnn, check_name, None)
    return bool(check()) if check is not None else False


@attrs.frozen(eq=False)
class Loaded:
    """The weights, and (quantized mode) each placeholder's own matrix product."""

    weights: ModelWeights
    products: tuple[Product, ...] = ()


def dequantize_tensor(tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    """A reader tensor's values in torch order (``[out, in]``, experts ``[E, out, in]``)."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return dequantize(tensor.data, tensor.tensor_type, shape, dtype)


class _Loader:
    """Takes tensors by name, dequantized and shape-checked; remembers what was taken."""

    def __init__(self, f: GGUFFile, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device | str, quantized: bool = False) -> None:
        self.f, self.spec, self.dtype, self.device = f, spec, dtype, device
        self.quantized = quantized
        self.taken: set[str] = set()
        self.mapped_experts = False
        self.products: list[Product] = []
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def matrices(self, names: list[str], rows: list[int], cols: int,
                 heads: int | None = None) -> torch.Tensor:
        """The row-wise concatenation of 2-D weights ``names`` (``rows[i]`` each), rows
        un-permuted per ``heads`` (llama q/k). Quantized mode keeps quantized ones encoded
        and returns a placeholder.

        Parts of one type are joined and un-permuted as rows of the file's bytes, then
        dequantized once: a row's values depend on its own bytes alone, so this equals
        dequantizing, joining and un-permuting the values, without the float copies."""
        tensors = [self.tensor(n, r, cols) for n, r in zip(names, rows)]
        types = {t.tensor_type for t in tensors}
        keep = self.quantized and any(t.name not in _FLOAT_TYPES for t in types)
        if not keep:
            if len(types) == 1:
                return dequantize(_joined_rows([t.data for t in tensors], heads), types.pop(),
                                  (sum(rows), cols), self.dtype).to(self.device)
            # mixed encodings: each part dequantized on its own
            value = torch.cat([dequantize_tensor(t, self.dtype) for t in tensors])
            return (_unpermute(value, heads) if heads else value).to(self.device)
        shape = (sum(rows), cols)
        placeholder = torch.empty(shape, dtype=self.dtype, device="meta")
        if len(types) == 1:  # one product over the joined rows
            parts = [self._kept(_joined_rows([t.data for t in tensors], heads), types.pop(),
                                shape)]
        else:
            parts = [self._kept(_joined_rows([t.data], heads), t.tensor_type,
                                (int(t.shape[-1]), cols)) for t in tensors]
        dense = self._dense(tensors, shape, heads)
        if len(parts) == 1:
            multiply, nbytes, row_wise = parts[0]
        else:  # gate and up of different types: each multiplied on its own, outputs joined
            products = [p[0] for p in parts]

            def multiply(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                out = torch.cat([f(x, None) for f in products], dim=-1)
                return out + bias if bias is not None else out
            nbytes, row_wise = sum(p[1] for p in parts), all(p[2] for p in parts)
        self.products.append((placeholder, multiply, nbytes, row_wise, dense))
        return placeholder

    def _kept(self, raw: npt.NDArray[Any], qtype: Any,
              shape: tuple[int, int]) -> tuple[LinearFn, int, bool]:
        """One matrix kept in memory for decode steps: its product, the bytes it holds and
        whether the product computes each row on its own. On a CPU a type that maps onto
        torch's int4 kernel is repacked for it (:mod:`backends.gguf.int4`); another (Q6_K,
        whose 16-element groups do not map) becomes a bfloat16 copy in oneDNN's packed layout
        where this CPU multiplies bfloat16 natively (``docs/performance.md``); elsewhere the
        GGML bytes are kept and multiplied chunk by chunk (:func:`quantized_linear`)."""
        from backends.gguf.int4 import Int4Weight, int4_available, int4_fits, int4_linear
        from backends.gguf.quants import QuantizedWeight, quantized_linear

        coded = QuantizedWeight.from_raw(raw, qtype, shape)   # the file's pages are copied
        if int4_fits(coded) and int4_available(self.device):
            packed = Int4Weight.from_quantized(coded)
            return lambda x, bias: int4_linear(x, packed, bias), packed.nbytes, True
        if torch.device(self.device).type == "cpu" and bfloat16_fast(self.device):
            whole = torch.empty(shape, dtype=DENSE_DTYPE)  # decoded a slice at a time: no
            for start in range(0, shape[0], TABLE_SLICE):  # float32 copy of the whole
                part = coded.data[start:start + TABLE_SLICE]
                whole[start:start + len(part)] = QuantizedWeight(
                    part, coded.qtype, (len(part), shape[1])).dequantize()
            product = packed_product(whole, 1)
            if product is not None:
                return product
        weight = QuantizedWeight(coded.data.to(self.device), coded.qtype, coded.shape)
        return lambda x, bias: quantized_linear(x, weight, bias), weight.nbytes, False

    def _dense(self, tensors: list[GGUFTensor], shape: tuple[int, int],
               heads: int | None) -> Callable[[], torch.Tensor] | None:
        """The matrix decoded whole from the file's mapped bytes (joined and un-permuted as
        at load) in :data:`DENSE_DTYPE`, for prompt rows; None where this CPU has no fast
        bfloat16 products. Holds no copy: the file's pages are read again at each call (a
        forward with prompt rows), about 2 ms a million weights on one core, into a float32
        and a bfloat16 buffer that every matrix of the same shape shares (used one matrix at
        a time, by the one engine thread), so no call faults in fresh pages. Each part (gate
        and up may differ in type) is decoded into its rows of the buffer: a quantized type
        by its numpy decoder (:func:`decode_rows`), a float one (beside a quantized one) by
        torch's."""
        if torch.device(self.device).type != "cpu" or not bfloat16_fast(self.device):
            return None
        if shape not in self._buffers:
            self._buffers[shape] = (torch.empty(shape, dtype=torch.float32),
                                    torch.empty(shape, dtype=DENSE_DTYPE))
        scratch, dense = self._buffers[shape]
        parts, at = [], 0
        for t in tensors:  # (rows of the buffer, the part's view of the file, its type)
            n = int(t.shape[-1])
            parts.append((scratch[at:at + n], t.data, QT(t.tensor_type)))
            at += n

        def decode() -> torch.Tensor:
            for out, view, qtype in parts:
                raw = _joined_rows([view], heads)
                if qtype in NUMPY_DECODED:
                    decode_rows(raw, qtype, out)
                else:
                    out.copy_(dequantize(raw, qtype, tuple(out.shape)))
            return dense.copy_(scratch)
        return decode

    def tensor(self, name: str, *shape: int) -> GGUFTensor:
        """The file's tensor ``name``, checked to have torch-order ``shape``; marked taken."""
        tensor = self.f.tensors.get(name)
        if tensor is None:
            raise ArtifactError(f"{self.f.path}: tensor {name!r} is missing")
        found = tuple(int(d) for d in reversed(tensor.shape))
        if found != shape:
            raise ArtifactError(f"{self.f.path}: tensor {name!r} has shape {found}, expected "
                                f"{shape}")
        self.taken.add(name)
        return tensor

    def get(self, name: str, *shape: int) -> torch.Tensor:
        tensor = self.f.tensors.get(name)
        if tensor is None:
            raise ArtifactError(f"{self.f.path}: tensor {name!r} is missing")
        value = dequantize_tensor(tensor, self.dtype)
        if tuple(value.shape) != shape:
            # 1-D norms may be stored as [1, H] by some writers
            if value.numel() == torch.Size(shape).numel() and len(shape) == 1:
                value = value.reshape(shape)
            else:
                raise ArtifactError(f"{self.f.path}: tensor {name!r} has shape "
                                    f"{tuple(value.shape)}, expected {shape}")
        self.taken.add(name)
        return value.to(self.device)

    def table(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """The token table or output head ``name`` ``[rows, cols]``. In quantized mode a
        quantized one becomes float16 (:data:`TABLE_DTYPE`) where this CPU multiplies
        float16 natively, decoded a slice of rows at a time (never a float32 copy of the
        whole); otherwise as :meth:`get`."""
        t = self.f.tensors.get(name)
        if (t is None or not self.quantized or t.tensor_type.name in _FLOAT_TYPES
                or self.dtype != torch.float32 or not float16_fast(self.device)):
            return self.get(name, rows, cols)
        t = self.tensor(name, rows, cols)
        raw = _joined_rows([t.data], None)                                 # [rows, row_bytes]
        out = torch.empty((rows, cols), dtype=TABLE_DTYPE)
        for start in range(0, rows, TABLE_SLICE):
            part = raw[start:start + TABLE_SLICE]
            out[start:start + len(part)] = dequantize(part, t.tensor_type, (len(part), cols))
        return out.to(self.device)

    def maybe(self, name: str, *shape: int) -> torch.Tensor | None:
        return self.get(name, *shape) if name in self.f.tensors else None

    def pack_head(self, head: torch.Tensor) -> None:
        """Give a float16 output head (:meth:`table`) a oneDNN-packed copy and multiply by it:
        one row of SmolLM2's head takes half the time of the plain float16 product, eight
        rows two thirds (``docs/performance.md``); the plain table stays for the token
        embeddings. Nothing where this torch cannot pack float16."""
        if head.dtype != TABLE_DTYPE or head.device.type != "cpu":
            return
        product = packed_product(head, HEAD_ROWS)
        if product is not None:
            multiply, nbytes, row_wise = product
            self.products.append((head, multiply, nbytes, row_wise, None))


PROBE_ROWS = (1, 2, 3, 8, 9, 17, 64)
"""The row counts :func:`rows_alone` tries: both sides of the boundaries where oneDNN picks
another blocking (a packed product is called on at most the last, :data:`ROW_BOUND`)."""
ROW_BOUND = PROBE_ROWS[-1]
_ROWS_ALONE: dict[tuple[torch.dtype, int, int, int], bool] = {}


SPLIT_ROWS = 256
"""Fewest rows a part of a whole-matrix decode :func:`decode_rows` hands to another thread."""
_DECODERS: list[ThreadPoolExecutor] = []


def decode_rows(raw: npt.NDArray[Any], qtype: QT, out: torch.Tensor) -> None:
    """:func:`~backends.gguf.quants.dequantize_into` split by rows over torch's thread
    count (numpy releases the interpreter's lock while it decodes), on a pool of threads kept
    for the process: a prompt forward decodes every matrix of the model, a fixed cost that
    one core paid alone (about 0.2 s for the default model). On a machine whose other cores
    are busy the backend lowers torch's count, and this follows."""
    parts = min(torch.get_num_threads(), len(raw) // SPLIT_ROWS)
    if parts <= 1:
        dequantize_into(raw, qtype, out)
        return
    if not _DECODERS:
        _DECODERS.append(ThreadPoolExecutor(thread_name_prefix="pipeline-gguf-decode"))
    step = -(-len(raw) // parts)
    jobs = [_DECODERS[0].submit(dequantize_into, raw[a:a + step], qtype, out[a:a + step])
            for a in range(step, len(raw), step)]
    dequantize_into(raw[:step], qtype, out[:step])
    for job in jobs:
        job.result()


def packed_product(weight: torch.Tensor, rows: int) -> tuple[LinearFn, int, bool] | None:
    """``x @ weight.T`` on a oneDNN-packed copy of ``weight`` (float16 or bfloat16, its
    layout chosen for ``rows`` rows), computed in ``weight``'s dtype and returned in ``x``'s,
    at most :data:`ROW_BOUND` rows a call: the product, the bytes the copy holds, and whether
    it computes each row on its own (:func:`rows_alone` on this machine; then a
    batch-invariant model runs it untiled, so a lone decode row costs one row, not a tile of
    eight). None where this torch cannot pack."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    except (AttributeError, RuntimeError):
        return None
    dtype = weight.dtype

    def call(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return out

    def product(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        out = (call(flat) if flat.shape[0] <= ROW_BOUND else
               torch.cat([call(part) for part in torch.split(flat, ROW_BOUND)]))
        out = out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
        return out + bias if bias is not None else out
    key = (dtype, *weight.shape, rows)
    if key not in _ROWS_ALONE:
        _ROWS_ALONE[key] = rows_alone(call, weight.shape[1], dtype)
    return product, packed.numel() * packed.element_size(), _ROWS_ALONE[key]


def rows_alone(call: Callable[[torch.Tensor], torch.Tensor], cols: int,
               dtype: torch.dtype) -> bool:
    """Whether ``call`` (a product ``[M, cols] -> [M, out]``) gives every row the same bits in
    calls of each of :data:`PROBE_ROWS` rows as in one of :data:`ROW_BOUND` rows, on the
    process's thread count and on one thread, for random rows: what the oneDNN build and
    this processor do, checked where the model loads rather than assumed (a product that
    fails is tiled as before). About a dozen products' time, once per shape."""
    x = torch.randn(ROW_BOUND, cols, generator=torch.Generator().manual_seed(0)).to(dtype)
    reference = call(x)
    counts = [torch.get_num_threads()] + ([1] if torch.get_num_threads() > 1 else [])
    before = torch.get_num_threads()
    try:
        for threads in counts:
            torch.set_num_threads(threads)
            if not all(torch.equal(call(x[:m]), reference[:m]) for m in PROBE_ROWS):
                return False
            if not torch.equal(call(x[ROW_BOUND - 1:]), reference[ROW_BOUND - 1:]):
                return False
    finally:
        torch.set_num_threads(before)
    return True


def load_weights(f: GGUFFile, spec: ModelSpec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantized: bool = False,
                 mapped_experts: bool = False) -> Loaded:
    """Every weight of ``spec`` from ``f``; a missing, misshapen or unused tensor is an
    :class:`ArtifactError` naming the file and the tensor. ``mapped_experts``: the routed
    experts' stacks are ``meta`` placeholders and their tensors only checked (expert tiers
    read them per expert: :class:`GGUFExperts`)."""
    load = _Loader(f, spec, dtype, device, quantized)
    load.mapped_experts = mapped_experts
    embed = load.table("token_embd.weight", spec.vocab_size, spec.hidden_size)
    layers = tuple(_layer(load, i) for i in range(spec.num_layers))
    norm = load.get("output_norm.weight", spec.hidden_size)
    head = embed if spec.tie_word_embeddings else load.table(
        "output.weight", spec.vocab_size, spec.hidden_size)
    load.pack_head(head)
    factors = (dequantize_tensor(load.tensor("rope_freqs.weight", spec.head_dim // 2),
                                 torch.float32)  # frequencies stay float32 in any dtype
               if "rope_freqs.weight" in f.tensors else None)
    unused = sorted(set(f.tensors) - load.taken)
    if unused:
        raise ArtifactError(
            f"{f.path}: a {f.get('general.architecture', '?')} file with tensors this library "
            f"does not know how to use: {', '.join(unused[:5])}"
            + (" ..." if len(unused) > 5 else "") + "; such a file is not supported")
    return Loaded(ModelWeights(embed, layers, norm, head, rope_factors=factors),
                  tuple(load.products))


def _layer(load: _Loader, i: int) -> LayerWeights:
    spec, p = load.spec, f"blk.{i}."
    mlp: MlpWeights | MoeWeights
    if i in spec.moe_layers:
        mlp = _moe(load, p)
    else:
        mlp = _mlp(load, p, "", spec.intermediate_size)
    return LayerWeights(load.get(p + "attn_norm.weight", spec.hidden_size), _attention(load, p),
                        load.get(p + "ffn_norm.weight", spec.hidden_size), mlp)


def _attention(load: _Loader, p: str) -> AttentionWeights:
    s = load.spec
    q_rows, kv_rows, h = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size
    llama = s.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")
    q = load.matrices([p + "attn_q.weight"], [q_rows], h, s.num_heads if llama else None)
    k = load.matrices([p + "attn_k.weight"], [kv_rows], h, s.num_kv_heads if llama else None)
    return AttentionWeights(
        q, k, load.matrices([p + "attn_v.weight"], [kv_rows], h),
        load.matrices([p + "attn_output.weight"], [h], q_rows),
        q_bias=load.maybe(p + "attn_q.bias", q_rows), k_bias=load.maybe(p + "attn_k.bias", kv_rows),
        v_bias=load.maybe(p + "attn_v.bias", kv_rows),
        o_bias=load.maybe(p + "attn_output.bias", s.hidden_size),
        q_norm=load.maybe(p + "attn_q_norm.weight", s.head_dim),
        k_norm=load.maybe(p + "attn_k_norm.weight", s.head_dim))


def _joined_rows(parts: list[npt.NDArray[Any]], heads: int | None) -> npt.NDArray[Any]:
    """The rows of ``parts`` (the file's views, ``[rows, ...]``) one after another, un-permuted
    per ``heads`` as :func:`_unpermute` does; may be the file's own read-only view."""
    rows = [p.reshape(p.shape[0], -1) for p in parts]
    joined = rows[0] if len(rows) == 1 else np.concatenate(rows)
    if not heads:
        return joined
    half = joined.shape[0] // heads // 2
    return joined.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(joined.shape)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows: per head, rows ``[2, D/2]`` → ``[D/2, 2]``."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _mlp(load: _Loader, p: str, suffix: str, inter: int) -> MlpWeights:
    h = load.spec.hidden_size
    gate_up = load.matrices([f"{p}ffn_gate{suffix}.weight", f"{p}ffn_up{suffix}.weight"],
                            [inter, inter], h)
    return MlpWeights(gate_up, load.matrices([f"{p}ffn_down{suffix}.weight"], [h], inter))


def _moe(load: _Loader, p: str) -> MoeWeights:
    s, moe = load.spec, load.spec.moe
    assert moe is not None
    e, h, inter = moe.num_experts, s.hidden_size, moe.intermediate_size
    if load.mapped_experts:  # tiers: read per expert when routed to
        load.tensor(p + "ffn_gate_exps.weight", e, inter, h)
        load.tensor(p + "ffn_up_exps.weight", e, inter, h)
        load.tensor(p + "ffn_down_exps.weight", e, h, inter)
        gate_up = torch.empty(e, 2 * inter, h, dtype=load.dtype, device="meta")
        down = torch.empty(e, h, inter, dtype=load.dtype, device="meta")
    else:
        gate_up = torch.cat([load.get(p + "ffn_gate_exps.weight", e, inter, h),
                             load.get(p + "ffn_up_exps.weight", e, inter, h)], dim=1)
        down = load.get(p + "ffn_down_exps.weight", e, h, inter)
    shared = shared_gate = None
    if moe.shared_intermediate_size:
        shared = _mlp(load, p, "_shexp", moe.shared_intermediate_size)
        shared_gate = load.get(p + "ffn_gate_inp_shexp.weight", h).reshape(1, h)
    return MoeWeights(load.get(p + "ffn_gate_inp.weight", e, h), gate_up, down, shared,
                      shared_gate)


class GGUFExperts:
    """The routed experts of a GGUF file, each read from the mapped ``ffn_*_exps`` stacks and
    dequantized alone (an expert's rows are whole blocks of the stack's bytes), to the values
    the full load gives (:class:`~backends.torch.experts.ExpertSource`)."""

    def __init__(self, f: GGUFFile, spec: ModelSpec) -> None:
        from backends.gguf.quants import SUPPORTED_TYPES

        self.f, self.spec = f, spec
        for layer in spec.moe_layers:  # a type it cannot decode fails the load, not a request
            for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                t = f.tensors[f"blk.{layer}.{name}.weight"]
                if t.tensor_type not in SUPPORTED_TYPES:
                    raise ArtifactError(f"{f.path}: tensor {t.name!r} is {t.tensor_type.name}, "
                                        "which this library does not decode (supported: "
                                        f"{', '.join(q.name for q in SUPPORTED_TYPES)})")

    def read(self, layer: int, expert: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.spec.moe
        assert moe is not None
        h, inter = self.spec.hidden_size, moe.intermediate_size
        p = f"blk.{layer}."

        def one(name: str, rows: int, cols: int) -> torch.Tensor:
            t = self.f.tensors[p + name]
            value = dequantize(t.data[expert], t.tensor_type, (rows, cols), dtype)
            # a float type read as itself may share the file's pages: resident means a copy
            return value.clone() if t.tensor_type.name in _FLOAT_TYPES else value

        gate_up = torch.cat([one("ffn_gate_exps.weight", inter, h),
                             one("ffn_up_exps.weight", inter, h)])
        return gate_up, one("ffn_down_exps.weight", h, inter)
