"""The CP-SAT model of a plan: save/recompute decisions, bounded by the simulated peak.

Model (Moccasin-style, O(nodes + edges) variables). Steps: forward steps ``0..F-1``, one per forward
node, then backward steps ``0..B-1``, one per backward node (the simulator's steps, see
:mod:`remat_compiler.schedule`). Memory lives on the simulator's node-level time axis
(:func:`~remat_compiler.schedule.bw_time`): forward node ``i`` at time ``i``; in backward step ``j``,
a recomputation of forward node ``i`` at ``F + j*(F+1) + i`` and the backward node at
``F + j*(F+1) + F``.

- ``s[v]`` (candidates only): v is saved from the forward;
- ``r[v]``: v is recomputed in backward (0 for random / mutating ops); ``n[v]``: backward needs v,
  directly or because something recomputed reads it; ``r[v] >= n[v] - s[v]``, ``s[v] <= n[v]``;
- ``st[v]``: backward step where v is recomputed, the first step that needs it (a multi-output op's
  outputs are taken at its own step); ``last[v]``: time of the last node that reads v's storage
  (a backward node, directly or through a view, or a recomputation);
- memory: one ``add_cumulative`` over every value's live interval. A candidate's forward interval is
  fixed; saving it adds the optional interval ``[end of forward use + 1, last[v]]``; recomputing it
  adds ``[bw_time(F, st[v], i), last[v]]`` (i: the op's forward index; a multi-output op's outputs all
  start at the op's). Everything the plan does not change (tangents, backward values,
  outputs) enters as fixed intervals. Its capacity is the peak variable, at most the budget.

The cumulative's load at a node's time is what the emitted code holds while that node runs (each node
allocates its output while its inputs are live; values are freed after their last reader), so the
optimum is the best plan by the simulator's exact peak. ``last`` is only bounded below (a later end is
allowed and never helps), so every plan found fits when simulated. Objective: minimise the recompute
cost (:func:`cost_units`: roofline runtime in integer nanoseconds, communication included, or counted
FLOPs); :func:`~remat_compiler.solvers.cpsat.steps.peak_at_cost` then minimises the peak at that
cost, so a larger budget never gives a plan with a larger peak for nothing.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule, bw_time, recomputed_outputs, simulate
from remat_compiler.solvers.cpsat.costs import cost_units
from remat_compiler.solvers.cpsat.parts import (add_candidate_intervals, add_decisions, add_first_need,
                                                add_value_intervals, alloc_index, fixed_intervals, is_const,
                                                storage_readers)

__all__ = ["RematModel", "build_model", "hint", "exclude"]


@dataclass
class RematModel:
    """A built CP-SAT model and the handles to read a solution back."""

    model: cp_model.CpModel
    saved: dict[str, cp_model.IntVar]
    recomputed: dict[str, cp_model.IntVar]
    peak: cp_model.IntVar
    cost: cp_model.LinearExpr
    unit_bytes: int
    fixed_peak_bytes: int
    cost_gcd: int = 1
    need: dict = None
    start: dict = None
    aux: dict = None
    num_fw_steps: int = 0
    num_bw_steps: int = 0
    first: dict = None
    xs: dict = None
    direct_first: dict = None
    getitem_parent: dict = None
    build_s: float = 0.0  # wall seconds the build took


def build_model(cg: CostGraph, budget_bytes: int | None, *, minimize: str = "cost",
                max_cost: int | None = None, forced_saved=(), forbidden_saved=(),
                objective: str = "runtime") -> RematModel:
    """Build the CP-SAT model of a CostGraph.

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int | None
        Upper bound of the peak variable (None: unbounded).
    minimize : "cost" | "peak"
        The objective.
    max_cost : int, optional
        Upper bound on the recompute cost (for the second, peak-minimising solve).
    forced_saved, forbidden_saved : iterables of candidate names
        Hard constraints from user policies (``save_only``, ``never_save``...).
    objective : "runtime" | "flops"
        What the recompute cost counts (see :func:`cost_units`).
    """
    t0 = time.perf_counter()
    m = cp_model.CpModel()
    F, fw_reads, bw_reads, rc_readers = storage_readers(cg)
    B = len(cg.bw_order)
    cands = cg.candidates
    cand_set = set(cands)

    # Fixed intervals: everything whose life the plan does not change, from the save-all simulation.
    fixed, base = fixed_intervals(cg)
    sizes = [cg.attr(c, "bytes") for c in cg.fw_order if cg.storage(c) == c] + [s for _, _, s in fixed]
    unit = reduce(math.gcd, [s for s in sizes if s > 0], 0) or 1

    # Model nodes: forward nodes backward might need (not always available).
    M = [v for v in cg.fw_order if not cg.is_available_in_bw(v)]
    in_m = set(M)
    direct_first: dict[str, int] = {}
    direct = set()
    for j, b in enumerate(cg.bw_order):
        for p in cg.preds(b):
            if p in in_m:
                direct.add(p)
                direct_first.setdefault(p, j)

    s, r, need = add_decisions(m, cg, M, direct)
    st = {v: m.new_int_var(0, direct_first.get(v, B - 1), f"st_{v}") for v in M}
    for v in forced_saved:
        if v in s:
            m.add(s[v] == 1)
    for v in forbidden_saved:
        if v in s:
            m.add(s[v] == 0)
    # first[v], st[v]: the first backward step that needs v, and where v is materialised when
    # recomputed (see cpmodel.add_first_need)
    earliest = _earliest_need(cg, M, direct_first, B)
    first = {v: m.new_int_var(min(earliest[v], B - 1), B - 1, f"first_{v}") for v in M}
    xs, getitem_parent = add_first_need(m, cg, M, r, direct_first, B, first, st)

    # memory, on the simulator's node-level time axis (forward node i at time i, then bw_time)
    idx = cg.fw_index
    intervals, demands = [], []
    for (a, z, size) in fixed:
        intervals.append(m.new_fixed_size_interval_var(a, z - a + 1, f"fix_{a}_{z}"))
        demands.append(size // unit)
    more, more_demands, aux = add_candidate_intervals(
        m, cg, unit, fw_reads, in_m,
        lambda v, size, e: add_value_intervals(m, cg, v, size, s, r, st, F, B, e, bw_reads.get(v, -1),
                                               rc_readers.get(v, ()), in_m))
    intervals += more
    demands += more_demands

    for v in M:  # a recomputed multi-output op's untaken outputs, live while its getitems are taken
        if cg.attr(v, "is_tuple") and cg.attr(v, "bytes") > 0 and v not in cand_set:
            span = max([idx[u] for u in cg.g.successors(v) if u in in_m], default=idx[v]) - idx[v] + 1
            start = m.new_int_var(bw_time(F, 0, idx[v]), bw_time(F, B - 1, idx[v]), f"tups_{v}")
            m.add(start == bw_time(F, st[v], idx[v]))
            intervals.append(m.new_optional_fixed_size_interval_var(start, span, r[v], f"tup_{v}"))
            demands.append(cg.attr(v, "bytes") // unit)
    for v in M:  # its outputs the plan does not take, allocated while it runs (schedule.recomputed_outputs)
        if not cg.attr(v, "is_tuple") or cg.attr(v, "never_recompute"):
            continue
        for u in recomputed_outputs(cg, v):
            if u in r:  # taken iff recomputed itself (which implies r[v])
                present = m.new_bool_var(f"tmp_{u}")
                m.add_bool_and([r[v], ~r[u]]).only_enforce_if(present)
                m.add_bool_or([~r[v], r[u], present])
            else:  # always available in backward (held by the caller): never taken
                present = r[v]
            at = m.new_int_var(bw_time(F, 0, idx[v]), bw_time(F, B - 1, idx[v]), f"tmps_{u}")
            m.add(at == bw_time(F, st[v], idx[v]))
            intervals.append(m.new_optional_fixed_size_interval_var(at, 1, present, f"tmp_{u}"))
            demands.append(cg.attr(u, "bytes") // unit)
    fixed_peak = base.peak_bytes
    cap_hi = sum(demands) + 1
    peak_hi = cap_hi if budget_bytes is None else min(cap_hi, budget_bytes // unit)
    peak = m.new_int_var(0, max(peak_hi, 0), "peak")
    m.add_cumulative(intervals, demands, peak)
    _add_step_bounds(m, cg, peak, unit, fixed, F, B, fw_reads, bw_reads, direct_first, s,
                     _saved_reach(cg, rc_readers, in_m, earliest, B))

    costs = {v: cost_units(cg, v, objective) for v in M}
    g = reduce(math.gcd, [c for c in costs.values() if c > 0], 0) or 1
    cost = sum((costs[v] // g) * r[v] for v in M if costs[v] > 0)
    if max_cost is not None:
        m.add(cost <= max_cost // g)
    if minimize == "cost":
        m.minimize(cost)
    elif minimize == "peak":
        m.minimize(peak)
    else:
        raise ValueError(f"minimize must be 'cost' or 'peak', not {minimize!r}")
    return RematModel(model=m, saved=s, recomputed=r, peak=peak, cost=cost, unit_bytes=unit,
                      fixed_peak_bytes=fixed_peak, cost_gcd=g, need=need, start=st, aux=aux,
                      num_fw_steps=F, num_bw_steps=B, first=first, xs=xs,
                      direct_first=direct_first, getitem_parent=getitem_parent,
                      build_s=time.perf_counter() - t0)


def _earliest_need(cg: CostGraph, M: list[str], direct_first: dict[str, int], B: int) -> dict[str, int]:
    """For each model node, the earliest backward step that could need it in any plan: its first
    direct read, or that of anything downstream a recomputation could reach it from (B: never)."""
    in_m = set(M)
    earliest: dict[str, int] = {}
    for v in reversed(M):
        e = direct_first.get(v, B)
        for u in cg.g.successors(v):
            if u in in_m:
                e = min(e, earliest[u])
        earliest[v] = e
    return earliest


def _saved_reach(cg: CostGraph, rc_readers, in_m, earliest: dict[str, int], B: int) -> dict[str, int]:
    """For a candidate backward never reads directly: a step it is certainly live through when saved.

    It is saved only if needed, so some reader u is recomputed, at the earliest at ``earliest[u]``.
    """
    reach = {}
    for v in cg.candidates:
        ends = [earliest[u] for u in rc_readers.get(v, ()) if u in in_m and u != v]
        reach[v] = min(min(ends), B - 1) if ends else -1
    return reach


def _add_step_bounds(m, cg, peak, unit, fixed, F, B, fw_reads, bw_reads, direct_first, s,
                     reach) -> None:
    """Redundant linear constraints at forward and backward node times: memory that is live
    at that node's time whatever else the plan does.

    The cumulative alone gives CP-SAT no useful LP bound. At forward node t a candidate is certainly
    live while the forward still reads it, and afterwards exactly when saved; at backward node j it is
    certainly live between its first and last direct backward read (saved or recomputed, backward
    needs it there), and before that whenever it is saved; a saved value backward reads only through
    recomputation is live at least until the earliest step one of its readers can be recomputed
    (``reach``), so at the backward nodes before it. All are lower bounds of the cumulative's load at
    those times, so adding them removes no plan. Of them, only those no other one implies are kept
    (:func:`_undominated`).
    """
    points = list(range(F)) + [bw_time(F, j) for j in range(B)]  # sorted times of fw and bw nodes
    T = len(points)
    # the constants first, as range additions on one difference array (O(values + times))
    diff = [0] * (T + 1)
    for a, z, size in fixed:
        lo, hi = bisect.bisect_left(points, a), bisect.bisect_right(points, z)
        if lo < hi:
            diff[lo] += size // unit
            diff[hi] -= size // unit
    spans = []  # per decided candidate: (size, v, last forward time it is a term, last backward step)
    for v in cg.candidates:
        size = cg.attr(v, "bytes") // unit
        a = alloc_index(cg, v)
        e = max(fw_reads.get(v, a), a)
        diff[a] += size
        diff[e + 1] -= size
        if v not in s:
            continue
        lo = bw_reads.get(v, -1)
        if lo < 0:  # live until its reader's recomputation, which runs before that step's node
            lo = reach[v] - 1
        first = direct_first.get(v)
        if first is not None and first <= lo:  # certainly live from its first backward read on
            diff[F + first] += size
            diff[F + lo + 1] -= size
        spans.append((size, v, e, lo if first is None else min(lo, first - 1)))
    const = [0] * T
    acc = 0
    for t in range(T):
        acc += diff[t]
        const[t] = acc
    # then the saved terms, only at the times kept (each time's terms in candidate order)
    keep = _undominated(const, F)
    kept_fw = [t for t in keep if t < F]
    kept_bw = [t - F for t in keep if t >= F]
    terms: dict[int, list[tuple[int, str]]] = {t: [] for t in keep}
    for size, v, e, last_j in spans:
        for t in kept_fw[bisect.bisect_right(kept_fw, e):]:  # after its last forward read
            terms[t].append((size, v))
        for j in kept_bw[:bisect.bisect_right(kept_bw, last_j)]:  # before it is certainly live
            terms[F + j].append((size, v))
    for t in keep:
        if terms[t]:
            m.add(sum(c * s[v] for c, v in terms[t]) + const[t] <= peak)
        else:
            m.add(peak >= const[t])


def _undominated(const: list[int], F: int) -> list[int]:
    """The times whose step bound no other one implies.

    In the forward a time's saved terms include every earlier time's (values saved after their last
    forward read stay saved), and in the backward every later time's terms are among an earlier
    time's (a value leaves the sum when backward reads it for the first time or is done with it).
    So a forward bound is implied by a later forward one with at least its constant, and a backward
    bound by an earlier backward one with at least its constant. On deep graphs this removes most of
    them, which CP-SAT's presolve otherwise spends the time limit on.
    """
    keep, best = [], None
    for t in range(F - 1, -1, -1):
        if best is None or const[t] > best:
            keep.append(t)
            best = const[t]
    best = None
    for t in range(F, len(const)):
        if best is None or const[t] > best:
            keep.append(t)
            best = const[t]
    return sorted(keep)


def hint(rm: RematModel, cg: CostGraph, saved) -> None:
    """Hint every variable with the exact values of the plan that saves ``saved``.

    A hint of the decisions alone is often not completed by CP-SAT on large graphs; the schedule and
    its simulation give every start, last use and interval size, so the hint is a full solution.
    """
    schedule = build_schedule(cg, saved)
    sim = simulate(cg, schedule)
    F = rm.num_fw_steps
    saved = set(schedule.saved)
    step_of = {}
    for j, (rec, _b) in enumerate(schedule.bw):
        for n in rec:
            step_of[n] = j
    m = rm.model
    for v, var in rm.saved.items():
        m.add_hint(var, 1 if v in saved else 0)
    for v, var in rm.recomputed.items():
        if not isinstance(var, int) and var.index >= 0 and not is_const(var):
            m.add_hint(var, 1 if v in step_of else 0)
    for v, var in rm.need.items():
        if not is_const(var):
            m.add_hint(var, 1 if (v in step_of or v in saved) else 0)
    B = rm.num_bw_steps
    first = {}
    for v in reversed(list(rm.first)):  # readers come later in the forward: reverse order
        terms = [rm.direct_first[v]] if v in rm.direct_first else []
        for w in cg.g.successors(v):
            if w in rm.first and w in step_of:
                terms.append(first[w] if rm.getitem_parent.get(w) == v else step_of[w])
        first[v] = min(terms, default=B - 1)
    for (v, w), var in rm.xs.items():
        at = first[w] if rm.getitem_parent.get(w) == v else step_of.get(w)
        m.add_hint(var, at if w in step_of else B - 1)
    for v, var in rm.first.items():
        m.add_hint(var, first[v])
    for v, var in rm.start.items():
        m.add_hint(var, step_of.get(v, first[v]))
    for v, a in rm.aux.items():
        st = step_of.get(v, first[v])
        rc_start = bw_time(F, st, alloc_index(cg, v))
        if v in saved:
            last = sim.times[(v, "fw")][1]
        elif v in step_of:
            last = sim.times[(v, "rc")][1]
        else:
            last = max(a["last"].proto.domain[0], rc_start)
        m.add_hint(a["last"], last)
        m.add_hint(a["sv_size"], last - a["sv_start"] + 1)
        m.add_hint(a["sv_end"], last + 1)
        m.add_hint(a["rc_start"], rc_start)
        size = last - rc_start + 1 if v in step_of else 1
        m.add_hint(a["rc_size"], size)
        m.add_hint(a["rc_end"], rc_start + size)
    m.add_hint(rm.peak, -(-sim.peak_bytes // rm.unit_bytes))


def exclude(rm: RematModel, saved: frozenset) -> None:
    """Forbid the exact saved set ``saved`` in the model (a no-good cut)."""
    flips = [(1 - var) if v in saved else var for v, var in rm.saved.items() if not is_const(var)]
    if flips:
        rm.model.add(sum(flips) >= 1)

