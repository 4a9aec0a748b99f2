"""The combine choice's warm start: every segment in the combine whose graph peaks lower, with a plan of
that graph under the budget, completed into a whole CP-SAT solution (:func:`hint_pure_choice`)."""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.schedule import Schedule, build_schedule, no_recompute, save_all_set, simulate
from remat_compiler.solvers.combine_choice import CombineUnion
from remat_compiler.solvers.cpsat.choice.model import Choice, ChoiceModel
from remat_compiler.solvers.cpsat.costs import cost_units
from remat_compiler.solvers.cpsat.parts import is_const
from remat_compiler.solvers.cpsat.run import make_solver, run_solver
from remat_compiler.solvers.greedy import best_heuristic_set

__all__ = ["WarmStart", "hint_pure_choice", "warm_choice"]


@dataclass
class WarmStart:
    """The warm start :func:`hint_pure_choice` hinted: one combine for every segment and the schedule
    of a saved set of its graph under the budget (a whole plan), and the fill's solver where it
    completed the hint into a CP-SAT solution (else None)."""

    mode: str
    schedule: Schedule
    filled: cp_model.CpSolver | None


def hint_pure_choice(cm: ChoiceModel, union: CombineUnion, budget_bytes: int | None = None,
                     deadline: Deadline | None = None) -> WarmStart | None:
    """Warm start: hint every segment with the combine whose graph's no-recompute peak is lower and
    a plan of that graph that fits ``budget_bytes`` (the no-recompute plan where it fits, else the
    greedy heuristics' saved set, :func:`~remat_compiler.solvers.greedy.best_heuristic_set`, in up
    to half of ``deadline``): every decision (combines, saved,
    recomputed, needed values), then the times and intervals the decisions determine, filled in by
    a solve with the decisions fixed (half of what is left of ``deadline``), so the hint is a whole
    solution: a search of many workers on few cores otherwise may not complete it, or find any
    plan, in a short time limit. Returns what was hinted (None when the heuristics found no plan
    that fits: nothing is hinted); :func:`solve_choice` returns it when the search finds no plan in
    its time."""
    deadline = deadline if deadline is not None else Deadline(1.0)
    peaks = {mode: no_recompute(cg).peak_bytes for mode, cg in union.graphs.items()}
    mode = min(peaks, key=lambda k: (peaks[k], k != "fused"))
    cg = union.graphs[mode]
    saved = save_all_set(cg)
    if budget_bytes is not None and peaks[mode] > budget_bytes:
        # half the clock at most: without a whole hint, a search of many workers on few cores often
        # finds no plan at all in a short limit (the heuristics return as soon as they are done)
        saved, _peak = best_heuristic_set(cg, budget_bytes, deadline=deadline.part(deadline.slice(0.5)))
        if saved is None:
            return None
    schedule = build_schedule(cg, saved)
    saved, recomputed = set(schedule.saved), set(schedule.recomputed)
    m = cm.model
    for var in cm.fused.values():
        m.add_hint(var, 1 if mode == "fused" else 0)
    for v, var in cm.saved.items():
        m.add_hint(var, 1 if v in saved else 0)
    for v, var in (cm.recomputed or {}).items():
        if not is_const(var):
            m.add_hint(var, 1 if v in recomputed else 0)
    for v, var in (cm.need or {}).items():
        if not is_const(var):
            m.add_hint(var, 1 if v in recomputed or v in saved else 0)
    fill = make_solver(deadline.slice(0.5), 1, deadline.deterministic)
    fill.parameters.fix_variables_to_their_hinted_value = True
    warm = WarmStart(mode, schedule, None)
    if run_solver(fill, m, deadline=deadline) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return warm
    m.clear_hints()
    for i, value in enumerate(fill.response_proto.solution):
        m.proto.solution_hint.vars.append(i)
        m.proto.solution_hint.values.append(value)
    warm.filled = fill
    return warm


def warm_choice(union: CombineUnion, cm: ChoiceModel, warm: WarmStart, objective: str,
                 solve_time_s: float) -> Choice:
    """The warm start as the choice, where CP-SAT returned no solution at all in the time: every
    segment in its combine, its saved set, the simulated peak of that graph (exact), the recompute
    cost of its plan (the pieces' communication aside), feasible with gap 1 (nothing proven)."""
    cg, schedule = union.graphs[warm.mode], warm.schedule
    cost = sum(cost_units(cg, n, objective) for n in schedule.recomputed)
    return Choice(dict.fromkeys(cm.fused, warm.mode), list(schedule.saved), simulate(cg, schedule).peak_bytes,
                  cost, "feasible", solve_time_s, 1.0 if cost else 0.0)
