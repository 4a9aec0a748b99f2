"""Solvers: every one is ``solve_<name>(cost_graph, budget_bytes, **opts) -> Plan``.

Hand-picked strategies (``save_all``, ``checkpoint_blocks`` and the MoE strategies) are solvers too, so
they are compared with CP-SAT on the same footing and checked by the same :func:`check_plan`.
"""
from __future__ import annotations

from typing import Callable

from remat_compiler.budget import Budget, parse_budget
from remat_compiler.costgraph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.schedule import build_schedule, save_all_set, simulate
from remat_compiler.solvers.basic import solve_checkpoint_blocks, solve_save_all
from remat_compiler.solvers.cpsat import solve_cpsat
from remat_compiler.solvers.greedy import solve_greedy

__all__ = ["SOLVERS", "solve", "get_solver", "register_solver", "resolve_budget", "solve_save_all",
           "solve_checkpoint_blocks", "solve_cpsat", "solve_greedy"]

SOLVERS: dict[str, Callable[..., Plan]] = {
    "cpsat": solve_cpsat,
    "save_all": solve_save_all,
    "checkpoint_blocks": solve_checkpoint_blocks,
    "greedy": solve_greedy,
}


def register_solver(name: str, fn: Callable[..., Plan]) -> None:
    """Make ``fn`` (with the solver signature) available by name."""
    SOLVERS[name] = fn


def get_solver(solver: str | Callable[..., Plan]) -> Callable[..., Plan]:
    """Look a solver up by name, or accept a callable with the solver signature.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    if callable(solver):
        return solver
    _load_optional()
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; known solvers: {', '.join(sorted(SOLVERS))}, "
                         f"or pass a callable solve(cost_graph, budget_bytes, **opts) -> Plan")
    return SOLVERS[solver]


def _load_optional() -> None:
    try:  # MoE strategies register themselves when their module is present
        import remat_compiler.moe.strategies  # noqa: F401
    except ImportError:
        pass


def resolve_budget(cg: CostGraph, budget) -> int | None:
    """Turn a budget (bytes, unit string, fraction or None) into bytes for this graph."""
    b = budget if isinstance(budget, Budget) else parse_budget(budget)
    if b.fraction is None:
        return b.bytes
    baseline = simulate(cg, build_schedule(cg, save_all_set(cg))).peak_bytes
    return b.resolve(baseline)


def solve(cg: CostGraph, budget, solver: str | Callable[..., Plan] = "cpsat", **opts) -> Plan:
    """Resolve the budget and run a solver: the pipeline's ``solve`` step."""
    return get_solver(solver)(cg, resolve_budget(cg, budget), **opts)
