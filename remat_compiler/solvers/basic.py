"""Hand-picked strategies as solvers: no recomputation, and checkpointing every repeated block."""
from __future__ import annotations

import time

from remat_compiler.costgraph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import save_all_set

__all__ = ["solve_save_all", "solve_checkpoint_blocks", "fixed_plan", "StrategyOverBudgetError"]


def fixed_plan(cg: CostGraph, saved, budget_bytes: int | None, name: str, t0: float) -> Plan:
    """A plan whose saved set is fixed by a rule; raises if it does not fit the budget."""
    plan = make_plan(cg, saved, budget_bytes=budget_bytes, solver=name, status="optimal",
                     solve_time_s=time.perf_counter() - t0)
    if budget_bytes is not None and plan.peak_bytes > budget_bytes:
        raise StrategyOverBudgetError(name, budget_bytes, plan.peak_bytes)
    return plan


class StrategyOverBudgetError(InfeasibleBudgetError):
    """A hand-picked strategy's fixed plan peaks above the budget."""

    def __init__(self, name: str, budget_bytes: int, peak_bytes: int):
        super().__init__(budget_bytes, peak_bytes)
        self.args = (f"strategy {name} peaks at {peak_bytes} bytes, above the budget {budget_bytes}; "
                     f"its smallest feasible budget is {peak_bytes} bytes (use solver='cpsat' to "
                     f"search all plans)",)


def solve_save_all(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """Save every value backward reads; recompute nothing (the step without rematerialization).

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int | None
        Checked, not optimised for: raises if the plan's peak is above it.
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, save_all_set(cg), budget_bytes, "save_all", t0)


def block_boundary_set(cg: CostGraph) -> list[str]:
    """Saved set of classic per-block checkpointing: everything outside blocks, and block outputs."""
    if not cg.g.graph.get("block_container") and not any(cg.attr(n, "block") for n in cg.fw_order):
        raise ValueError("checkpoint_blocks needs repeated child modules (an nn.ModuleList or "
                         "nn.Sequential of layers); this model has none — use solver='cpsat'")
    keep = []
    for n in cg.candidates:
        block = cg.attr(n, "block")
        if block is None or cg.attr(n, "never_recompute"):
            keep.append(n)
            continue
        # a block's output: read by a node outside this block (the next block, the head, backward
        # nodes of other blocks do not count: only forward readers define the block boundary)
        readers = [u for u in cg.g.successors(n) if cg.attr(u, "phase") == "fw"]
        stack = list(readers)
        seen = set()
        while stack:  # look through views and getitems to the real readers
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            if cg.storage(u) == n:
                stack.extend(w for w in cg.g.successors(u) if cg.attr(w, "phase") == "fw")
            elif cg.attr(u, "block") != block:
                keep.append(n)
                break
        else:
            if n in {cg.storage(o) for o in cg.fw_outputs if o}:
                keep.append(n)
    return keep


def solve_checkpoint_blocks(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """Save only each repeated block's output (= the next block's input); recompute inside blocks.

    This is ``torch.utils.checkpoint`` around every block, placed by hand, as a solver.
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, block_boundary_set(cg), budget_bytes, "checkpoint_blocks", t0)
