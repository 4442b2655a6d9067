"""The decoder forward over a per-slot KV cache, for ragged batches of sequences.

One call runs B sequences at once, each ``(slot, start, tokens)``: its new tokens sit at
positions ``start .. start+len-1`` and attend to the slot's cached positions ``0 .. start-1``
and causally to each other. The same path serves a one-shot prefill (``start == 0``), a
chunk of a chunked prefill (``start > 0``), and a decode step (one token per slot). Tokens of
all sequences are concatenated (``[T, ...]``) for the projections and MLPs; attention runs per
sequence over views of that slot's cache, so nothing is padded and no cache is copied:

* a decode token folds its query heads onto their key/value head (``[Hkv, Hq/Hkv, D]``), one
  small attention with no mask and no repeated keys;
* a prompt from position 0 uses the causal kernel (``is_causal``, grouped-query heads);
* a later chunk, or a sliding window that cuts in, gets an explicit ``[Lq, Lk]`` mask.

The forward writes the new keys and values into the cache but does not change the slots'
lengths: :meth:`KVCache.commit` does, after the call succeeded, so a call that raises leaves
every slot's logical cache as it was.

Shapes: T tokens in the call, B sequences, H hidden, Hq/Hkv heads, D head_dim, V vocab.

Example::

    cache = KVCache.empty(spec, num_slots=4, max_len=512, dtype=torch.float32)
    batch = RaggedBatch.build([(0, 0, prompt_ids)], device=cache.device)
    logits = model.forward(cache, batch)      # [1, V] float32 at the prompt's last token
    cache.commit(batch)                       # cache.lengths[0] == len(prompt_ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs
import torch
import torch.nn.functional as F

from backends.torch.config import ModelSpec
from backends.torch.moe import RoutingSpec, moe_forward
from backends.torch.packed import LinearFn, Linears
from backends.torch.rope import apply_rope, rope_cos_sin, rope_frequencies
from backends.torch.weights import (
    AttentionWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)

class MoeFunction(Protocol):
    """:func:`~backends.torch.moe.moe_forward`'s signature and contract: the routed-experts
    output ``[T, H]``. A faster implementation of the same function may replace it."""

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                 routing: RoutingSpec) -> torch.Tensor: ...


class KVCache:
    """Keys and values per layer, ``k[l]``/``v[l]`` of shape ``[slots, Hkv, max_len, D]``.

    ``lengths[s]`` is how many positions of slot ``s`` are valid; every layer's keys and
    values cover exactly those positions (DESIGN §8, invariant 2). ``key_extent[l][s]`` and
    ``value_extent[l][s]`` are how far layer ``l`` has actually written keys and values of
    slot ``s``, committed with the lengths, so the invariant can be checked rather than
    assumed. Owned by one backend and mutated only by :meth:`write` (positions beyond the
    lengths), :meth:`commit`, :meth:`discard` and :meth:`reset`.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k = k
        self.v = v
        slots = k[0].shape[0]
        self.lengths = [0] * slots
        self.key_extent = [[0] * slots for _ in k]
        self.value_extent = [[0] * slots for _ in v]
        self._written: list[tuple[int, int, int]] = []   # (layer, slot, end) since the commit

    @classmethod
    def empty(cls, spec: ModelSpec, *, num_slots: int, max_len: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> KVCache:
        """A zeroed cache for ``num_slots`` sequences of up to ``max_len`` positions."""
        shape = (num_slots, spec.num_kv_heads, max_len, spec.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device)
                    for _ in range(spec.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device)
                    for _ in range(spec.num_layers)])

    @property
    def max_len(self) -> int:
        """Positions each slot can hold."""
        return int(self.k[0].shape[2])

    @property
    def device(self) -> torch.device:
        """Where the cache lives."""
        return self.k[0].device

    @property
    def nbytes(self) -> int:
        """Memory the keys and values of every layer and slot take."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v [n, Hkv, D]`` at positions ``start..start+n-1`` of ``slot``.

        Returns views ``[1, Hkv, start+n, D]`` of the slot's keys and values up to the last
        written position (no copy).
        """
        end = start + k.shape[0]
        self.k[layer][slot, :, start:end] = k.transpose(0, 1)
        self.v[layer][slot, :, start:end] = v.transpose(0, 1)
        self._written.append((layer, slot, end))
        return self.k[layer][slot:slot + 1, :, :end], self.v[layer][slot:slot + 1, :, :end]

    def commit(self, batch: RaggedBatch) -> None:
        """Extend each writing sequence's slot length by the tokens the batch wrote."""
        kept = {slot for slot, write in zip(batch.slots, batch.writes) if write}
        for slot, start, n in zip(batch.slots, batch.starts, batch.lengths):
            if slot in kept:
                self.lengths[slot] = start + n
        for layer, slot, end in self._written:
            if slot in kept:
                self.key_extent[layer][slot] = self.value_extent[layer][slot] = end
        self._written.clear()

    def discard(self) -> None:
        """Forget the writes of a call that failed (their positions stay beyond the lengths)."""
        self._written.clear()

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


@attrs.frozen(eq=False)
class RaggedBatch:
    """B sequences' new tokens, concatenated.

    ``token_ids``/``positions`` are ``[T]``; ``outputs`` (the rows of ``[T]`` whose logits are
    wanted, sequence by sequence) is ``[N]``; ``slots``, ``starts``, ``lengths`` and
    ``offsets`` (each sequence's first token in ``[T]``) are per-sequence Python ints, which
    the attention loop slices with; ``blocks[b]`` makes sequence b's new tokens attend to
    each other bidirectionally; ``writes[b]`` false leaves its slot's length unchanged at
    :meth:`KVCache.commit`. Build with :meth:`build`.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    outputs: torch.Tensor
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    blocks: tuple[bool, ...]
    writes: tuple[bool, ...]

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, Sequence[int]]], *,
              device: torch.device | str = "cpu",
              outputs: Sequence[Sequence[int]] | None = None,
              blocks: Sequence[bool] | None = None,
              writes: Sequence[bool] | None = None) -> RaggedBatch:
        """From ``(slot, start, token_ids)`` per sequence (each with at least one token).

        ``outputs[b]`` are the offsets into sequence b's tokens whose logits are wanted
        (default: its last token); ``blocks``/``writes`` default to causal and writing.
        """
        lengths = [len(ids) for _, _, ids in seqs]
        if not seqs or min(lengths) < 1:
            raise ValueError("every sequence of a batch needs at least one token")
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        positions = [p for (_, start, _), n in zip(seqs, lengths) for p in range(start, start + n)]
        ids = [t for _, _, seq in seqs for t in seq]
        wanted = ([[n - 1] for n in lengths] if outputs is None else outputs)
        rows = [o + i for o, want in zip(offsets, wanted) for i in want]
        b = len(seqs)
        return cls(token_ids=torch.tensor(ids, dtype=torch.int64, device=device),
                   positions=torch.tensor(positions, dtype=torch.int64, device=device),
                   outputs=torch.tensor(rows, dtype=torch.int64, device=device),
                   slots=tuple(s for s, _, _ in seqs), starts=tuple(s for _, s, _ in seqs),
                   lengths=tuple(lengths), offsets=tuple(offsets),
                   blocks=tuple(blocks) if blocks is not None else (False,) * b,
                   writes=tuple(writes) if writes is not None else (True,) * b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def mlp_forward(w: MlpWeights, x: torch.Tensor, linear: Linears | None = None) -> torch.Tensor:
    """SwiGLU ``[T, H] -> [T, H]`` (``linear``: packed weights, default plain ``F.linear``)."""
    lin = linear or Linears.plain()
    gate_up = lin(x, w.gate_up, w.gate_up_bias)                               # [T, 2I]
    half = gate_up.shape[-1] // 2
    return lin(F.silu(gate_up[:, :half]) * gate_up[:, half:], w.down, w.down_bias)


class Transformer:
    """A decoder-only model: ``spec`` plus its weights; :meth:`forward` is the whole model.

    ``moe`` computes the routed experts of MoE layers (default: the plain-torch
    :func:`~backends.torch.moe.moe_forward`); any function with its signature and semantics
    may replace it, and nothing else of the model changes. With ``pack`` (the default),
    float32 CPU weights get oneDNN-packed copies (:mod:`backends.torch.packed`), the routed
    experts' too when ``moe`` is the default; ``pack=False`` multiplies with ``F.linear``.
    ``own_products`` pairs weights (placeholders in ``weights``) with the function that
    multiplies by them, e.g. a GGUF weight kept quantized in memory, and the bytes that
    function holds.
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, *,
                 moe: MoeFunction = moe_forward, pack: bool = True,
                 own_products: Sequence[tuple[torch.Tensor, LinearFn, int]] = ()) -> None:
        self.spec = spec
        self.weights = weights
        default_moe = moe is moe_forward
        self.linears = (Linears.pack(weights, experts=default_moe) if pack
                        else Linears.plain())
        for placeholder, multiply, nbytes in own_products:
            self.linears.register(placeholder, multiply, nbytes)
        self.moe = self._packed_moe if default_moe and len(self.linears) else moe
        inv_freq, self.rope_scale = rope_frequencies(spec.rope, spec.head_dim)
        self.inv_freq = inv_freq.to(weights.embed.device)                     # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and activations') dtype."""
        return self.weights.embed.dtype

    def forward(self, cache: KVCache, batch: RaggedBatch) -> torch.Tensor:
        """Logits ``[N, V]`` float32 at the batch's wanted ``outputs``; writes K/V to ``cache``."""
        h = F.embedding(batch.token_ids, self.weights.embed)                    # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, batch.positions, h.dtype)
        for i, layer in enumerate(self.weights.layers):
            h = self._layer(i, layer, h, cos, sin, cache, batch)
        h = rms_norm(h[batch.outputs], self.weights.norm, self.spec.rms_norm_eps)  # [N, H]
        return self.linears(h, self.weights.lm_head).float()                   # [N, V]

    def _layer(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: KVCache, batch: RaggedBatch) -> torch.Tensor:
        eps = self.spec.rms_norm_eps
        x = rms_norm(h, layer.input_norm, eps)
        h = h + self._attention(i, layer.attention, x, cos, sin, cache, batch)
        x = rms_norm(h, layer.post_norm, eps)
        if isinstance(layer.mlp, MoeWeights):
            return h + self._moe(layer.mlp, x)
        return h + mlp_forward(layer.mlp, x, self.linears)

    def _attention(self, i: int, w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache, batch: RaggedBatch) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        lin = self.linears
        q = lin(x, w.q, w.q_bias).view(t, s.num_heads, s.head_dim)             # [T, Hq, D]
        k = lin(x, w.k, w.k_bias).view(t, s.num_kv_heads, s.head_dim)          # [T, Hkv, D]
        v = lin(x, w.v, w.v_bias).view(t, s.num_kv_heads, s.head_dim)          # [T, Hkv, D]
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, s.rms_norm_eps), rms_norm(k, w.k_norm, s.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = s.sliding_windows[i]
        outs = []
        for slot, start, n, at, block in zip(batch.slots, batch.starts, batch.lengths,
                                             batch.offsets, batch.blocks):
            keys, values = cache.write(i, slot, start, k[at:at + n], v[at:at + n])
            outs.append(attend(q[at:at + n], keys, values, start, window, block))  # [n, Hq, D]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)                    # [T, Hq, D]
        return lin(out.reshape(t, -1), w.o, w.o_bias)                          # [T, H]

    def _moe(self, w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
        moe = self.spec.moe
        assert moe is not None  # a MoeWeights layer exists only when the spec has moe
        out = self.moe(x, self.linears(x, w.router), w.gate_up, w.down, top_k=moe.top_k,
                       routing=moe.routing)                                    # [T, H]
        if w.shared is not None and w.shared_gate is not None:
            gate = torch.sigmoid(self.linears(x, w.shared_gate))               # [T, 1]
            out = out + gate * mlp_forward(w.shared, x, self.linears)
        return out

    def _packed_moe(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                    routing: RoutingSpec) -> torch.Tensor:
        """:func:`moe_forward` with this model's packed expert weights."""
        return moe_forward(hidden, router_logits, w_gate_up, w_down, top_k=top_k,
                           routing=routing, linear=self.linears.expert)


EXACT_QUERIES = 16
"""A causal call of at most this many tokens after a cached prefix (verifying drafts) runs
each query as a one-token decode would, so each position's logits are bit for bit those of
decoding one token at a time: the masked multi-query kernel sums in another order, and in
bfloat16 that can move a logit by one unit in the last place and flip a near-tie argmax
(greedy speculative decoding must equal plain decoding)."""


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
           window: int | None, block: bool = False) -> torch.Tensor:
    """One sequence's attention: queries ``q [n, Hq, D]`` at positions ``start..start+n-1``
    over ``keys``/``values [1, Hkv, start+n, D]``; returns ``[n, Hq, D]``.

    GQA: query head h reads kv head ``h // (Hq/Hkv)``. A query at position p sees keys at
    positions ``p - window < k <= p`` (no lower bound without a ``window``). With ``block``
    every query also sees the keys of all ``n`` new positions (bidirectional in the block).
    A short causal call after a prefix runs query by query (:data:`EXACT_QUERIES`).
    """
    n, hq, d = q.shape
    if 1 < n <= EXACT_QUERIES and start > 0 and not block:
        return torch.cat([attend(q[i:i + 1], keys[:, :, :start + i + 1],
                                 values[:, :, :start + i + 1], start + i, window)
                          for i in range(n)])                                   # [n, Hq, D]
    hkv, lk = keys.shape[1], keys.shape[2]
    windowed = window is not None and lk > window
    if n == 1 and not windowed:  # one query: causal and block attention coincide
        # One query: fold the heads that share a kv head onto it, [1, Hkv, Hq/Hkv, D].
        out = F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), keys, values)
        return out.view(1, hq, d)
    qh = q.transpose(0, 1)[None]                                               # [1, Hq, n, D]
    if start == 0 and not windowed and not block:
        out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, enable_gqa=True)
    elif block and not windowed:  # everything written so far: no mask at all
        out = F.scaled_dot_product_attention(qh, keys, values, enable_gqa=True)
    else:
        q_pos = torch.arange(start, start + n, device=q.device)[:, None]       # [n, 1]
        k_pos = torch.arange(lk, device=q.device)[None, :]                     # [1, Lk]
        mask = k_pos <= (torch.full_like(q_pos, start + n - 1) if block else q_pos)  # [n, Lk]
        if window is not None:
            mask &= k_pos > q_pos - window
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)                                              # [n, Hq, D]
