"""Expert-parallel MoE layer and its fused combine (GEMM2 -> A2A -> weighted Unpermute).

See ``shared/DESIGN.md``, section "MoE segment".
"""

from .combine import FusedCombine, fused_combine
from .layer import MoELayer, MoEStack, expert_capacity

__all__ = ["MoELayer", "MoEStack", "FusedCombine", "fused_combine", "expert_capacity"]
