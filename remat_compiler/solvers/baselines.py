"""Hand-picked strategies as solvers: no recomputation, and checkpointing every repeated block."""
from __future__ import annotations

import time

from remat_compiler.errors import StrategyNotApplicableError, StrategyOverBudgetError
from remat_compiler.graph import CostGraph, block_boundary_set
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import save_all_set

__all__ = ["solve_save_all", "solve_checkpoint_blocks", "fixed_plan"]


def fixed_plan(cg: CostGraph, saved, budget_bytes: int | None, name: str, t0: float, rerun=()) -> Plan:
    """A plan whose saved set (and reruns) are fixed by a rule; raises StrategyOverBudgetError if it
    does not fit the budget."""
    plan = make_plan(cg, saved, budget_bytes=budget_bytes, solver=name, status="optimal",
                     solve_time_s=time.perf_counter() - t0, rerun=rerun)
    if budget_bytes is not None and plan.peak_bytes > budget_bytes:
        raise StrategyOverBudgetError(name, budget_bytes, plan.peak_bytes)
    return plan


def solve_save_all(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """Save every value backward reads; recompute nothing (the step without rematerialization).

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int | None
        Checked, not optimised for: raises if the plan's peak is above it.
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, save_all_set(cg), budget_bytes, "save_all", t0)


def solve_checkpoint_blocks(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """Save only each repeated block's output (= the next block's input); recompute inside blocks.

    This is ``torch.utils.checkpoint`` around every block, placed by hand, as a solver.

    Raises
    ------
    StrategyNotApplicableError
        If the model has no repeated blocks.
    """
    t0 = time.perf_counter()
    saved = block_boundary_set(cg)
    if saved is None:
        raise StrategyNotApplicableError(
            "checkpoint_blocks needs repeated child modules (an nn.ModuleList or nn.Sequential of "
            "layers); this model has none — use solver='cpsat'")
    return fixed_plan(cg, saved, budget_bytes, "checkpoint_blocks", t0)
