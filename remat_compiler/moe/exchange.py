"""The all-to-alls of expert parallelism: equal splits (:class:`AllToAll`) and uneven ones
(:class:`UnevenDispatch`, :class:`UnevenCombine`)."""
from __future__ import annotations

import math

import torch
from torch import nn

from ._dist import expert_to_token, group_world_size, token_to_expert
from ._uneven import all_gather_counts, dropless_route, experts_to_rows, rows_to_experts

__all__ = ["AllToAll", "UnevenDispatch", "UnevenCombine"]


class AllToAll(nn.Module):
    """Differentiable all-to-all between the token side ``[E, C, ...]`` and the expert side.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        Identity when None or of size 1.
    to_experts : bool
        True for dispatch (``[E, C, ...] -> [E_local, world*C, ...]``), False for combine.
    """

    def __init__(self, group, to_experts: bool):
        super().__init__()
        self.group = group
        self.to_experts = to_experts

    def forward(self, buf: torch.Tensor) -> torch.Tensor:
        if self.to_experts:
            return token_to_expert(buf, self.group)
        return expert_to_token(buf, self.group)

    def extra_repr(self) -> str:
        return f"to_experts={self.to_experts}, world={group_world_size(self.group)}"


class UnevenDispatch(nn.Module):
    """Dropless dispatch: exchange the routed row counts, then the rows, with uneven splits.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        No communication when None or of size 1.
    num_experts : int
    capacity_factor : float
        Each expert holds ``N = world * C`` rows, ``C = ceil(T * top_k / E * capacity_factor)``.

    Returns (forward of ``rows [T*top_k, H]``, ``counts [E]``)
    -----------------------------------------------------------
    buf : torch.Tensor
        ``[E_local, N, H]`` expert side, zero rows where unused.
    route : Route
        How the rows moved (for the combine, and for the backward).

    Raises (forward)
    ----------------
    ExpertCapacityError
        On every rank, before any row is exchanged, if an expert is routed more than ``N`` rows.
    """

    def __init__(self, group, num_experts: int, capacity_factor: float):
        super().__init__()
        self.group = group
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def rows_per_expert(self, rows: int) -> int:
        """``N = world * C`` for ``rows = T * top_k`` rows on each rank."""
        capacity = max(1, math.ceil(rows / self.num_experts * self.capacity_factor))
        return group_world_size(self.group) * capacity

    def forward(self, rows: torch.Tensor, counts: torch.Tensor):
        everyone = all_gather_counts(counts, self.group)  # [world, E], identical on every rank
        route = dropless_route(everyone, self.group, self.rows_per_expert(rows.shape[0]))
        return rows_to_experts(rows, route, self.group), route

    def extra_repr(self) -> str:
        return f"world={group_world_size(self.group)}, uneven splits"


class UnevenCombine(nn.Module):
    """Dropless combine: the expert side ``[E_local, N, H]`` back to the token side ``[T*top_k, H]``."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, buf: torch.Tensor, route, rows: int) -> torch.Tensor:
        return experts_to_rows(buf, route, self.group, rows)

    def extra_repr(self) -> str:
        return f"world={group_world_size(self.group)}, uneven splits"
