"""A GGUF file's tensors as the torch backend's :class:`~backends.torch.weights.ModelWeights`.

Owns :func:`load_weights`: llama.cpp's tensor names (``token_embd``, ``blk.N.attn_q``, ...)
mapped onto the backend's layout, each tensor dequantized to the compute dtype one at a time
(so the file's mapped bytes and one dequantized tensor are all that is held besides the weights
built so far: never two full copies). With ``quantized=True`` the matrices of quantized types
stay in their GGML encoding (:class:`~backends.gguf.quants.QuantizedWeight`, a copy of the
file's bytes) and the weights hold ``meta`` placeholders of their shape; the returned
``products`` pair each placeholder with its matrix product and its encoded size for
:class:`~backends.torch.model.Transformer`: Q4_0 and Q4_1 matrices on a CPU are repacked for
torch's int4 kernel (:mod:`backends.gguf.int4`; bfloat16 activations, several times faster
than dequantizing), other types multiplied chunk by chunk
(:func:`~backends.gguf.quants.quantized_linear`). Embeddings, norms and float matrices are
dequantized either way. llama.cpp's converter permutes the rows of ``attn_q`` and
``attn_k`` of ``llama``-architecture models for its RoPE layout; they are permuted back here,
as transformers' GGUF loader does. Separate ``ffn_gate`` and ``ffn_up`` become the fused
``gate_up``; expert stacks ``ffn_{gate,up,down}_exps`` keep their ``[E, ...]`` layout.

Example::

    f = GGUFFile.open(path)
    spec = ModelSpec.from_hf_config(hf_config(f))
    weights = load_weights(f, spec, dtype=torch.float32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from backends.gguf.file import GGUFFile, GGUFTensor
from backends.gguf.quants import dequantize
from backends.torch.config import ModelSpec
from backends.torch.weights import (
    AttentionWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)
from pipeline.errors import ArtifactError

Product = tuple[torch.Tensor, Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor], int,
                bool]
"""A kept-quantized matrix: its placeholder, its product, the bytes it holds, and whether the
product computes each row on its own (:meth:`~backends.torch.packed.Linears.register`)."""
"""A placeholder, its matrix product, and the bytes of the encoded weight that product holds."""
_FLOAT_TYPES = ("F32", "F16", "BF16")


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
        self.products: list[Product] = []

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
        if len(types) != 1:  # mixed encodings: each part dequantized on its own
            value = torch.cat([dequantize_tensor(t, self.dtype) for t in tensors])
            return (_unpermute(value, heads) if heads else value).to(self.device)
        (qtype,) = types
        shape = (sum(rows), cols)
        keep = self.quantized and qtype.name not in _FLOAT_TYPES
        raw = _joined_rows([t.data for t in tensors], heads)
        if not keep:
            return dequantize(raw, qtype, shape, self.dtype).to(self.device)
        from backends.gguf.int4 import Int4Weight, int4_available, int4_fits, int4_linear
        from backends.gguf.quants import QuantizedWeight, quantized_linear

        coded = QuantizedWeight.from_raw(raw, qtype, shape)  # the file's pages are copied
        placeholder = torch.empty(shape, dtype=self.dtype, device="meta")
        if int4_fits(coded) and int4_available(self.device):
            packed = Int4Weight.from_quantized(coded)
            self.products.append((placeholder, lambda x, bias: int4_linear(x, packed, bias),
                                  packed.nbytes, True))
            return placeholder
        weight = QuantizedWeight(coded.data.to(self.device), qtype, shape)
        self.products.append((placeholder, lambda x, bias: quantized_linear(x, weight, bias),
                              weight.nbytes, False))
        return placeholder

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

    def maybe(self, name: str, *shape: int) -> torch.Tensor | None:
        return self.get(name, *shape) if name in self.f.tensors else None


def load_weights(f: GGUFFile, spec: ModelSpec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantized: bool = False) -> Loaded:
    """Every weight of ``spec`` from ``f``; a missing, misshapen or unused tensor is an
    :class:`ArtifactError` naming the file and the tensor."""
    load = _Loader(f, spec, dtype, device, quantized)
    embed = load.get("token_embd.weight", spec.vocab_size, spec.hidden_size)
    layers = tuple(_layer(load, i) for i in range(spec.num_layers))
    norm = load.get("output_norm.weight", spec.hidden_size)
    head = embed if spec.tie_word_embeddings else load.get(
        "output.weight", spec.vocab_size, spec.hidden_size)
    unused = sorted(set(f.tensors) - load.taken)
    if unused:
        raise ArtifactError(f"{f.path}: tensors the model does not use: {', '.join(unused[:5])}"
                            + (" ..." if len(unused) > 5 else ""))
    return Loaded(ModelWeights(embed, layers, norm, head), tuple(load.products))


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
    gate = load.get(p + "ffn_gate_exps.weight", e, inter, h)
    up = load.get(p + "ffn_up_exps.weight", e, inter, h)
    shared = shared_gate = None
    if moe.shared_intermediate_size:
        shared = _mlp(load, p, "_shexp", moe.shared_intermediate_size)
        shared_gate = load.get(p + "ffn_gate_inp_shexp.weight", h).reshape(1, h)
    return MoeWeights(load.get(p + "ffn_gate_inp.weight", e, h), torch.cat([gate, up], dim=1),
                      load.get(p + "ffn_down_exps.weight", e, h, inter), shared, shared_gate)
