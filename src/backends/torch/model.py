"""The decoder forward over a per-slot KV cache, for ragged batches of sequences.

One call runs B sequences at once, each ``(slot, start, tokens)``: its new tokens sit at
positions ``start .. start+len-1`` and attend to the slot's cached positions ``0 .. start-1``
and causally to each other. The same path serves a one-shot prefill (``start == 0``), a
chunk of a chunked prefill (``start > 0``), and a decode step (one token per slot). Tokens of
all sequences are concatenated (``[T, ...]``) for the projections and MLPs; attention pads the
queries to ``[B, Lq]`` and the cached keys to ``[B, Lk]`` and masks per sequence.

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
from backends.torch.rope import apply_rope, rope_cos_sin, rope_frequencies
from backends.torch.weights import (
    AttentionWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)


class KVCache:
    """Keys and values per layer, ``k[l]``/``v[l]`` of shape ``[slots, Hkv, max_len, D]``.

    ``lengths[s]`` is how many positions of slot ``s`` are valid; every layer's keys and
    values cover exactly those positions (DESIGN §8, invariant 2). Owned by one backend and
    mutated only by :meth:`write` (positions beyond the lengths), :meth:`commit` and
    :meth:`reset`.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k = k
        self.v = v
        self.lengths = [0] * k[0].shape[0]

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

    def write(self, layer: int, batch: RaggedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v [T, Hkv, D]`` of layer ``layer`` at each token's slot and position."""
        self.k[layer][batch.token_slots, :, batch.positions] = k
        self.v[layer][batch.token_slots, :, batch.positions] = v

    def read(self, layer: int, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, Hkv, Lk, D]`` of the batch's slots, ``Lk = batch.key_len``."""
        k = self.k[layer][:, :, :batch.key_len].index_select(0, batch.slots)
        v = self.v[layer][:, :, :batch.key_len].index_select(0, batch.slots)
        return k, v

    def commit(self, batch: RaggedBatch) -> None:
        """Extend each sequence's slot length by the tokens the batch wrote."""
        for slot, start, n in zip(batch.slot_list, batch.starts, batch.lengths):
            self.lengths[slot] = start + n

    def reset(self, slot: int) -> None:
        """Empty ``slot`` (stale values stay but are never read)."""
        self.lengths[slot] = 0


@attrs.frozen(eq=False)
class RaggedBatch:
    """B sequences' new tokens, concatenated, with the index tensors attention needs.

    ``token_ids``/``positions``/``token_slots``/``seq_of``/``index_in_seq`` are ``[T]``;
    ``slots``/``last`` (each sequence's last token in ``[T]``) are ``[B]``; ``starts`` and
    ``lengths`` are per sequence. Build with :meth:`build`.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    seq_of: torch.Tensor
    index_in_seq: torch.Tensor
    slots: torch.Tensor
    last: torch.Tensor
    slot_list: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def build(cls, seqs: Sequence[tuple[int, int, Sequence[int]]], *,
              device: torch.device | str = "cpu") -> RaggedBatch:
        """From ``(slot, start, token_ids)`` per sequence (each with at least one token)."""
        lengths = [len(ids) for _, _, ids in seqs]
        if not seqs or min(lengths) < 1:
            raise ValueError("every sequence of a batch needs at least one token")
        n = torch.tensor(lengths)                                     # [B]
        seq_of = torch.repeat_interleave(torch.arange(len(seqs)), n)  # [T]
        first = torch.cumsum(n, 0) - n                                # [B]
        index_in_seq = torch.arange(int(n.sum())) - first[seq_of]     # [T]
        starts = torch.tensor([s for _, s, _ in seqs])
        slots = torch.tensor([s for s, _, _ in seqs])

        def dev(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.int64)

        return cls(token_ids=dev(torch.tensor([t for _, _, ids in seqs for t in ids])),
                   positions=dev(starts[seq_of] + index_in_seq), token_slots=dev(slots[seq_of]),
                   seq_of=dev(seq_of), index_in_seq=dev(index_in_seq), slots=dev(slots),
                   last=dev(first + n - 1), slot_list=tuple(int(s) for s in slots),
                   starts=tuple(int(s) for s in starts), lengths=tuple(lengths))

    @property
    def query_len(self) -> int:
        """Lq: the longest sequence of new tokens."""
        return max(self.lengths)

    @property
    def key_len(self) -> int:
        """Lk: the longest cache extent after this call."""
        return max(s + n for s, n in zip(self.starts, self.lengths))

    def mask(self, window: int | None) -> torch.Tensor:
        """``[B, 1, Lq, Lk]`` bool, true where a query may see a key.

        Query i of sequence b sits at ``starts[b] + i`` and sees keys at positions up to its
        own (and, with a sliding ``window``, above ``own - window``). Padding queries copy the
        sequence's last query, so no row is empty (their outputs are discarded).
        """
        dev = self.slots.device
        n = torch.tensor(self.lengths, device=dev)                             # [B]
        i = torch.arange(self.query_len, device=dev)                           # [Lq]
        q_pos = torch.tensor(self.starts, device=dev)[:, None] + torch.minimum(
            i[None, :], n[:, None] - 1)                                         # [B, Lq]
        k_pos = torch.arange(self.key_len, device=dev)                         # [Lk]
        visible = k_pos[None, None, :] <= q_pos[:, :, None]                    # [B, Lq, Lk]
        if window is not None:
            visible &= k_pos[None, None, :] > q_pos[:, :, None] - window
        return visible[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def mlp_forward(w: MlpWeights, x: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``[T, H] -> [T, H]``."""
    gate_up = F.linear(x, w.gate_up, w.gate_up_bias)                          # [T, 2I]
    half = gate_up.shape[-1] // 2
    return F.linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], w.down, w.down_bias)


class MoeFunction(Protocol):
    """The routed-experts function a model uses: :func:`~backends.torch.moe.moe_forward`'s
    signature and result (another implementation, e.g. Triton kernels, may stand in)."""

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                 routing: RoutingSpec) -> torch.Tensor: ...


class Transformer:
    """A decoder-only model: ``spec`` plus its weights; :meth:`forward` is the whole model.

    ``moe`` computes the routed experts of MoE layers (default: the torch reference).
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights,
                 moe: MoeFunction = moe_forward) -> None:
        self.spec = spec
        self.weights = weights
        self.moe = moe
        inv_freq, self.rope_scale = rope_frequencies(spec.rope, spec.head_dim)
        self.inv_freq = inv_freq.to(weights.embed.device)                     # [D/2]

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and activations') dtype."""
        return self.weights.embed.dtype

    def forward(self, cache: KVCache, batch: RaggedBatch) -> torch.Tensor:
        """Logits ``[B, V]`` float32 at each sequence's last new token; writes K/V to ``cache``."""
        h = F.embedding(batch.token_ids, self.weights.embed)                    # [T, H]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, batch.positions, h.dtype)
        masks = {w: batch.mask(w) for w in set(self.spec.sliding_windows)}
        for i, layer in enumerate(self.weights.layers):
            h = self._layer(i, layer, h, cos, sin, cache, batch,
                            masks[self.spec.sliding_windows[i]])
        h = rms_norm(h[batch.last], self.weights.norm, self.spec.rms_norm_eps)  # [B, H]
        return F.linear(h, self.weights.lm_head).float()                       # [B, V]

    def _layer(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: KVCache, batch: RaggedBatch,
               mask: torch.Tensor) -> torch.Tensor:
        eps = self.spec.rms_norm_eps
        x = rms_norm(h, layer.input_norm, eps)
        h = h + self._attention(i, layer.attention, x, cos, sin, cache, batch, mask)
        x = rms_norm(h, layer.post_norm, eps)
        if isinstance(layer.mlp, MoeWeights):
            return h + self._moe(layer.mlp, x)
        return h + mlp_forward(layer.mlp, x)

    def _attention(self, i: int, w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache, batch: RaggedBatch,
                   mask: torch.Tensor) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        q = F.linear(x, w.q, w.q_bias).view(t, s.num_heads, s.head_dim)        # [T, Hq, D]
        k = F.linear(x, w.k, w.k_bias).view(t, s.num_kv_heads, s.head_dim)     # [T, Hkv, D]
        v = F.linear(x, w.v, w.v_bias).view(t, s.num_kv_heads, s.head_dim)     # [T, Hkv, D]
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, s.rms_norm_eps), rms_norm(k, w.k_norm, s.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(i, batch, k, v)
        out = attend(q, *cache.read(i, batch), batch, mask)                     # [T, Hq, D]
        return F.linear(out.reshape(t, -1), w.o, w.o_bias)                     # [T, H]

    def _moe(self, w: MoeWeights, x: torch.Tensor) -> torch.Tensor:
        moe = self.spec.moe
        assert moe is not None  # a MoeWeights layer exists only when the spec has moe
        out = self.moe(x, F.linear(x, w.router), w.gate_up, w.down, top_k=moe.top_k,
                       routing=moe.routing)                                    # [T, H]
        if w.shared is not None and w.shared_gate is not None:
            out = out + torch.sigmoid(F.linear(x, w.shared_gate)) * mlp_forward(w.shared, x)
        return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: RaggedBatch,
           mask: torch.Tensor) -> torch.Tensor:
    """Masked attention of ragged queries ``q [T, Hq, D]`` over padded keys/values
    ``[B, Hkv, Lk, D]``; returns ``[T, Hq, D]``. GQA: query head h reads kv head h // (Hq/Hkv)."""
    b, hkv, lk, d = k.shape
    hq = q.shape[1]
    qp = q.new_zeros((b, batch.query_len, hq, d))                              # [B, Lq, Hq, D]
    qp[batch.seq_of, batch.index_in_seq] = q
    rep = hq // hkv
    k = k[:, :, None].expand(b, hkv, rep, lk, d).reshape(b, hq, lk, d)         # [B, Hq, Lk, D]
    v = v[:, :, None].expand(b, hkv, rep, lk, d).reshape(b, hq, lk, d)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask)
    return out.transpose(1, 2)[batch.seq_of, batch.index_in_seq]              # [T, Hq, D]
