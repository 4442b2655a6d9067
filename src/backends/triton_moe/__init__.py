"""The Triton MoE backend: fused expert kernels behind the torch backend's model.

Modules: :mod:`.routing` (routing rules and :func:`~.routing.route`) with
:mod:`.router_kernels`; :mod:`.align` (pairs sorted by expert, runs padded to the block
size); :mod:`.kernels` (grouped gate/up GEMM with SiLU-and-multiply, down GEMM with routing
weights, top-k sum); :mod:`.configs` (tuned launch tables and the default); :mod:`.launch`
(:class:`~.launch.TritonMoe`, a drop-in for ``backends.torch.moe.moe_forward``).
Select it with ``build(options={"moe": "triton"})``. Importing this package imports
``triton``: set ``TRITON_INTERPRET=1`` first to run the kernels on a CPU.
"""

from backends.triton_moe.configs import ConfigKey, ConfigTables, LaunchConfig
from backends.triton_moe.launch import TritonMoe, fused_experts
from backends.triton_moe.routing import GroupedSigmoidTopK, SoftmaxTopK, route

__all__ = ["ConfigKey", "ConfigTables", "GroupedSigmoidTopK", "LaunchConfig", "SoftmaxTopK",
           "TritonMoe", "fused_experts", "route"]
