"""Budget sweeps and hand-picked strategies on one graph: the points of a Pareto picture.

>>> gm, cg = analyze(model, args)                                         # doctest: +SKIP
>>> rows = sweep_budgets(cg, ["1.0", "0.6", "0.4"]) + strategy_points(model, args, {}, cg)  # doctest: +SKIP
>>> print(format_pareto_table(rows))                                      # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from remat_compiler.api import analyze
from remat_compiler.budget import human_bytes
from remat_compiler.check import check_plan
from remat_compiler.graph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError, StrategyNotApplicableError
from remat_compiler.plan import Plan
from remat_compiler.solvers import SOLVERS, get_solver, solve
from remat_compiler.solvers.cpsat import SolveMemo
from remat_compiler.tables import format_table, note_cell

__all__ = ["ParetoRow", "sweep_budgets", "strategy_points", "hand_picked_strategies", "format_pareto_table"]


@dataclass
class ParetoRow:
    """One point of a Pareto picture, or the reason there is none.

    Attributes
    ----------
    label : str
        ``"cpsat @ 0.6"`` for sweep points, the strategy name for strategies.
    kind : str
        ``"sweep"`` or ``"strategy"``.
    budget : str
        The budget as the user wrote it (``"-"`` for strategies, which have their own peak).
    plan : Plan or None
        None when the budget is infeasible or the strategy does not apply.
    note : str
        Why there is no plan.
    """

    label: str
    kind: str
    budget: str
    plan: Plan | None = None
    note: str = ""


def sweep_budgets(cg: CostGraph, budgets: Sequence[str], *, solver: str = "cpsat",
                  time_limit_s: float | None = None,
                  progress: Callable[[str], Callable | None] | None = None) -> list[ParetoRow]:
    """Solve and check one plan per budget; infeasible budgets become rows with a note.

    Parameters
    ----------
    cg : CostGraph
    budgets : sequence of str
        Budgets in any form :func:`remat_compiler.parse_budget` accepts.
    solver : str
    time_limit_s : float, optional
        For each solve (the whole solve), for solvers that take it.
    progress : callable, optional
        ``progress(label)`` returns the progress callback for that solve (or None).

    The solves share one :class:`~remat_compiler.solvers.cpsat.SolveMemo`, so each budget starts
    from the plans of the budgets before it.

    Returns
    -------
    list[ParetoRow]

    Raises
    ------
    ValueError
        For a budget that does not parse.
    PlanCheckError
        If a solver returns a plan the simulation rejects.
    """
    rows = []
    strategy, memo = get_solver(solver), SolveMemo()
    for budget in budgets:
        label = f"{solver} @ {budget}"
        callback = progress(label) if progress else None
        try:
            plan = solve(cg, budget, strategy, **strategy.options_in(
                {"time_limit_s": time_limit_s, "progress": callback, "memo": memo}))
        except InfeasibleBudgetError as exc:
            rows.append(ParetoRow(label, "sweep", budget, note=exc.summary))
            continue
        check_plan(cg, plan)
        rows.append(ParetoRow(label, "sweep", budget, plan))
    return rows


def hand_picked_strategies() -> list[str]:
    """The solvers that are fixed rules, not searches (save_all, checkpoint_blocks, MoE strategies)."""
    return [name for name, strategy in SOLVERS.items() if not strategy.searching]


def strategy_points(model: torch.nn.Module, args: tuple, kwargs: dict | None, cg: CostGraph,
                    names: Sequence[str] | None = None) -> list[ParetoRow]:
    """Each hand-picked strategy's plan with no budget (its own peak), or why it does not apply.

    Parameters
    ----------
    model, args, kwargs :
        Needed to re-trace for strategies that prepare the model (``Strategy.prepare``).
    cg : CostGraph
        The graph of the plain trace, used by every other strategy.
    names : sequence of str, optional
        Default: :func:`hand_picked_strategies`.

    Returns
    -------
    list[ParetoRow]

    Raises
    ------
    PlanCheckError
        If a strategy's plan fails the simulation check.
    """
    rows = []
    for name in names if names is not None else hand_picked_strategies():
        graph = cg
        if get_solver(name).prepare is not None:
            _, graph = analyze(model, args, kwargs, solver=name, hold_outputs=cg.hold_outputs)
        try:
            plan = solve(graph, None, name)
        except StrategyNotApplicableError as exc:
            rows.append(ParetoRow(name, "strategy", "-", note=f"n/a: {exc}"))
            continue
        check_plan(graph, plan)
        rows.append(ParetoRow(name, "strategy", "-", plan))
    return rows


def format_pareto_table(rows: Sequence[ParetoRow], baseline_peak_bytes: int | None = None) -> str:
    """The rows as a table: budget, predicted peak, share of the no-recompute peak, overheads, status.

    Reasons longer than a table cell (why a strategy does not apply) become numbered notes under it.

    Parameters
    ----------
    rows : sequence of ParetoRow
    baseline_peak_bytes : int, optional
        The no-recompute peak; default: taken from the first row with a plan.
    """
    if baseline_peak_bytes is None:
        baseline_peak_bytes = next((r.plan.baseline_peak_bytes for r in rows if r.plan), None)
    header = ["point", "budget", "budget bytes", "predicted peak", "of no-recompute", "recompute FLOPs",
              "est. time", "status"]
    body, notes = [], []
    for r in rows:
        p = r.plan
        if p is None:
            body.append([r.label, r.budget, "-", "-", "-", "-", "-", note_cell(r.note, notes)])
            continue
        share = f"{p.peak_bytes / baseline_peak_bytes:.1%}" if baseline_peak_bytes else "-"
        status = p.status + (f" (gap {p.gap:.1%})" if p.status != "optimal" else "")
        body.append([r.label, r.budget, human_bytes(p.budget_bytes) if p.budget_bytes else "-",
                     human_bytes(p.peak_bytes), share, f"+{p.flop_overhead:.1%}",
                     f"+{p.runtime_overhead:.1%}", f"{status}, {p.solve_time_s:.2f} s"])
    return "\n".join([format_table(header, body), *notes])
