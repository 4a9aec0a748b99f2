"""A fast heuristic: drop saved values from the peak, cheapest recompute per byte first.

Used as CP-SAT's warm start and usable on its own (``solver="greedy"``); every step is judged by the
liveness simulator, so what it returns fits when it says it does.
"""
from __future__ import annotations

import time

from remat_compiler.costgraph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import build_schedule, save_all_set, simulate

__all__ = ["greedy_saved_set", "fill_saved_set", "best_heuristic_set", "solve_greedy"]


def greedy_saved_set(cg: CostGraph, budget_bytes: int, *, width: int = 12) -> tuple[set[str], int]:
    """A saved set whose simulated peak is as close to ``budget_bytes`` as greedy gets.

    Each round looks at the saved values live at the current peak step, tries dropping the ``width``
    cheapest per byte, and keeps the drop with the smallest marginal recompute cost (the whole
    recompute chain it causes, from the simulator) per byte the peak goes down.

    Returns the saved set and its simulated peak (above the budget if greedy got stuck).
    """
    saved = set(save_all_set(cg))
    sim = simulate(cg, build_schedule(cg, saved))
    while sim.peak_bytes > budget_bytes:
        t = sim.peak_time
        live = [v for v in saved if not cg.attr(v, "never_recompute")
                and sim.times[(v, "fw")][0] <= t <= sim.times[(v, "fw")][1]]
        live.sort(key=lambda v: (cg.attr(v, "runtime_s") / cg.attr(v, "bytes"), cg.attr(v, "order")))
        best = None
        for v in live[:width]:
            trial = saved - {v}
            trial_sim = simulate(cg, build_schedule(cg, trial))
            freed = sim.load_at(t) - trial_sim.load_at(t)
            if freed <= 0 or trial_sim.peak_bytes > sim.peak_bytes:
                continue
            score = (trial_sim.recompute_s - sim.recompute_s) / freed
            if best is None or score < best[0]:
                best = (score, trial, trial_sim)
        if best is None:
            break
        saved, sim = best[1], best[2]
    return set(build_schedule(cg, saved).saved), sim.peak_bytes


def fill_saved_set(cg: CostGraph, budget_bytes: int, start, groups=None) -> tuple[set[str], int]:
    """Grow a fitting saved set: save more values, densest recompute saving per byte first.

    Starting from ``start`` (e.g. the per-block checkpoint plan), each group of candidates (one
    candidate, or the same value in every identical block) that is recomputed is tried once; it is
    kept saved if the simulated peak stays within the budget and the recompute cost drops. Returns
    the saved set and its simulated peak.
    """
    saved = set(start)
    sim = simulate(cg, build_schedule(cg, saved))
    if sim.peak_bytes > budget_bytes:
        return saved, sim.peak_bytes
    if groups is None:
        groups = [[v] for v in cg.candidates]
    groups = [[v for v in g if v not in saved] for g in groups]
    order = sorted((g for g in groups if g),
                   key=lambda g: (-cg.attr(g[0], "runtime_s") / cg.attr(g[0], "bytes"),
                                  cg.attr(g[0], "order")))
    for group in order:
        trial = saved | set(group)
        schedule = build_schedule(cg, trial)
        if not set(group) & set(schedule.saved):
            continue
        trial_sim = simulate(cg, schedule)
        if trial_sim.peak_bytes <= budget_bytes and trial_sim.recompute_s < sim.recompute_s:
            saved, sim = set(schedule.saved), trial_sim
    return saved, sim.peak_bytes


def best_heuristic_set(cg: CostGraph, budget_bytes: int) -> tuple[set[str] | None, int]:
    """The cheapest fitting saved set among the heuristics (drop from save-all, fill from checkpoints).

    Returns ``(None, lowest peak seen)`` when none fits.
    """
    from remat_compiler.solvers.basic import block_boundary_set

    from remat_compiler.solvers.cpsat import block_classes

    try:
        start = block_boundary_set(cg)
    except ValueError:  # no repeated blocks
        start = None
    classes = block_classes(cg) if start is not None else []
    found = []
    if classes:  # identical blocks: fill a value in every block at once (few, cheap simulations)
        found.append(fill_saved_set(cg, budget_bytes, start, groups=classes))
    else:  # the per-value heuristics simulate once per candidate: fine without repeated blocks
        if start is not None:
            found.append(fill_saved_set(cg, budget_bytes, start))
        found.append(greedy_saved_set(cg, budget_bytes))
    fitting = [(simulate(cg, build_schedule(cg, S)).recompute_s, peak, S) for S, peak in found
               if peak <= budget_bytes]
    if not fitting:
        return None, min(peak for _, peak in found)
    _, peak, S = min(fitting, key=lambda x: (x[0], x[1]))
    return S, peak


def solve_greedy(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """Greedy plan under ``budget_bytes`` (no optimality claim: status "feasible", gap unknown = 1.0).

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
        saved, peak = best_heuristic_set(cg, budget_bytes)
        if saved is None:
            raise InfeasibleBudgetError(budget_bytes, peak)
    return make_plan(cg, saved, budget_bytes=budget_bytes, solver="greedy",
                     status="optimal" if budget_bytes is None else "feasible",
                     gap=0.0 if budget_bytes is None else 1.0, solve_time_s=time.perf_counter() - t0)
