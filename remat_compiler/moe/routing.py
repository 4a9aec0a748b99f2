"""Routing tokens to experts: the router, the capacity of each expert, and the permutations that gather
each expert's rows (with a capacity, or dropless)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


__all__ = ["expert_capacity", "Router", "Permute", "DroplessPermute"]


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert in the capacity buffer: ``ceil(tokens * top_k / num_experts * capacity_factor)``.

    Parameters
    ----------
    tokens : int
        Tokens on this rank.
    top_k : int
    num_experts : int
        Experts in total (all ranks).
    capacity_factor : float

    Returns
    -------
    int
        At least 1. An expert never receives more than ``tokens`` rows from one rank, so
        ``capacity_factor >= num_experts / top_k`` guarantees that nothing is dropped.
    """
    return max(1, math.ceil(tokens * top_k / num_experts * capacity_factor))


class Router(nn.Module):
    """Linear gate, softmax, top-k, and renormalisation of the kept probabilities.

    Parameters
    ----------
    hidden_size : int
    num_experts : int
    top_k : int

    Returns (forward)
    -----------------
    probs : torch.Tensor
        ``[T, top_k]``, each row sums to 1.
    experts : torch.Tensor
        ``[T, top_k]`` int64 expert ids (global), in descending probability order.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.linear = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor):
        scores = F.softmax(self.linear(x), dim=-1)
        probs, experts = torch.topk(scores, self.top_k, dim=-1)
        return probs / probs.sum(-1, keepdim=True), experts


class Permute(nn.Module):
    """Scatter token copies into a static ``[E, C, H]`` capacity buffer.

    Drop rule (deterministic): assignments claim rows in the order ``(k, t)`` — all first choices
    in token order, then all second choices, ... — and an assignment that finds its expert's ``C``
    rows taken is dropped (its slot is ``E * C`` and it contributes nothing to the output).

    Parameters
    ----------
    num_experts : int
        Experts in total.
    capacity_factor : float

    Returns (forward)
    -----------------
    buf : torch.Tensor
        ``[E, C, H]``, zero rows where capacity is unused.
    slot : torch.Tensor
        ``[T, top_k]`` int64 row of ``buf.view(E * C, H)`` for each assignment, ``E * C`` if dropped.
    """

    def __init__(self, num_experts: int, capacity_factor: float):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor, experts: torch.Tensor):
        tokens, top_k = experts.shape
        num_experts = self.num_experts
        capacity = expert_capacity(tokens, top_k, num_experts, self.capacity_factor)
        order = experts.t().reshape(-1)  # [K*T], k-major: index k*T + t
        onehot = (order.unsqueeze(1) == torch.arange(num_experts, device=x.device)).long()
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of the assignment in its expert
        slot = torch.where(position < capacity, order * capacity + position, num_experts * capacity)
        # Gather, not scatter: the inverse map row -> token makes the copy an index_select, whose
        # backward needs only the index (a scatter-add would save a [T*K, H] source).
        token_of = torch.arange(tokens, device=x.device).repeat(top_k)  # assignment k*T+t -> t
        source = torch.full((num_experts * capacity + 1,), tokens, device=x.device)
        source = source.scatter(0, slot, token_of)[: num_experts * capacity]  # unused rows -> T
        padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])  # row T is the zero row
        buf = padded.index_select(0, source).view(num_experts, capacity, x.shape[-1])
        return buf, slot.view(top_k, tokens).t()


class DroplessPermute(nn.Module):
    """Sort token copies by expert into ``[T * top_k, H]`` rows: nothing is dropped (``splits="uneven"``).

    Within an expert, assignments keep the order ``(k, t)`` of :class:`Permute`.

    Parameters
    ----------
    num_experts : int
        Experts in total.

    Returns (forward)
    -----------------
    rows : torch.Tensor
        ``[T * top_k, H]``: expert 0's rows, then expert 1's, ...
    slot : torch.Tensor
        ``[T, top_k]`` int64 row of ``rows`` holding each assignment.
    counts : torch.Tensor
        ``[E]`` int64 rows per expert.
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor, experts: torch.Tensor):
        tokens, top_k = experts.shape
        order = experts.t().reshape(-1)  # [K*T], k-major: index k*T + t
        onehot = (order.unsqueeze(1) == torch.arange(self.num_experts, device=x.device)).long()
        counts = onehot.sum(0)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of the assignment in its expert
        first = counts.cumsum(0) - counts  # each expert's first row
        slot = first.index_select(0, order) + position  # a permutation of 0 .. K*T - 1
        token_of = torch.arange(tokens, device=x.device).repeat(top_k)  # assignment k*T+t -> t
        source = torch.empty_like(token_of).scatter(0, slot, token_of)  # row -> its token (a gather)
        return x.index_select(0, source), slot.view(top_k, tokens).t(), counts
