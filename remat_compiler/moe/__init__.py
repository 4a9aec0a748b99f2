"""Expert-parallel MoE layer and its fused combine (GEMM2 -> A2A -> weighted Unpermute).

Its recompute strategies (``moe_origin``, ``moe_fast``, ``moe_custom``, ``moe_cpsat``) are solvers:
:mod:`remat_compiler.solvers.moe`.
"""

from .combine import FusedCombine, fused_combine
from .layer import MoELayer, MoEStack, expert_capacity

__all__ = ["MoELayer", "MoEStack", "FusedCombine", "fused_combine", "expert_capacity"]
