"""Routing: router logits ``[T, E]`` to expert weights and ids ``[T, K]``.

Owns the two routing rules our checkpoints use and :func:`route`, which checks its operands
and launches the rule's Triton kernel (:mod:`.router_kernels`: one program per block of
tokens, the whole expert row in registers, so E is at most a few hundred):

- :class:`SoftmaxTopK` (Mixtral, Qwen2-MoE, Qwen3-MoE): ``softmax`` over all E experts in
  float32, the K largest probabilities, optionally renormalized to sum to one. This is
  :func:`backends.torch.moe.route`'s rule; its shared expert (Qwen2-MoE) is the model's.
- :class:`GroupedSigmoidTopK` (DeepSeek-V3 ``noaux_tc``): ``s = sigmoid(logits)``; selection
  uses ``s + correction_bias``; a group's score is the sum of its two best biased scores; the
  ``topk_group`` best groups are kept and the other experts masked with ``-inf`` (as vLLM
  and transformers 5 do; older transformers masked with ``0.0``, which differs only when
  fewer than K kept experts have a positive biased score); the K best kept experts are
  chosen and weighted by their *unbiased* ``s``, renormalized (``/ (sum + 1e-20)``) when
  asked, then multiplied by ``routed_scaling_factor``.

Top-k is K rounds of ``argmax`` then mask, so ids come out in descending order of the
selection score (the probability; for DeepSeek-V3 the biased score), ties going to the lower
expert id. Weights are float32, ids int32.

Example::

    weights, ids = route(logits, SoftmaxTopK(top_k=2, renormalize=True))   # [T, 2] each
"""

from __future__ import annotations

import attrs
import torch
import triton

from backends.triton_moe import router_kernels
from pipeline.errors import InvalidValueError

MAX_EXPERTS = 1024


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise InvalidValueError(attribute.name, value, "must be >= 1")


@attrs.frozen
class SoftmaxTopK:
    """Softmax over experts, top ``top_k``, renormalized when ``renormalize``."""

    top_k: int = attrs.field(validator=_positive)
    renormalize: bool = False


@attrs.frozen
class GroupedSigmoidTopK:
    """DeepSeek-V3 routing: E experts in ``num_groups`` equal groups, ``topk_group`` kept.

    ``correction_bias`` (``[E]``, float32) is passed to :func:`route` with the logits,
    since it is a checkpoint tensor.
    """

    top_k: int = attrs.field(validator=_positive)
    num_groups: int = attrs.field(validator=_positive)
    topk_group: int = attrs.field(validator=_positive)
    renormalize: bool = True
    scaling: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.topk_group > self.num_groups:
            raise InvalidValueError("topk_group", self.topk_group,
                                    f"more than num_groups={self.num_groups}")


Routing = SoftmaxTopK | GroupedSigmoidTopK


def route(logits: torch.Tensor, routing: Routing,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] float32, ids [T, K] int32)`` for router ``logits [T, E]``.

    ``correction_bias [E]`` is required by (and only accepted with) :class:`GroupedSigmoidTopK`.
    Raises :class:`~pipeline.errors.InvalidValueError` for shapes the rule cannot route.
    """
    t, e = _check_logits(logits, routing)
    weights = torch.empty((t, routing.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, routing.top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    block_t = max(1, min(16, 4096 // block_e))
    block_k = triton.next_power_of_2(routing.top_k)
    grid = (triton.cdiv(t, block_t),)
    if isinstance(routing, SoftmaxTopK):
        if correction_bias is not None:
            raise InvalidValueError("correction_bias", "tensor", "softmax routing has no bias")
        router_kernels.softmax_topk_kernel[grid](
            logits, weights, ids, t, e, logits.stride(0), logits.stride(1), TOP_K=routing.top_k,
            RENORMALIZE=routing.renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k)
        return weights, ids
    bias = _check_bias(correction_bias, e, logits.device)
    router_kernels.grouped_sigmoid_topk_kernel[grid](
        logits, bias, weights, ids, t, e, logits.stride(0), logits.stride(1),
        float(routing.scaling), TOP_K=routing.top_k, GROUPS=routing.num_groups,
        TOPK_GROUP=routing.topk_group, RENORMALIZE=routing.renormalize, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_G=triton.next_power_of_2(routing.num_groups), BLOCK_K=block_k)
    return weights, ids


def _check_logits(logits: torch.Tensor, routing: Routing) -> tuple[int, int]:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise InvalidValueError("router_logits", tuple(logits.shape),
                                "must be a floating-point [T, E] tensor")
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise InvalidValueError("num_experts", e, f"must be in 1..{MAX_EXPERTS}")
    if routing.top_k > e:
        raise InvalidValueError("top_k", routing.top_k, f"more than the {e} experts")
    if isinstance(routing, GroupedSigmoidTopK):
        if e % routing.num_groups:
            raise InvalidValueError("num_groups", routing.num_groups,
                                    f"does not divide the {e} experts")
        per_group = e // routing.num_groups
        if per_group < 2:
            raise InvalidValueError("num_groups", routing.num_groups,
                                    "needs at least two experts per group (top-2 group score)")
        if routing.top_k > routing.topk_group * per_group:
            raise InvalidValueError("top_k", routing.top_k,
                                    f"more than the {routing.topk_group * per_group} experts "
                                    "of the kept groups")
    return int(t), int(e)


def _check_bias(bias: torch.Tensor | None, e: int, device: torch.device) -> torch.Tensor:
    if bias is None:
        raise InvalidValueError("correction_bias", None, "grouped sigmoid routing needs one")
    if bias.shape != (e,) or bias.device != device:
        raise InvalidValueError("correction_bias", tuple(bias.shape),
                                f"must be [{e}] on {device}")
    return bias.float().contiguous()
