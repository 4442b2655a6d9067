"""Masked (discrete) diffusion and discrete flow matching as strategies (docs/design.md §10).

Owns the samplers that refine a block of ``<|mask|>`` positions over several model calls:
``llada`` (:class:`LladaStrategy`, low-confidence or random remasking on a count schedule),
``fast_dllm`` (:class:`FastDllmStrategy`, confidence-threshold parallel commits) and ``dfm``
(:class:`DiscreteFlowStrategy`, the discrete Euler solver of discrete flow matching). The
block loop they share is in ``strategy.py``, their update rules in ``rules.py``, the
counter-based noise in ``noise.py``, and how ``build()`` configures them in ``options.py``.
"""

from stages.strategies.diffusion.noise import uniforms
from stages.strategies.diffusion.options import OPTIONS, diffusion_maker
from stages.strategies.diffusion.strategy import (
    BlockState, DiffusionSettings, DiscreteFlowStrategy, FastDllmStrategy, LladaStrategy,
    MaskedDiffusionStrategy,
)

__all__ = [
    "OPTIONS", "BlockState", "DiffusionSettings", "DiscreteFlowStrategy", "FastDllmStrategy",
    "LladaStrategy", "MaskedDiffusionStrategy", "diffusion_maker", "uniforms",
]
