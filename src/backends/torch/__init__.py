"""The torch reference backend for Hugging Face decoder-only checkpoints.

Modules: :mod:`.config` (``ModelSpec`` from ``config.json``), :mod:`.moe` (routing and grouped
expert compute, the oracle for fused kernels), :mod:`.experts` (expert tiers: the routed
experts under a memory cap, the rest read from the mapped weight file), :mod:`.rope`, :mod:`.model` (the forward over a
per-slot KV cache), :mod:`.packed` (oneDNN-packed float32 linears), :mod:`.weights`,
:mod:`.loader` (safetensors folders) and :mod:`.backend` (``TorchBackend``,
the :class:`pipeline.contracts.model.Backend` implementation).
"""

from backends.torch.backend import TorchBackend
from backends.torch.config import ModelSpec

__all__ = ["ModelSpec", "TorchBackend"]
