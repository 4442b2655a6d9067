"""The weight tensors of a decoder-only model, grouped the way the forward uses them.

Linear weights keep the ``[out, in]`` layout of ``torch.nn.functional.linear``. Gate and up
projections are stored fused, gate rows first: ``gate_up [2I, H]`` for a dense MLP,
``[E, 2I, H]`` for the routed experts (the layout transformers 5.x uses in memory). The
containers are frozen; the tensors are shared, never copied, and never modified by the forward.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch


@attrs.frozen(eq=False)
class MlpWeights:
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``; ``gate_up [2I, H]``, ``down [H, I]``."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@attrs.frozen(eq=False)
class MoeWeights:
    """Routed experts plus an optional sigmoid-gated shared expert (Qwen2-MoE).

    ``router [E, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``, ``shared_gate [1, H]``.
    """

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    shared: MlpWeights | None = None
    shared_gate: torch.Tensor | None = None


@attrs.frozen(eq=False)
class AttentionWeights:
    """Projections ``q [Hq*D, H]``, ``k``/``v [Hkv*D, H]``, ``o [H, Hq*D]``, optional biases,
    and the per-head RMSNorm weights ``q_norm``/``k_norm [D]`` (Qwen3)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@attrs.frozen(eq=False)
class LayerWeights:
    """One pre-norm block: ``input_norm``/``post_norm [H]``, attention, and a dense or MoE MLP."""

    input_norm: torch.Tensor
    attention: AttentionWeights
    post_norm: torch.Tensor
    mlp: MlpWeights | MoeWeights


@attrs.frozen(eq=False)
class ConditioningWeights:
    """Time and self-conditioning of embedding inputs (:mod:`backends.torch.conditioning`):
    the time MLP ``time_in [H, H]`` (+ bias) → SiLU → ``time_out [H, H]`` (+ bias), and the
    self-condition projection ``self_condition [H, H]``; each None when the model lacks it."""

    time_in: torch.Tensor | None = None
    time_in_bias: torch.Tensor | None = None
    time_out: torch.Tensor | None = None
    time_out_bias: torch.Tensor | None = None
    self_condition: torch.Tensor | None = None


@attrs.frozen(eq=False)
class ModelWeights:
    """``embed [V, H]``, the layers, the final ``norm [H]`` and ``lm_head [V, H]`` (the same
    tensor as ``embed`` when the checkpoint ties them), the embedding-input ``conditioning``
    of a continuous diffusion or flow model (None otherwise), and ``rope_factors [D/2]``:
    divisors of the rotary inverse frequencies that a GGUF file stores as ``rope_freqs``
    (llama.cpp's converter writes Llama 3's rope scaling that way; None otherwise)."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor
    conditioning: ConditioningWeights | None = None
    rope_factors: torch.Tensor | None = None


def tensors(weights: ModelWeights) -> Iterator[torch.Tensor]:
    """Every tensor of ``weights`` once, in field order (a tied ``lm_head`` is ``embed``)."""
    seen: set[int] = set()

    def walk(value: object) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                yield value
        elif isinstance(value, tuple):
            for item in value:
                yield from walk(item)
        elif isinstance(value, (ModelWeights, LayerWeights, AttentionWeights, MlpWeights,
                                MoeWeights, ConditioningWeights)):
            for item in attrs.astuple(value, recurse=False):
                yield from walk(item)

    return walk(weights)
