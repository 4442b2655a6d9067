"""Mixture-of-experts feed-forward: routing and grouped expert compute, in plain torch.

This module is the reference (oracle) for a future fused MoE kernel, so it is pure: no module
state, no autograd tricks, inputs are never modified. Shapes use T tokens, H hidden size,
E experts, I expert intermediate size, K experts per token.

Semantics follow Hugging Face ``transformers`` 5.x exactly:

1. ``probs = softmax(router_logits in float32)``                       # [T, E]
2. ``weights, experts = topk(probs, K)`` (ties: torch.topk order)       # [T, K]
3. if ``routing.renormalize``: ``weights /= weights.sum(-1)``  (Mixtral always; Qwen MoE when
   ``norm_topk_prob``)
4. the weights are cast to the hidden dtype (Qwen MoE) or kept in float32 until after the
   weighted product (Mixtral, ``routing.weights_in_float32``)
5. each routed (token, expert) pair computes ``down(silu(gate(x)) * up(x)) * weight``; a
   token's K products are summed with one ``sum`` over K (in the products' dtype: float32 for
   Mixtral) and cast to the hidden dtype — transformers' default ``grouped_mm`` experts path,
   which is deterministic (no atomics) and agrees bit for bit in bfloat16 on CPU.

Tokens are grouped by expert with one stable sort and one gather; each active expert runs one
matmul over its tokens (or one ``torch._grouped_mm`` over all of them, bfloat16 on CUDA) — there
is no Python loop over tokens. A shared expert (Qwen2-MoE) is not part of this function; the
model layer adds it.

Example::

    routing = RoutingSpec(renormalize=True)
    out = moe_forward(x, x @ gate_w.T, w_gate_up, w_down, top_k=2, routing=routing)   # [T, H]
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch
import torch.nn.functional as F

ExpertLinear = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``linear(x [n, in], stack [E, out, in], e) -> x @ stack[e].T``: how expert rows are
multiplied (default ``F.linear``; the torch backend passes oneDNN-packed weights)."""


def _plain_linear(x: torch.Tensor, stack: torch.Tensor, e: int) -> torch.Tensor:
    return F.linear(x, stack[e])


@attrs.frozen
class RoutingSpec:
    """How router probabilities become expert weights.

    ``renormalize``: divide the top-k probabilities by their sum (Mixtral: always; Qwen MoE:
    the config's ``norm_topk_prob``). ``weights_in_float32``: multiply expert outputs by the
    float32 weights and cast the product to the hidden dtype (Mixtral); otherwise the weights
    are cast to the hidden dtype first (Qwen MoE). Both agree exactly in float32.
    """

    renormalize: bool
    weights_in_float32: bool = False


def route(router_logits: torch.Tensor, *, top_k: int,
          routing: RoutingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(weights [T, K], experts [T, K] int64)`` from logits ``[T, E]``.

    ``weights`` are float32 when ``routing.weights_in_float32``, else in the logits' dtype.
    """
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k={top_k} outside 1..{router_logits.shape[-1]}")
    probs = torch.softmax(router_logits.float(), dim=-1)              # [T, E] float32
    weights, experts = torch.topk(probs, top_k, dim=-1)               # [T, K]
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not routing.weights_in_float32:
        weights = weights.to(router_logits.dtype)
    return weights, experts


def group_by_expert(experts: torch.Tensor,
                    num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*K routed pairs by expert.

    Returns ``order [T*K]`` (indices into the flattened ``experts``, stable, so pairs of one
    expert keep token order), ``token_of [T*K]`` (the token of each sorted pair) and
    ``counts [E]`` (pairs per expert).
    """
    flat = experts.reshape(-1)                                        # [T*K]
    order = torch.argsort(flat, stable=True)                          # [T*K]
    token_of = order // experts.shape[-1]                             # [T*K]
    counts = torch.bincount(flat, minlength=num_experts)              # [E]
    return order, token_of, counts


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of ``x [N, in]`` sorted by expert times ``weight[e].T``: ``[N, out]``, as one
    ``torch._grouped_mm`` (bfloat16 on CUDA: :func:`_grouped_mm_usable`). ``weight`` is
    ``[E, out, in]``; the first ``counts[0]`` rows belong to expert 0, and so on. Elsewhere
    the experts run one after the other (:func:`_per_expert`): on CPU ``_grouped_mm`` visits
    every expert and copies the transposed weights, which made a decode step several times
    slower."""
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)             # [E]
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


def _grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # _grouped_mm (torch >= 2.8) takes bfloat16 on CUDA (sm90+) and needs 16-byte aligned
    # row strides.
    if (not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype or x.shape[0] == 0
            or weight.device != x.device):  # a meta placeholder: tiered experts
        return False
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all((n * size) % 16 == 0 for n in (weight.shape[1], weight.shape[2]))


def expert_forward(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   w_gate_up: torch.Tensor, w_down: torch.Tensor,
                   linear: ExpertLinear = _plain_linear) -> torch.Tensor:
    """SwiGLU experts over routed tokens: ``[T, H]``.

    ``hidden [T, H]``, ``weights``/``experts [T, K]`` from :func:`route`, ``w_gate_up
    [E, 2I, H]`` (gate rows first, then up rows), ``w_down [E, H, I]``.
    """
    num_experts, two_i, _ = w_gate_up.shape
    if experts.shape[0] == 1:
        return _one_token(hidden, weights, experts, w_gate_up, w_down, linear)
    order, token_of, counts = group_by_expert(experts, num_experts)
    x = hidden[token_of]                                              # [T*K, H]
    if _grouped_mm_usable(x, w_gate_up):
        gate_up = grouped_linear(x, w_gate_up, counts)                # [T*K, 2I]
        act = F.silu(gate_up[:, :two_i // 2]) * gate_up[:, two_i // 2:]   # [T*K, I]
        y = grouped_linear(act, w_down, counts)                       # [T*K, H]
    else:  # expert by expert, both matrices at once (an expert cache holds one at a time)
        y = _per_expert(x, counts, w_gate_up, w_down, linear)         # [T*K, H]
    y = y * weights.reshape(-1, 1)[order]                             # [T*K, H]
    unsorted = torch.empty_like(y)
    unsorted[order] = y                                               # [T*K, H] token-major
    return unsorted.view(*experts.shape, -1).sum(dim=1).to(hidden.dtype)   # [T, H]


def _per_expert(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, linear: ExpertLinear) -> torch.Tensor:
    """SwiGLU of rows ``x [N, H]`` sorted by expert, one expert after the other: ``[N, H]``.
    An expert with no rows costs nothing."""
    half = w_gate_up.shape[1] // 2
    parts = []
    at = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate_up = linear(x[at:at + n], w_gate_up, e)              # [n, 2I]
            parts.append(linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], w_down, e))
            at += n
    return torch.cat(parts) if parts else x.new_empty((0, w_down.shape[1]))


def _one_token(hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
               w_gate_up: torch.Tensor, w_down: torch.Tensor,
               linear: ExpertLinear) -> torch.Tensor:
    """:func:`expert_forward` for a single token (a batch-1 decode step): its K experts in
    routing order, no sort, gather or scatter (each of those is a parallel region, which
    costs more than the arithmetic at one row). Same products and the same sum over K as the
    grouped path."""
    half = w_gate_up.shape[1] // 2
    products = []
    for k, e in enumerate(experts[0].tolist()):
        gate_up = linear(hidden, w_gate_up, e)                        # [1, 2I]
        act = F.silu(gate_up[:, :half]) * gate_up[:, half:]           # [1, I]
        products.append(linear(act, w_down, e) * weights[:, k:k + 1])     # [1, H]
    return torch.stack(products, dim=1).sum(dim=1).to(hidden.dtype)   # [1, H]


def moe_forward(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, top_k: int, routing: RoutingSpec,
                linear: ExpertLinear = _plain_linear) -> torch.Tensor:
    """The routed-experts output ``[T, H]`` for ``hidden [T, H]``.

    ``router_logits [T, E]`` (``hidden @ gate_weight.T``), ``w_gate_up [E, 2I, H]``,
    ``w_down [E, H, I]``. ``linear`` multiplies an expert's rows by its matrix (default
    ``F.linear``). Raises ``ValueError`` for inconsistent shapes.
    """
    t, h = hidden.shape
    e, two_i, h2 = w_gate_up.shape
    if router_logits.shape != (t, e) or h2 != h or two_i % 2 or w_down.shape != (e, h, two_i // 2):
        raise ValueError(f"moe shapes disagree: hidden {tuple(hidden.shape)}, router "
                         f"{tuple(router_logits.shape)}, gate_up {tuple(w_gate_up.shape)}, "
                         f"down {tuple(w_down.shape)}")
    weights, experts = route(router_logits, top_k=top_k, routing=routing)
    return expert_forward(hidden, weights, experts, w_gate_up, w_down, linear)


class ExpertSlice:
    """:class:`~backends.torch.model.MoeFunction` for one rank of an expert-parallel group: the
    routed-experts output's share of experts ``[first, first + count)``, whose stacks
    (``[count, 2I, H]``, ``[count, H, I]``) this rank holds. Routing is the whole model's
    (``router_logits [T, E]``); each (token, expert) pair of this rank's experts computes
    :func:`expert_forward`'s product, the others add nothing, so the shares of all ranks sum
    to :func:`moe_forward`'s output (up to the order of the sum)."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, top_k: int,
                 routing: RoutingSpec) -> torch.Tensor:
        t, h = hidden.shape
        weights, experts = route(router_logits, top_k=top_k, routing=routing)    # [T, K]
        local = (experts - self.first).reshape(-1)                              # [T*K]
        pairs = ((local >= 0) & (local < self.count)).nonzero().squeeze(1)      # this rank's
        dtype = weights.dtype if routing.weights_in_float32 else hidden.dtype
        products = torch.zeros(t * top_k, h, dtype=dtype, device=hidden.device)  # [T*K, H]
        if pairs.numel():
            order = pairs[torch.argsort(local[pairs], stable=True)]              # by expert
            counts = torch.bincount(local[order], minlength=self.count)
            y = _per_expert(hidden[order // top_k], counts, w_gate_up, w_down, _plain_linear)
            products[order] = y * weights.reshape(-1, 1)[order]
        return products.view(t, top_k, h).sum(dim=1).to(hidden.dtype)          # [T, H]
