"""A fast heuristic: drop saved values from the peak, cheapest recompute per byte first.

Used as CP-SAT's warm start and usable on its own (``solver="greedy"``); every step is judged by the
liveness simulator, so what it returns fits when it says it does.
"""
from __future__ import annotations

import time

from remat_compiler.clock import Deadline
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.graph import CostGraph, block_boundary_set, block_classes
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import build_schedule, save_all_set, simulate

__all__ = ["greedy_saved_set", "fill_saved_set", "best_heuristic_set", "solve_greedy"]


def _runtime(cg: CostGraph):
    return lambda n: cg.attr(n, "runtime_s")


def _recompute_cost(cg: CostGraph, schedule, cost_of) -> float:
    return sum(cost_of(n) for n in schedule.recomputed)


def greedy_saved_set(cg: CostGraph, budget_bytes: int, *, width: int = 12,
                     cost_of=None, deadline: Deadline | None = None) -> tuple[set[str], int]:
    """A saved set whose simulated peak is as close to ``budget_bytes`` as greedy gets.

    Each round looks at the saved values live at the current peak step, tries dropping the ``width``
    cheapest per byte, and keeps the drop with the smallest marginal recompute cost (the whole
    recompute chain it causes, from the simulator) per byte the peak goes down.

    ``cost_of(node)`` is the recompute cost (default: the runtime estimate). ``deadline`` stops the
    rounds early. Returns the saved set and its simulated
    peak (above the budget if greedy got stuck or ran out of time).
    """
    cost_of = cost_of or _runtime(cg)
    saved = set(save_all_set(cg))
    schedule = build_schedule(cg, saved)
    sim, cost = simulate(cg, schedule), _recompute_cost(cg, schedule, cost_of)
    while sim.peak_bytes > budget_bytes and (deadline is None or not deadline.expired()):
        t = sim.peak_time
        live = [v for v in saved if not cg.attr(v, "never_recompute")
                and sim.times[(v, "fw")][0] <= t <= sim.times[(v, "fw")][1]]
        live.sort(key=lambda v: (cost_of(v) / cg.attr(v, "bytes"), cg.attr(v, "order")))
        best = None
        for v in live[:width]:
            trial = saved - {v}
            trial_schedule = build_schedule(cg, trial)
            trial_sim = simulate(cg, trial_schedule)
            freed = sim.load_at(t) - trial_sim.load_at(t)
            if freed <= 0 or trial_sim.peak_bytes > sim.peak_bytes:
                continue
            trial_cost = _recompute_cost(cg, trial_schedule, cost_of)
            score = (trial_cost - cost) / freed
            if best is None or score < best[0]:
                best = (score, trial, trial_sim, trial_cost)
        if best is None:
            break
        _, saved, sim, cost = best
    return set(build_schedule(cg, saved).saved), sim.peak_bytes


def fill_saved_set(cg: CostGraph, budget_bytes: int, start, groups=None,
                   cost_of=None, deadline: Deadline | None = None) -> tuple[set[str], int]:
    """Grow a fitting saved set: save more values, densest recompute saving per byte first.

    Starting from ``start`` (e.g. the per-block checkpoint plan), each group of candidates (one
    candidate, or the same value in every identical block) that is recomputed is tried once; it is
    kept saved if the simulated peak stays within the budget and the recompute cost (``cost_of``,
    default the runtime estimate) drops. Returns the saved set and its simulated peak.
    """
    cost_of = cost_of or _runtime(cg)
    saved = set(start)
    schedule = build_schedule(cg, saved)
    sim, cost = simulate(cg, schedule), _recompute_cost(cg, schedule, cost_of)
    if sim.peak_bytes > budget_bytes:
        return saved, sim.peak_bytes
    if groups is None:
        groups = [[v] for v in cg.candidates]
    groups = [[v for v in g if v not in saved] for g in groups]
    order = sorted((g for g in groups if g),
                   key=lambda g: (-cost_of(g[0]) / cg.attr(g[0], "bytes"), cg.attr(g[0], "order")))
    for group in order:
        if deadline is not None and deadline.expired():
            break
        trial = saved | set(group)
        schedule = build_schedule(cg, trial)
        if not set(group) & set(schedule.saved):
            continue
        trial_cost = _recompute_cost(cg, schedule, cost_of)
        if trial_cost >= cost:  # no saving: not worth a simulation
            continue
        trial_sim = simulate(cg, schedule)
        if trial_sim.peak_bytes <= budget_bytes:
            saved, sim, cost = set(schedule.saved), trial_sim, trial_cost
    return saved, sim.peak_bytes


def best_heuristic_set(cg: CostGraph, budget_bytes: int, cost_of=None, deadline: Deadline | None = None
                       ) -> tuple[set[str] | None, int]:
    """The cheapest fitting saved set among the heuristics (drop from save-all, fill from checkpoints),
    by ``cost_of`` (default: the runtime estimate), each stopped at ``deadline``.

    Returns ``(None, lowest peak seen)`` when none fits.
    """
    cost_of = cost_of or _runtime(cg)
    start = block_boundary_set(cg)
    classes = block_classes(cg) if start is not None else []
    found = []
    if classes:  # identical blocks: fill a value in every block at once (few, cheap simulations)
        found.append(fill_saved_set(cg, budget_bytes, start, groups=classes, cost_of=cost_of,
                                    deadline=deadline))
    else:  # the per-value heuristics simulate once per candidate: fine without repeated blocks
        if start is not None:
            found.append(fill_saved_set(cg, budget_bytes, start, cost_of=cost_of, deadline=deadline))
        found.append(greedy_saved_set(cg, budget_bytes, cost_of=cost_of, deadline=deadline))
    fitting = [(_recompute_cost(cg, build_schedule(cg, S), cost_of), peak, S) for S, peak in found
               if peak <= budget_bytes]
    if not fitting:
        return None, min(peak for _, peak in found)
    _, peak, S = min(fitting, key=lambda x: (x[0], x[1]))
    return S, peak


def solve_greedy(cg: CostGraph, budget_bytes: int | None, *, time_limit_s: float = 30.0) -> Plan:
    """Greedy plan under ``budget_bytes`` (no optimality claim: status "feasible", gap unknown = 1.0),
    searched for at most ``time_limit_s`` (then the best saved set so far).

    Raises
    ------
    InfeasibleBudgetError
        If greedy cannot fit the budget; the named budget is the lowest peak greedy reached, an
        upper bound of the true smallest feasible budget (CP-SAT computes the true one).
    """
    t0 = time.perf_counter()
    if budget_bytes is None:
        saved, peak = set(save_all_set(cg)), None
    else:
        saved, peak = best_heuristic_set(cg, budget_bytes, deadline=Deadline(time_limit_s))
        if saved is None:
            raise InfeasibleBudgetError(budget_bytes, peak, proven=False,
                                        advice="or solver='cpsat', which searches every plan")
    return make_plan(cg, saved, budget_bytes=budget_bytes, solver="greedy",
                     status="optimal" if budget_bytes is None else "feasible",
                     gap=0.0 if budget_bytes is None else 1.0, solve_time_s=time.perf_counter() - t0)
