"""Recomputation that Inductor fuses away: a plan for the Inductor backend saves no pointwise value
whose readers are all pointwise.

The planner prices a plan on the unfused graph, where saving a value costs nothing and recomputing it
costs the bytes it moves. Under Inductor the opposite holds for a pointwise value whose every reader,
forward and backward, is pointwise (GPT-2's ``gelu_new`` chain, a residual scaling): in the forward
Inductor fuses it into its readers' kernel and never writes it, unless the plan saves it, which costs a
write there and a read in the backward; recomputed, it is fused into its backward readers' kernel
from inputs that kernel reads anyway. PyTorch's min-cut partitioner recomputes such values for that
reason (``torch/_functorch/partitioners.py``: fusible ops are recomputed, reductions are not by default).

:func:`fusible_recompute` moves such values from a plan's saved set to recomputation, one at a time,
keeping each move only where the recomputation it adds is pointwise alone (never a reduction, a
matmul or a random op) and the simulated peak stays within the budget. The result is a plan like any
other: simulated, checked and emitted exactly (:func:`remat_compiler.plan.make_plan`).

>>> saved = fusible_recompute(cg, plan.saved, budget_bytes)   # doctest: +SKIP
"""
from __future__ import annotations

import torch

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule, simulate

__all__ = ["fusible_recompute", "is_pointwise"]


def _overload(op: str):
    """The aten OpOverload a cost graph's ``op`` string names (``"aten.gelu.default"``), or None."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def is_pointwise(cg: CostGraph, name: str) -> bool:
    """Whether a node is an aten op tagged pointwise (``torch.Tag.pointwise``: Inductor fuses chains
    of them into one kernel) that may be recomputed (not random, mutating or a collective)."""
    op = _overload(str(cg.attr(name, "op")))
    return op is not None and torch.Tag.pointwise in op.tags and not cg.attr(name, "never_recompute")


def fusible_recompute(cg: CostGraph, saved, budget_bytes: int | None) -> list[str]:
    """``saved`` less the pointwise values whose readers are all pointwise, where recomputing them adds
    only pointwise recomputation and keeps the simulated peak within ``budget_bytes`` (and within the
    plan's own peak when there is no budget).

    Parameters
    ----------
    cg : CostGraph
        The graph as the Inductor backend traces it.
    saved : iterable of str
        A plan's saved values.
    budget_bytes : int | None

    Returns
    -------
    list of str
        The saved values to keep, in ``saved``'s order (all of them where nothing moves).
    """
    saved = list(saved)
    base = build_schedule(cg, saved)
    limit = simulate(cg, base).peak_bytes if budget_bytes is None else budget_bytes
    recomputed = set(base.recomputed)
    keep = set(saved)
    movable = [v for v in saved if is_pointwise(cg, v) and all(is_pointwise(cg, u) for u in cg.g.successors(v))]
    for v in sorted(movable, key=lambda n: (-cg.attr(n, "bytes"), n)):  # the largest writes first
        trial = keep - {v}
        schedule = build_schedule(cg, trial)
        added = set(schedule.recomputed) - recomputed
        if not all(is_pointwise(cg, n) for n in added):
            continue
        if simulate(cg, schedule).peak_bytes > limit:
            continue
        keep, recomputed = trial, set(schedule.recomputed)
    return [v for v in saved if v in keep]
