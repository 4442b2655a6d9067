"""The decoder forward over a paged KV cache, for ragged batches of sequences.

One call runs B sequences at once (a :class:`~backends.torch.kv.RaggedBatch`), each
``(slot, start, tokens)`` with its block table: its new tokens sit at positions ``start ..
start+len-1`` and attend to the sequence's cached positions ``0 .. start-1`` and causally to
each other. The same path serves a one-shot prefill (``start == 0``), a chunk of a chunked
prefill (``start > 0``), and a decode step (one token per slot). Tokens of all sequences are
concatenated (``[T, ...]``) for the projections and MLPs; each layer scatters the new keys and
values of every writing sequence into their blocks, then attention runs per sequence over the
keys and values :meth:`~backends.torch.kv.KVCache.read` gives (its own new keys for a prompt
from position 0, a view of one run of blocks, or a gather of scattered ones) with the same
:func:`attend`: a decode token folds its query heads onto their key/value head; a prompt from
position 0 uses the causal kernel; a later chunk, or a sliding window that cuts in, gets an
explicit ``[Lq, Lk]`` mask. A batch-invariant model (``Transformer(batch_invariant=True)``)
runs every product on fixed tiles of rows and attends prompt chunks with
:func:`~backends.torch.invariant.grid_attention`, so no row depends on its batch
(:mod:`backends.torch.invariant`).

The forward writes new keys and values into blocks but does not change the slots' lengths:
:meth:`~backends.torch.kv.KVCache.commit` does, after the call succeeded, so a call that
raises leaves every slot's logical cache as it was.

Shapes: T tokens in the call, B sequences, H hidden, Hq/Hkv heads, D head_dim, V vocab.

Example::

    cache = KVCache.empty(spec, num_blocks=64, block_size=16, num_slots=4, dtype=torch.float32)
    batch = RaggedBatch.build([(0, 0, prompt_ids)], tables=[(0, 1, 2)], block_size=16)
    logits = model.forward(cache, batch)      # [1, V] float32 at the prompt's last token
    cache.commit(batch)                       # cache.lengths[0] == len(prompt_ids)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from backends.torch.config import ModelSpec
from backends.torch.experts import DOWN, GATE_UP, ExpertCache
from backends.torch.invariant import RowTiles, grid_attention, sdpa
from backends.torch.kv import KVCache, RaggedBatch
from backends.torch.moe import RoutingSpec, moe_forward
from backends.torch.packed import DenseFn, ExpertFetch, LinearFn, Linears, PromptRows
from backends.torch.rope import apply_rope, rope_cos_sin, rope_frequencies
from backends.torch.weights import (
    AttentionWeights, LayerWeights, MlpWeights, ModelWeights, MoeWeights,
)
from pipeline.errors import InvalidValueError


OwnProduct = tuple[torch.Tensor, LinearFn, int, bool, "DenseFn | None"]
"""A weight's own product (:meth:`~backends.torch.packed.Linears.register`): its placeholder,
the product, the bytes it holds, whether it is row-wise, and its whole-weight decoder."""


class MoeFunction(Protocol):
    """:func:`~backends.torch.moe.moe_forward`'s signature and contract: the routed-experts
    output ``[T, H]``. A faster implementation of the same function may replace it."""

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                 routing: RoutingSpec) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def mlp_forward(w: MlpWeights, x: torch.Tensor, linear: Linears | None = None) -> torch.Tensor:
    """SwiGLU ``[T, H] -> [T, H]`` (``linear``: packed weights, default plain ``F.linear``)."""
    lin = linear if linear is not None else Linears.plain()
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
    function holds, whether it computes each row on its own (then a batch-invariant model
    runs it untiled), and optionally the weight decoded whole for the rows of prompt chunks
    (:class:`~backends.torch.packed.PromptRows`). ``batch_invariant`` makes each row's
    logits independent of the rest of the batch and of how its prompt was cut into chunks (:mod:`backends.torch.invariant`).
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, *,
                 moe: MoeFunction = moe_forward, pack: bool = True,
                 own_products: Sequence[OwnProduct] = (),
                 batch_invariant: bool = False,
                 experts: ExpertCache | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.spec = spec
        self.weights = weights
        self.batch_invariant = batch_invariant
        default_moe = moe is moe_forward
        self.linears = (Linears.pack(weights, experts=default_moe) if pack
                        else Linears.plain())
        for placeholder, multiply, nbytes, row_wise, dense in own_products:
            self.linears.register(placeholder, multiply, nbytes, row_wise=row_wise, dense=dense)
        self.linears.invariant = batch_invariant
        self.reduce = reduce
        """Sums a block's partial output over the ranks of a tensor-parallel group (None:
        this process holds the whole model; :mod:`backends.torch.parallel`)."""
        self.tap: Callable[[str, torch.Tensor], None] | None = None
        """Receives the whole batch's hidden states ``[T, H]`` at every layer tap while a
        forward runs (:class:`~pipeline.contracts.model.LayerTaps`, named as
        :func:`~pipeline.contracts.model.tap_names` names them); None: no tap."""
        self.experts = experts
        if experts is not None:
            if not default_moe:
                raise InvalidValueError("expert_cache_bytes", experts.cap_bytes,
                                        "expert tiers run on the torch experts path "
                                        "(moe='torch'); a fused kernel needs every expert "
                                        "resident")
            for i, layer in enumerate(weights.layers):
                if isinstance(layer.mlp, MoeWeights):
                    self.linears.register_experts(layer.mlp.gate_up, _fetch(experts, i, GATE_UP))
                    self.linears.register_experts(layer.mlp.down, _fetch(experts, i, DOWN))
        # the default experts' products go through the linears too: packed copies, tiles of
        # rows (invariant) or a bounded set of row counts (:func:`~backends.torch.packed.bounded_rows`)
        self.moe = self._packed_moe if default_moe else moe
        inv_freq, self.rope_scale = rope_frequencies(spec.rope, spec.head_dim)
        if weights.rope_factors is not None:  # llama.cpp's per-frequency divisors
            inv_freq = inv_freq / weights.rope_factors.float().cpu()
        self.inv_freq = inv_freq.to(weights.norm.device)                      # [D/2]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``token_ids [T]``: ``[T, H]`` in :attr:`dtype`."""
        return F.embedding(token_ids, self.weights.embed).to(self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the final norm's (the token table and the output head
        may be stored narrower, e.g. a GGUF model's bfloat16 table in quantized mode)."""
        return self.weights.norm.dtype

    def forward(self, cache: KVCache, batch: RaggedBatch,
                inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[N, V]`` float32 at the batch's wanted ``outputs``; writes K/V to ``cache``.
        ``inputs [T, H]`` replaces the token embeddings as the first hidden states (embedding
        inputs, :mod:`backends.torch.conditioning`)."""
        h = self.embed(batch.token_ids) if inputs is None else inputs
        if self.tap is not None:
            self.tap("embed", h)
        tokens, outputs = _row_plans(batch, h.device) if self.batch_invariant else (None, None)
        self.linears.plan = tokens
        self.linears.prompt_rows = (
            PromptRows([p for p, n in zip(batch.prompts, batch.lengths) for _ in range(n)],
                       h.device, tokens) if any(batch.prompts) else None)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, batch.positions, h.dtype)
        for i, layer in enumerate(self.weights.layers):
            h = self._layer(i, layer, h, cos, sin, cache, batch)
        h = rms_norm(h[batch.outputs], self.weights.norm, self.spec.rms_norm_eps)  # [N, H]
        self.linears.plan = outputs
        return self.linears(h, self.weights.lm_head).float()                   # [N, V]

    def hidden_states(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states ``[T, H]`` float32 of ``token_ids [T]``, one causal
        sequence from position 0: the last layer's output after the final norm, the output
        head's input. No cache is read or written (embeddings)."""
        h = self.embed(token_ids)                                              # [T, H]
        self.linears.plan, self.linears.prompt_rows = None, None
        positions = torch.arange(token_ids.shape[0], device=h.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions, h.dtype)
        for i, layer in enumerate(self.weights.layers):
            h = self._layer(i, layer, h, cos, sin, None, None)
        return rms_norm(h, self.weights.norm, self.spec.rms_norm_eps).float()  # [T, H]

    def _layer(self, i: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, cache: KVCache | None,
               batch: RaggedBatch | None) -> torch.Tensor:
        eps = self.spec.rms_norm_eps
        x = rms_norm(h, layer.input_norm, eps)
        attended = self._attention(i, layer.attention, x, cos, sin, cache, batch)
        if self.reduce is not None:
            attended = self.reduce(attended)
        h = h + attended
        x = rms_norm(h, layer.post_norm, eps)
        if isinstance(layer.mlp, MoeWeights):
            mixed = self._moe(layer.mlp, x)
        else:
            mixed = mlp_forward(layer.mlp, x, self.linears)
        if self.reduce is not None:
            mixed = self.reduce(mixed)
        out = h + mixed
        if self.tap is not None:
            self.tap(f"layers.{i}.attention", attended)
            self.tap(f"layers.{i}.mlp", mixed)
            self.tap(f"layers.{i}", out)
        return out

    def _attention(self, i: int, w: AttentionWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache | None,
                   batch: RaggedBatch | None) -> torch.Tensor:
        s, t = self.spec, x.shape[0]
        lin = self.linears
        q = lin(x, w.q, w.q_bias).view(t, s.num_heads, s.head_dim)             # [T, Hq, D]
        k = lin(x, w.k, w.k_bias).view(t, s.num_kv_heads, s.head_dim)          # [T, Hkv, D]
        v = lin(x, w.v, w.v_bias).view(t, s.num_kv_heads, s.head_dim)          # [T, Hkv, D]
        if w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, s.rms_norm_eps), rms_norm(k, w.k_norm, s.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = s.sliding_windows[i]
        if cache is None or batch is None:  # one sequence from position 0, nothing kept
            keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]    # [1, Hkv, T, D]
            # queries in tiles: the scores of one tile, [Hq, TILE, T], never [Hq, T, T]
            alone = torch.cat([attend(q[lo:lo + HIDDEN_TILE], keys[:, :, :lo + HIDDEN_TILE],
                                      values[:, :, :lo + HIDDEN_TILE], lo, window)
                               for lo in range(0, t, HIDDEN_TILE)])            # [T, Hq, D]
            return lin(alone.reshape(t, -1), w.o, w.o_bias)                    # [T, H]
        cache.update(i, batch, k, v)
        outs = []
        for b, (start, n, at) in enumerate(zip(batch.starts, batch.lengths, batch.offsets)):
            keys, values = cache.read(i, batch, b, k[at:at + n], v[at:at + n])  # [1, Hkv, L, D]
            if self.batch_invariant and batch.prompts[b] and not batch.bidirectional[b]:
                outs.append(grid_attention(q[at:at + n], keys, values, start, window))
                continue
            outs.append(attend(q[at:at + n], keys, values, start, window,
                               batch.bidirectional[b]))                        # [n, Hq, D]
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


def _fetch(cache: ExpertCache, layer: int, which: int) -> ExpertFetch:
    def fetch(e: int) -> tuple[torch.Tensor, bool]:
        return cache.matrix(layer, e, which)
    return fetch


def _row_plans(batch: RaggedBatch, device: torch.device) -> tuple[RowTiles, RowTiles]:
    """The tiles of a batch-invariant forward's token rows (wide for a prompt chunk's or a
    multi-token call's rows, narrow for a one-token call's) and output rows (wide for a call
    that wants several outputs, narrow for one that wants one: a prompt's last position or a
    decode token)."""
    wide = [w for prompt, n in zip(batch.prompts, batch.lengths)
            for w in [prompt or n > 1] * n]
    owner = [b for b, n in enumerate(batch.lengths) for _ in range(n)]
    outputs = [owner[r] for r in batch.outputs.tolist()]
    wanted = Counter(outputs)
    return RowTiles(wide, device), RowTiles([wanted[b] > 1 for b in outputs], device)


EXACT_QUERIES = 16
"""A causal call of at most this many tokens after a cached prefix (verifying drafts) runs
each query as a one-token decode would, so each position's logits are bit for bit those of
decoding one token at a time: the masked multi-query kernel sums in another order, and in
bfloat16 that can move a logit by one unit in the last place and flip a near-tie argmax
(greedy speculative decoding must equal plain decoding)."""


HIDDEN_TILE = 256
"""Queries per attention call when :meth:`Transformer.hidden_states` runs a whole sequence:
its memory grows with the sequence, not with its square."""


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
        out = sdpa(q.view(1, hkv, hq // hkv, d), keys, values)
        return out.view(1, hq, d)
    qh = q.transpose(0, 1)[None]                                               # [1, Hq, n, D]
    if q.device.type == "cpu" and q.dtype != torch.float32:  # torch's fused kernel
        return _bounded_fused(qh, keys, values, start, window, block)
    if start == 0 and not windowed and not block:
        out = sdpa(qh, keys, values, is_causal=True, enable_gqa=True)
    elif block and not windowed:  # everything written so far: no mask at all
        out = sdpa(qh, keys, values, enable_gqa=True)
    else:
        out = sdpa(qh, keys, values, attn_mask=_mask(n, lk, start, window, block, q.device),
                   enable_gqa=True)
    return out[0].transpose(0, 1)                                              # [n, Hq, D]


def _mask(n: int, lk: int, start: int, window: int | None, block: bool,
          device: torch.device) -> torch.Tensor:
    """Which of ``lk`` keys each of ``n`` queries at ``start..start+n-1`` sees: ``[n, Lk]``."""
    q_pos = torch.arange(start, start + n, device=device)[:, None]             # [n, 1]
    k_pos = torch.arange(lk, device=device)[None, :]                           # [1, Lk]
    mask = k_pos <= (torch.full_like(q_pos, start + n - 1) if block else q_pos)  # [n, Lk]
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def _attention_length(n: int) -> int:
    """The length a prompt's queries or keys are padded to for the fused kernel: as it is up
    to 32 (a few shapes, and short prompts keep the kernel's exact bits), else the next
    multiple of 32."""
    return n if n <= 32 else -(-n // 32) * 32


def _bounded_fused(qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   window: int | None, block: bool) -> torch.Tensor:
    """:func:`attend`'s several queries ``qh [1, Hq, n, D]`` by torch's fused CPU kernel
    (bfloat16, float16) on padded lengths: ``[n, Hq, D]``.

    That kernel keeps a compiled oneDNN micro-kernel, and its buffers, for every shape of
    block it has met, in a cache with no bound (torch's ``CPUBlas`` kernel cache), so
    prompts of every length grew memory with traffic's variety (hundreds of MB over 3,000
    varied requests). Queries and keys are padded with zeros to :func:`_attention_length`
    lengths, so the blocks take a few shapes; the
    padded keys are hidden (causally, for a prompt from position 0, else by the mask), the
    padded queries' rows are dropped."""
    _, hq, n, d = qh.shape
    hkv, lk = keys.shape[1], keys.shape[2]
    m, lk_pad = _attention_length(n), _attention_length(lk)
    qp = torch.cat([qh, qh.new_zeros((1, hq, m - n, d))], dim=2)               # [1, Hq, m, D]
    pad = keys.new_zeros((1, hkv, lk_pad - lk, d))
    kp, vp = torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)    # [1, Hkv, Lk', D]
    if start == 0 and lk == n and not block and (window is None or lk <= window):
        out = sdpa(qp, kp, vp, is_causal=True, enable_gqa=True)                # [1, Hq, m, D]
    else:
        mask = torch.zeros(m, lk_pad, dtype=torch.bool, device=qh.device)      # [m, Lk']
        mask[:n, :lk] = _mask(n, lk, start, window, block, qh.device)
        mask[n:, 0] = True  # a padded query sees one key: no empty softmax
        out = sdpa(qp, kp, vp, attn_mask=mask, enable_gqa=True)               # [1, Hq, m, D]
    return out[0, :, :n].transpose(0, 1)                                       # [n, Hq, D]
