"""Model backends: :mod:`backends.torch` (the reference for Hugging Face checkpoints, dense
and MoE) and :mod:`backends.triton_moe` (fused MoE kernels the torch model can use instead of
its reference MoE); registered by name in :mod:`backends.plugin`."""
