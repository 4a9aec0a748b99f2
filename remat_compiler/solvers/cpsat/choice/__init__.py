"""One CP-SAT model that also chooses each MoE segment's combine (autograd or fused): MoELayers' and
transformers MoE blocks' alike (:mod:`~remat_compiler.solvers.combine_choice`).

The model is :mod:`.model`'s (save / recompute decisions, one cumulative of live intervals on the
simulator's node-level time axis) over the *union* backward of a
:class:`~remat_compiler.solvers.combine_choice.CombineUnion`: the shared backward nodes, and at each
segment's place both its autograd piece and then its fused piece. One Boolean per segment,
``fused[s]``, is the presence of everything its fused piece does and the absence of everything its
autograd piece does:

- the backward values a piece allocates are optional intervals (times from that mode's no-recompute
  simulation, mapped onto the union's steps), present with the piece;
- a value the rest of the backward makes and a piece reads (the segment's output gradient ``G``) is
  live to its last reader in the chosen piece: one optional interval per mode;
- a forward value a piece reads (only the autograd piece reads the gathered expert output y) is
  needed, and its last read and the step it is recomputed at are bounded, only when the piece is
  present (``need``, ``last`` and ``first`` take the read under the piece's literal).

Each piece's own memory is in those intervals, collective buffers included; what its collectives
cost to run is in the objective (:func:`piece_comm_units`: the chosen piece's above the other's,
for the fused piece under expert parallelism its two small all-to-alls).

The absent piece's steps then run nothing: what is live across them is live at the next present
node too, so the cumulative's peak is the simulated peak of the graph traced with the chosen
combines; the peak variable bounds it, tightly once the peak stage is optimal (``check_plan``
holds the plan to it). One case is bounded rather than exact: a value
outside the pieces that the pieces of two segments read is live to the later of its ends in every
choice (an MoELayer stack has none: each segment's pieces read only its own output gradient). The
objective is the recompute cost, then the peak, in two stages of one clock (:func:`solve_choice`),
warm-started with the lower of the two combines' no-recompute plans where it fits
(:func:`hint_pure_choice`).
Reruns and the block decomposition of :func:`~remat_compiler.solvers.cpsat.solve_cpsat` are
not used here.
"""
from __future__ import annotations

import time

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.solvers.combine_choice import CombineUnion
from remat_compiler.solvers.cpsat.choice.model import (Choice, ChoiceModel, build_choice_model, piece_comm_units,
                                                       union_steps)
from remat_compiler.solvers.cpsat.choice.reasons import reasons
from remat_compiler.solvers.cpsat.choice.start import WarmStart, warm_choice
from remat_compiler.schedule import build_schedule, no_recompute, save_all_set
from remat_compiler.solvers.cpsat.costs import check_tolerance, tolerance_units
from remat_compiler.solvers.cpsat.parts import is_const
from remat_compiler.solvers.cpsat.run import make_solver, run_solver
from remat_compiler.solvers.greedy import best_heuristic_set

__all__ = ["Choice", "ChoiceModel", "WarmStart", "union_steps", "build_choice_model", "piece_comm_units",
           "hint_pure_choice", "solve_choice", "reasons"]


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


def solve_choice(union: CombineUnion, budget_bytes: int | None, *, time_limit_s: float = 30.0,
                 num_workers: int | None = None, objective: str = "runtime", deterministic: bool = False,
                 deadline: Deadline | None = None, tolerance: float = 0.0) -> Choice:
    """Choose every segment's combine and the saved set in one CP-SAT model, solved in two stages
    on one clock: the least recompute cost, then (``cost <= best``, hinted with the first stage's
    solution) the least peak at it. (One lexicographic objective ``cost * (peak_hi + 1) + peak``
    overflows int64 at real sizes.)

    Parameters
    ----------
    union : CombineUnion
    budget_bytes : int | None
    time_limit_s : float
        Both stages together (ignored with ``deadline``).
    num_workers : int, optional
    objective : "runtime" | "flops"
    deterministic : bool
        On CP-SAT's deterministic time (a deterministic ``deadline``'s, else a new one of
        ``time_limit_s``), as :func:`~remat_compiler.solvers.cpsat.solve_cpsat` takes it: the warm
        start's heuristics run to their end and the same union and budget give the same choice on
        every run and machine, whatever its load.
    deadline : Deadline, optional
        The clock to take the stages' time from (default: a new one of ``time_limit_s``).
    tolerance : float
        As :func:`~remat_compiler.solvers.cpsat.solve_cpsat` takes it: the cost stage stops once
        proven within this fraction of the step's estimated cost (the autograd graph's) of the
        best choice, and the peak stage within this fraction of the least peak.

    Returns
    -------
    Choice
        Its status and gap are the cost stage's (the peak only breaks ties).

    Raises
    ------
    InfeasibleBudgetError
        If no choice of combines and saved set was found under the budget (none fits, or none was
        found in time). Its smallest feasible budget is not searched (it names the budget itself,
        unproven): :func:`remat_compiler.combines.choose_combines` then plans the model as it is, with
        :func:`~remat_compiler.solvers.cpsat.solve_cpsat`'s reruns and lowest-peak search.
    RuntimeError
        If CP-SAT calls the model invalid (a bug here, never a budget that does not fit).
    """
    t0 = time.perf_counter()
    deadline = deadline if deadline is not None else Deadline(time_limit_s, deterministic=deterministic)
    deterministic = deadline.deterministic
    cm = build_choice_model(union, budget_bytes, objective=objective)
    warm = hint_pure_choice(cm, union, budget_bytes, deadline)
    tolerance = check_tolerance(tolerance)
    solver = make_solver(deadline.slice(0.8), num_workers, deterministic=deterministic,
                         absolute_gap=tolerance_units(union.graphs["autograd"], objective, tolerance))
    status = _checked(run_solver(solver, cm.model, deadline=deadline), cm.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE or warm is None:
            raise InfeasibleBudgetError(budget_bytes or 0, budget_bytes or 0, proven=False,
                                        advice="or solver='moe_cpsat' / 'cpsat' on one combine to find the "
                                               "smallest")
        if warm.filled is None:  # not even the fill finished: the warm start's own plan
            return warm_choice(union, cm, warm, objective, time.perf_counter() - t0)
        # no plan found in time: the warm start is a whole plan under the budget, a feasible one
        bound, solver, status = solver.best_objective_bound, warm.filled, cp_model.FEASIBLE
    else:
        bound = solver.best_objective_bound
    best = int(solver.value(cm.cost))
    if tolerance > 0 and bound < best:  # stopped within the tolerance: OPTIMAL says only that
        status = cp_model.FEASIBLE
    gap = 0.0 if status == cp_model.OPTIMAL or best == 0 else min(1.0, max(0.0, best - bound) / best)
    found = solver
    if not isinstance(cm.cost, int):  # some value costs something: the least peak at the least cost
        cm.model.add(cm.cost <= best)
        cm.model.clear_hints()
        for i, value in enumerate(solver.response_proto.solution):
            cm.model.proto.solution_hint.vars.append(i)
            cm.model.proto.solution_hint.values.append(value)
        cm.model.minimize(cm.peak)
        second = make_solver(deadline.slice(), num_workers, deterministic=deterministic, relative_gap=tolerance)
        if _checked(run_solver(second, cm.model, deadline=deadline), cm.model) in (cp_model.OPTIMAL,
                                                                                      cp_model.FEASIBLE):
            found = second
    modes = {seg: "fused" if found.boolean_value(b) else "autograd" for seg, b in cm.fused.items()}
    saved = [v for v, var in cm.saved.items() if found.value(var)]
    return Choice(modes, saved, found.value(cm.peak) * cm.unit_bytes, int(found.value(cm.cost)),
                  "optimal" if status == cp_model.OPTIMAL else "feasible", time.perf_counter() - t0, gap)


def _checked(status: int, model: cp_model.CpModel) -> int:
    """``status``, unless CP-SAT found the model invalid: then RuntimeError naming why (never
    treated as a budget that does not fit)."""
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"the combine-choice CP-SAT model is invalid: {model.validate() or 'MODEL_INVALID'}; "
                           "plan with solver='moe_cpsat' (the fused combine everywhere) meanwhile")
    return status
