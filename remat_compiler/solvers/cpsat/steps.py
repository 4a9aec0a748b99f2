"""The steps of :func:`~remat_compiler.solvers.cpsat.solve_cpsat` after the warm start, each on its
share of the job's one clock: below the floor first, the model, the search, below the floor after
it, the peak at the cost found, and the plan."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from remat_compiler.clock import MIN_SLICE_S
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import build_schedule, no_recompute, peak_of
from remat_compiler.solvers.cpsat.costs import flops_status
from remat_compiler.solvers.cpsat.lp import lp_bound
from remat_compiler.solvers.cpsat.minpeak import Floor, lowest_peak
from remat_compiler.solvers.cpsat.model import RematModel, build_model, hint
from remat_compiler.solvers.cpsat.run import Job, Progress
from remat_compiler.solvers.cpsat.warmstart import Seed

__all__ = ["Found", "NotFound", "SHARES", "infeasible", "floor_first", "formulate", "search", "below_floor", "peak_at_cost", "finish"]

#: The shares of the time limit T (or of what is left of it) the steps take.
SHARES = {
    "floor_first": 0.85,  # of what is left: the lowest-peak search when no warm start fits
    "lp": 0.2,            # of T, at most LP_CAP_S: the LP relaxation's bound
    "search": 0.8,        # of T, less what is spent: the cost search when a peak solve follows
    "peak": 0.25,         # of T: the peak-minimising second solve...
    "finish": 0.05,       # ...which leaves this share of T for building the plan
    "floor_unknown": 0.6,  # of what is left: the lowest-peak search after a search that found nothing
}
LP_CAP_S = 5.0


@dataclass
class Found:
    """A plan found and what is known of it, the costs in the objective's units.

    ``final``: no peak-minimising solve follows (a lowest-peak plan kept as the answer).
    """

    saved: set[str]
    cost: int
    bound: float
    model_peak: int
    optimal: bool
    rerun: list[tuple[str, int]] = field(default_factory=list)
    final: bool = False
    search_s: float | None = None  # how long the cost search ran, when it ran

    @property
    def gap(self) -> float:
        """The proven relative gap of the cost."""
        if self.optimal or self.cost == 0:
            return 0.0
        return max(0.0, (self.cost - self.bound) / self.cost)


@dataclass
class NotFound:
    """A search that found no plan: CP-SAT's status (INFEASIBLE or UNKNOWN) and its cost bound."""

    status: int
    bound: float


def infeasible(job: Job, floor: Floor) -> InfeasibleBudgetError:
    """The error for a budget below the floor found, carrying the plan that reaches the floor: a later
    search in its own time limit may not find that plan again, so the error's advice is to apply it
    (``plan=exc.plan``)."""
    plan = make_plan(job.cg, floor.saved, budget_bytes=floor.peak, solver="cpsat", status="feasible",
                     rerun=floor.rerun, min_feasible_bytes=floor.peak)
    if plan.peak_bytes != floor.peak:  # the floor's peak is a simulation of this plan: never differs
        raise RuntimeError(f"the lowest-peak plan simulates at {plan.peak_bytes}, not its floor {floor.peak}")
    return InfeasibleBudgetError(job.budget_bytes, floor.peak, proven=floor.proven, plan=plan)


def floor_first(job: Job) -> tuple[Floor, set[str] | None]:
    """No warm start fits, so the budget may lie below every plan's peak: find that floor first
    (rather than after a cost search that cannot succeed). Returns it and its plan if the plan
    fits the budget.

    Raises
    ------
    InfeasibleBudgetError
        If the floor is above the budget and no plan with reruns met before fits it.
    """
    floor = lowest_peak(job.with_deadline(job.deadline.part(SHARES["floor_first"] * job.deadline.slice())))
    fits = job.reruns and job.memo.rerun_plans(job.cg, job.complies, job.budget_bytes)
    if floor.peak > job.budget_bytes and not fits:
        raise infeasible(job, floor)
    return floor, (set(floor.saved) if peak_of(job.cg, floor.saved) <= job.budget_bytes else None)


def formulate(job: Job, start: Seed) -> tuple[RematModel, float | None]:
    """The model, hinted with the warm start, and a lower bound on its cost (model units): the
    LP relaxation's where something must be recomputed, raised to the block decomposition's."""
    rm = job.cost_model()
    if start.saved is not None:
        hint(rm, job.cg, start.saved)
    needs_recompute = job.budget_bytes is not None and no_recompute(job.cg).peak_bytes > job.budget_bytes
    T = job.deadline.seconds
    relaxed = lp_bound(rm, job.deadline.slice(cap=min(LP_CAP_S, SHARES["lp"] * T))) if needs_recompute else None
    if start.bound is not None and math.isfinite(start.bound):
        relaxed = max(relaxed or 0.0, start.bound / rm.cost_gcd)
    return rm, relaxed


def search(job: Job, rm: RematModel, start: Seed, relaxed: float | None, progress: Progress | None,
           share: float) -> Found | NotFound:
    """The cost search from the warm start, on ``share`` of the time limit less what is spent.

    When the decomposition's plan meets its bound (up to a few tie-break units outside the blocks)
    a search could not improve it meaningfully, so it stands for the search's result.
    """
    g = rm.cost_gcd
    if start.decomposed and relaxed is not None:
        cost = job.cost(start.saved) // g
        if job.meets(cost, relaxed, g):
            found = _known(job, start.saved, relaxed * g, optimal=relaxed >= cost)
            if progress is not None:
                progress.report(found.cost // g, relaxed)
            return found
    seconds = max(MIN_SLICE_S, share * job.deadline.seconds - job.deadline.elapsed())
    t0 = job.deadline.wall_elapsed()
    status, solver = job.solve(rm.model, seconds, callback=progress, gap_units=job.gap_units(g))
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = _solved(rm, solver, status, relaxed, proven_only=job.tolerance > 0)
        found.search_s = job.deadline.wall_elapsed() - t0
        return found
    if status == cp_model.UNKNOWN and start.saved is not None:
        # CP-SAT stopped before reaching the hinted plan (a big graph's presolve): that plan fits
        bound = max(solver.best_objective_bound, relaxed or 0.0)
        found = _known(job, start.saved, bound * g, optimal=False)
        if progress is not None:  # no solution came through the callback: report the one kept
            progress.report(found.cost // g, bound)
        return found
    return NotFound(status, solver.best_objective_bound if status == cp_model.UNKNOWN else 0.0)


def below_floor(job: Job, rm: RematModel, missed: NotFound, floor: Floor | None, relaxed: float | None,
                progress: Progress | None) -> Found:
    """The cost search found no plan: find the lowest-peak plan; it names the smallest budget, or
    seeds a second search. Below what CP-SAT's model reaches, only plans that recompute a value more
    than once fit.

    Raises
    ------
    InfeasibleBudgetError
        If no plan met fits the budget.
    """
    cg, budget, clock = job.cg, job.budget_bytes, job.deadline
    status, cp_bound = missed.status, missed.bound
    if floor is None:
        floor = lowest_peak(job.with_deadline(clock.part(
            clock.slice(SHARES["floor_unknown"] if status == cp_model.UNKNOWN else 1.0))))
    # A budget named by an earlier search (another solve) may need the rerun plan that search met:
    # look again from other CP-SAT seeds before calling the budget infeasible.
    for seed in (1, 2):
        if not job.reruns or budget is None or not 0.9 * floor.peak <= budget < floor.peak \
                or clock.left() < 2 * MIN_SLICE_S:
            break
        other = lowest_peak(job.with_deadline(clock.part(clock.slice() / 2)), seed=seed)
        if other.peak < floor.peak:
            floor = other
    fitting = [(S, list(R)) for _p, S, R in job.memo.rerun_plans(cg, job.complies, budget)] \
        if job.reruns and budget is not None else []
    if budget is not None and floor.peak > budget and not fitting:
        raise infeasible(job, floor)
    single_fits = budget is None or peak_of(cg, floor.saved) <= budget
    if status != cp_model.INFEASIBLE and single_fits:  # CP-SAT again, from the lowest-peak plan
        rm = build_model(cg, budget, forced_saved=job.forced_saved, forbidden_saved=job.forbidden_saved,
                         objective=job.objective)
        hint(rm, cg, floor.saved)
        status, solver = job.solve(rm.model, clock.slice(), callback=progress)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return _solved(rm, solver, status, relaxed)
    # keep the cheapest lowest-peak plan
    options = fitting + ([(floor.saved, [])] if single_fits else [])
    if not options and job.complies(floor.saved) and peak_of(cg, floor.saved, floor.rerun) <= budget:
        options = [(floor.saved, list(floor.rerun))]  # the floor's own reruns, not yet in the memo
    if not options:
        raise infeasible(job, floor)
    saved, rerun = min(options, key=lambda p: job.cost(p[0], p[1]))
    return Found(set(saved), job.cost(saved, rerun), cp_bound * rm.cost_gcd, peak_of(cg, saved, rerun),
                 optimal=False, rerun=list(rerun), final=True)


def peak_at_cost(job: Job, found: Found, build_s: float) -> Found:
    """Among plans of the cost found, the one with the least peak (so a larger budget never gives a
    plan with a larger peak for nothing), if there is time to build its model and search."""
    T = job.deadline.seconds
    reserve = SHARES["finish"] * T  # kept for building the plan after the last solve
    if job.deadline.left() <= 2 * build_s + reserve + 0.5:
        return found
    rm = build_model(job.cg, job.budget_bytes, minimize="peak", max_cost=found.cost,
                     forced_saved=job.forced_saved, forbidden_saved=job.forbidden_saved, objective=job.objective)
    hint(rm, job.cg, found.saved)
    seconds = max(MIN_SLICE_S, min(job.deadline.left() - reserve, SHARES["peak"] * T))
    if job.tolerance > 0:  # a search stopped within tolerance: the tie-break takes no longer than it did
        seconds = min(seconds, max(MIN_SLICE_S, found.search_s or 0.0))
    status, solver = job.solve(rm.model, seconds, relative_gap=job.tolerance)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found.saved = {v for v, var in rm.saved.items() if solver.value(var)}
        found.model_peak = solver.value(rm.peak) * rm.unit_bytes
    return found


def finish(job: Job, found: Found, solver_name: str) -> Plan:
    """The plan of what was found; under ``objective="flops"`` its status and gap are those of the
    counted FLOPs alone (:func:`~.costs.flops_status`)."""
    cg = job.cg
    status = "optimal" if found.optimal else "feasible"
    gap = found.gap
    extras = {"cost_units": found.cost, "cost_bound_units": found.bound, "objective": job.objective}
    if job.tolerance > 0:
        extras["tolerance"] = job.tolerance
    if job.objective == "flops":
        status, gap, more = flops_status(cg, build_schedule(cg, found.saved, found.rerun).recomputed, status,
                                         gap, found.bound)
        extras.update(more)
    plan = make_plan(cg, found.saved, budget_bytes=job.budget_bytes, solver=solver_name, status=status,
                     gap=gap, solve_time_s=job.deadline.wall_elapsed(), model_peak_bytes=found.model_peak,
                     baseline_peak_bytes=no_recompute(cg).peak_bytes, rerun=found.rerun, extras=extras)
    if not found.final:
        job.memo.remember(cg, plan.saved, plan.peak_bytes)
    return plan


def _solved(rm: RematModel, solver: cp_model.CpSolver, status: int, relaxed: float | None, *,
            proven_only: bool = False) -> Found:
    """The plan CP-SAT returned, with its cost and the best bound known (model units times the gcd).
    ``proven_only``: the search stopped at a gap limit, where CP-SAT's OPTIMAL means only "within
    it": the plan is optimal where the bound meets the cost."""
    cost = int(round(solver.objective_value))
    bound = max(solver.best_objective_bound, relaxed or 0.0)
    return Found({v for v, var in rm.saved.items() if solver.value(var)}, cost * rm.cost_gcd,
                 bound * rm.cost_gcd, solver.value(rm.peak) * rm.unit_bytes,
                 optimal=(status == cp_model.OPTIMAL and not proven_only) or bound >= cost)


def _known(job: Job, saved, bound: float, *, optimal: bool) -> Found:
    """A plan found before the search (a warm start), with a bound from elsewhere."""
    saved = set(build_schedule(job.cg, saved).saved)
    return Found(saved, job.cost(saved), bound, peak_of(job.cg, saved), optimal=optimal)
