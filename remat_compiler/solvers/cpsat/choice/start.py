"""The combine choice's warm start as a record (:class:`WarmStart`, hinted by
:func:`~remat_compiler.solvers.cpsat.choice.hint_pure_choice`), and as the choice itself where CP-SAT
returned no solution in its time (:func:`warm_choice`)."""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat_compiler.schedule import Schedule, simulate
from remat_compiler.solvers.combine_choice import CombineUnion
from remat_compiler.solvers.cpsat.choice.model import Choice, ChoiceModel
from remat_compiler.solvers.cpsat.costs import cost_units

__all__ = ["WarmStart", "warm_choice"]


@dataclass
class WarmStart:
    """The warm start :func:`hint_pure_choice` hinted: one combine for every segment and the schedule
    of a saved set of its graph under the budget (a whole plan), and the fill's solver where it
    completed the hint into a CP-SAT solution (else None)."""

    mode: str
    schedule: Schedule
    filled: cp_model.CpSolver | None


def warm_choice(union: CombineUnion, cm: ChoiceModel, warm: WarmStart, objective: str,
                 solve_time_s: float) -> Choice:
    """The warm start as the choice, where CP-SAT returned no solution at all in the time: every
    segment in its combine, its saved set, the simulated peak of that graph (exact), the recompute
    cost of its plan (the pieces' communication aside), feasible with gap 1 (nothing proven)."""
    cg, schedule = union.graphs[warm.mode], warm.schedule
    cost = sum(cost_units(cg, n, objective) for n in schedule.recomputed)
    return Choice(dict.fromkeys(cm.fused, warm.mode), list(schedule.saved), simulate(cg, schedule).peak_bytes,
                  cost, "feasible", solve_time_s, 1.0 if cost else 0.0)
