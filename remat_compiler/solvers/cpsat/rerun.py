"""Recompute a value more than once: a local search that lowers a plan's peak with reruns.

The CP-SAT model recomputes each value at most once, just before its first backward use, and keeps
it to its last. When those uses are far apart (HF GPT-2's tanh-GELU: the activation's intermediates
are recomputed for the next layer's weight gradient and read again by the GELU's own backward), the
value is live across the peak for nothing. A *rerun* ``(v, j)`` drops it after its last use before
backward step ``j`` and recomputes it at the next step that needs it (see
:mod:`remat_compiler.schedule`). Pointwise ops cost no counted FLOPs, so such reruns are nearly free.

The search: simulate, take the instances live at the peak that are recomputed values and are read
again later, try a rerun of each at the peak's step and the next one, keep the one that lowers the
peak the most (ties: fewer node runs at the peak, then lower cost), and repeat. Every plan it returns
is the simulator's, so it is exact by construction.
"""
from __future__ import annotations

from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule, bw_step_of, rerunnable, simulate

__all__ = ["lower_peak"]


def _key(sim, cost: float):
    at_peak = sum(1 for _n, load in sim.events if load == sim.peak_bytes)
    return (sim.peak_bytes, at_peak, cost)


def lower_peak(cg: CostGraph, saved, rerun=(), *, cost_of=None, deadline: Deadline | None = None,
               max_moves: int = 200):
    """Add reruns to the plan ``saved`` (+ ``rerun``) until nothing lowers its peak further, or the
    time is up.

    Parameters
    ----------
    cost_of : callable, optional
        Cost of one recomputation of a node (default: its roofline runtime); breaks ties.

    Returns
    -------
    (list[tuple[str, int]], SimResult)
        The effective reruns and the simulation of the resulting plan.
    """
    cost_of = cost_of or (lambda n: cg.attr(n, "runtime_s"))
    F = len(cg.fw_order)
    B = len(cg.bw_order)

    def evaluate(rr):
        schedule = build_schedule(cg, saved, rr)
        sim = simulate(cg, schedule)
        cost = sum(cost_of(n) for n in schedule.recomputed)
        return schedule, sim, cost

    schedule, sim, cost = evaluate(list(rerun))
    best = _key(sim, cost)
    for _ in range(max_moves):
        if deadline is not None and deadline.expired():
            break
        t = sim.peak_time
        if t < F:
            break  # a forward peak: reruns change only the backward
        j = bw_step_of(F, t)
        peak_reads = {cg.storage(p) for p in cg.preds(sim.peak_node)} if sim.peak_node else set()
        tried = []
        for v, kind in sim.live_at(t):
            if not kind.startswith("rc") or v in peak_reads or not rerunnable(cg, v):
                continue
            if sim.times[(v, kind)][1] <= t:
                continue
            for step in (j, j + 1):
                if 0 < step < B:
                    tried.append((v, step))
        found = None
        for move in tried:
            rr = sorted({*schedule.rerun, move})
            sch2, sim2, cost2 = evaluate(rr)
            if sch2.rerun == schedule.rerun:
                continue
            k = _key(sim2, cost2)
            if k[:2] < best[:2] and (found is None or k < found[0]):
                found = (k, sch2, sim2, cost2)
            if deadline is not None and deadline.expired():
                break
        if found is None:
            break
        best, schedule, sim, cost = found
    return list(schedule.rerun), sim
