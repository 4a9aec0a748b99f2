"""The smallest feasible budget: the lowest peak of any plan, and the plan that reaches it.

CP-SAT finds the lowest-peak plan that recomputes each value at most once; with reruns,
:func:`~.rerun.lower_peak` then recomputes values again where that lowers the peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from remat_compiler.clock import MIN_SLICE_S, Deadline
from remat_compiler.graph import CostGraph, block_boundary_set
from remat_compiler.schedule import peak_of, rerunnable
from remat_compiler.solvers.cpsat.memo import SolveMemo
from remat_compiler.solvers.cpsat.model import RematModel, build_model, exclude, hint
from remat_compiler.solvers.cpsat.rerun import lower_peak
from remat_compiler.solvers.cpsat.run import Job
from remat_compiler.solvers.greedy import greedy_saved_set

__all__ = ["Floor", "lowest_peak", "min_feasible_peak"]

#: CP-SAT's share of the time when reruns follow (the rest lowers its plans with reruns)
CP_SHARE_WITH_RERUNS = 0.7


@dataclass
class Floor:
    """The lowest peak found (bytes), whether it is proven minimal, and the plan reaching it."""

    peak: int
    proven: bool
    saved: list[str]
    rerun: list[tuple[str, int]] = field(default_factory=list)


def min_feasible_peak(cg: CostGraph, *, time_limit_s: float = 30.0, num_workers: int | None = None,
                      deterministic: bool = False, forced_saved=(), forbidden_saved=(), reruns: bool = True,
                      seed: int = 0, memo: SolveMemo | None = None
                      ) -> tuple[int, bool, list[str], list[tuple[str, int]]]:
    """The smallest feasible budget: the least peak of any plan (bytes) that saves ``forced_saved``
    and none of ``forbidden_saved``, whether that is proven optimal, and the plan reaching it (saved
    set and reruns). ``time_limit_s`` bounds the whole call (plus :data:`~remat_compiler.clock.MIN_SLICE_S`
    per phase at worst); ``memo`` offers the plans earlier solves on the graph found, and keeps
    this one's. See :func:`lowest_peak`."""
    job = Job(cg, None, "runtime", Deadline(time_limit_s, deterministic=deterministic),
              memo if memo is not None else SolveMemo(), tuple(forced_saved), tuple(forbidden_saved),
              num_workers, reruns)
    floor = lowest_peak(job, seed=seed)
    return floor.peak, floor.proven, floor.saved, floor.rerun


def lowest_peak(job: Job, *, seed: int = 0) -> Floor:
    """The lowest-peak plan for ``job`` (its budget is ignored), on the job's clock.

    "Proven" means CP-SAT proved its optimum over the plans searched: without reruns, plans that
    recompute each value once; with them, only where no value of the graph can be recomputed twice
    (reruns are searched locally, so where they exist there is no proof). Which plans reruns start
    from depends on the solutions CP-SAT meets, so ``seed`` (CP-SAT's random seed) varies the
    search; every plan found goes into the job's memo.
    """
    cg, clock = job.cg, job.deadline
    rm = build_model(cg, None, minimize="peak", forced_saved=job.forced_saved,
                     forbidden_saved=job.forbidden_saved)
    start = _start(job)
    hint(rm, cg, start)
    share = CP_SHARE_WITH_RERUNS if job.reruns and not job.deterministic else 1.0
    collect = _Collect(rm.saved)
    seconds = max(MIN_SLICE_S, share * clock.seconds - clock.elapsed())
    status, solver = job.solve(rm.model, seconds, callback=collect, seed=seed)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        saved = [v for v, var in rm.saved.items() if solver.value(var)]
    elif status == cp_model.UNKNOWN:  # the time ran out before CP-SAT returned the hinted plan
        saved = sorted(start)
    else:
        raise RuntimeError(f"CP-SAT found no plan at all ({solver.status_name(status)})")
    peak = peak_of(cg, saved)
    known = job.memo.lowest(cg, peak, job.complies)
    if status != cp_model.OPTIMAL and known is not None:  # an earlier solve already reached lower
        peak, saved = known[0], sorted(known[1])
    job.memo.remember(cg, saved, peak)
    # CP-SAT's optimum covers plans that recompute each value once; a plan that recomputes a value
    # twice may peak lower, and reruns are only searched locally: with reruns allowed, a proof
    # needs a graph where no value can be recomputed twice
    proven = status == cp_model.OPTIMAL and not (job.reruns and any(rerunnable(cg, n) for n in cg.fw_order))
    floor = Floor(peak, proven, saved)
    if job.reruns:
        floor = _with_reruns(job, rm, floor, [frozenset(saved), *reversed(collect.found)],
                             status == cp_model.OPTIMAL, seed)
    return floor


def _start(job: Job) -> set[str]:
    """The plan the lowest-peak search starts from: per-block checkpointing, or without repeated
    blocks the (slower) drop-greedy, with the policy's forced saves added and forbidden ones taken
    out."""
    S = block_boundary_set(job.cg)
    if S is None:
        S, _peak = greedy_saved_set(job.cg, 0, deadline=job.deadline.part(0.3 * job.deadline.seconds))
    # the policy's forced and forbidden saves hold here too: this plan is the floor's when CP-SAT
    # returns nothing in its time
    return (set(S) | set(job.forced_saved)) - set(job.forbidden_saved)


def _with_reruns(job: Job, rm: RematModel, floor: Floor, starts: list[frozenset], proven_optimum: bool,
                 seed: int) -> Floor:
    """Lower several plans of nearly the same peak with reruns (they differ in how much reruns take
    off), on what is left of the clock; keep the lowest, the memo's earlier ones included."""
    cg = job.cg
    starts = list(dict.fromkeys(starts))
    clock = job.deadline.part(math.inf)  # what is left, MIN_SLICE_S at least
    if proven_optimum:
        # a graph small enough to prove: also take the next-lowest distinct plans (each solve
        # excludes the plans before it), so the result does not hang on which optimum CP-SAT met
        starts += _next_lowest(job, rm, starts, 8, clock.part(0.5 * clock.left()), seed)
    best = (floor.peak, frozenset(floor.saved), ())
    for i, S in enumerate(starts):
        if clock.expired():
            break
        found, sim = lower_peak(cg, S, cost_of=job.cost_of, deadline=clock.part(clock.left() / (len(starts) - i)))
        if sim.peak_bytes < best[0]:
            best = (sim.peak_bytes, S, tuple(found))
    best = min([best, *job.memo.rerun_plans(cg, job.complies)], key=lambda k: k[0])
    if best[0] >= floor.peak:
        return floor
    job.memo.remember_reruns(cg, best[1], best[2], best[0])
    return Floor(best[0], False, sorted(best[1]), list(best[2]))


def _next_lowest(job: Job, rm: RematModel, found: list[frozenset], count: int, clock: Deadline,
                 seed: int) -> list[frozenset]:
    """Up to ``count`` more lowest-peak saved sets, each different from every one before it."""
    out: list[frozenset] = []
    for S in found:
        exclude(rm, S)
    for _ in range(count):
        if clock.left() <= 0.05:
            break
        status, solver = job.solve(rm.model, clock.left(), seed=seed, deadline=clock)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        S = frozenset(v for v, var in rm.saved.items() if solver.value(var))
        out.append(S)
        exclude(rm, S)
    return out


class _Collect(cp_model.CpSolverSolutionCallback):
    """Keeps the saved sets of the last ``keep`` distinct solutions (the best ones, as CP-SAT improves)."""

    def __init__(self, saved_vars: dict, keep: int = 12):
        super().__init__()
        self._vars = saved_vars
        self._keep = keep
        self.found: list[frozenset] = []

    def on_solution_callback(self) -> None:
        saved = frozenset(v for v, var in self._vars.items() if self.value(var))
        if saved not in self.found:
            self.found.append(saved)
            del self.found[:-self._keep]
