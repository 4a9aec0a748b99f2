"""The experts' computation: grouped GEMMs, the SwiGLU activation, the weighted unpermute and the fused
combine step."""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from .combine import fused_combine, weighted_unpermute

__all__ = ["GroupedGEMM", "SwiGLU", "Unpermute", "FusedCombineStep"]


class GroupedGEMM(nn.Module):
    """One matmul per local expert: ``bmm([E_local, N, in], weight [E_local, in, out])``.

    Parameters
    ----------
    weight : torch.Tensor
        Initial ``[E_local, in, out]`` weights (copied into a Parameter).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.weight)


class SwiGLU(nn.Module):
    """``silu(gate) * up`` where ``gate, up`` are the two halves of the last dim."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up


class Unpermute(nn.Module):
    """``out_t = sum_k probs[t, k] * y[slot[t, k]]`` (plain autograd, saves the gathered y)."""

    def forward(self, y_tok: torch.Tensor, probs: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return weighted_unpermute(y_tok.reshape(-1, y_tok.shape[-1]), probs, slot)


class FusedCombineStep(nn.Module):
    """GEMM2 -> combine A2A -> weighted Unpermute as one :class:`FusedCombine` node (no parameters).

    Its own submodule so that the traced nodes of the fused combine carry a module path of their own
    (``remat_compiler.passes.moe`` tags them). It uses ``gemm2.weight``, passed in by the layer.
    """

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, act: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor,
                slot: torch.Tensor, route=None) -> torch.Tensor:
        return fused_combine(act, w2, probs, slot, self.group, route)
