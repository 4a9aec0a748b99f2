"""The main solver: OR-Tools CP-SAT over save/recompute decisions, bounded by the simulated peak.

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
FLOPs); a second solve then minimises the peak at that cost, so a larger budget never gives a plan
with a larger peak for nothing.
"""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from functools import reduce

from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from remat_compiler.costgraph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import (build_schedule, bw_time, recomputed_outputs, rerunnable, save_all_set,
                                     simulate)
from remat_compiler.solvers.basic import block_boundary_set
from remat_compiler.solvers.blockbound import block_bound
from remat_compiler.solvers.cpmodel import (add_decisions, add_first_need, alloc_index, fixed_intervals,
                                           is_const, new_solver, run_solver, storage_readers)
from remat_compiler.solvers.blockwise import block_stack, blockwise_saved_set, identical_blocks
from remat_compiler.solvers.greedy import best_heuristic_set, greedy_saved_set
from remat_compiler.solvers.rerun import lower_peak

__all__ = ["solve_cpsat", "min_feasible_peak", "cost_units", "plan_cost_units", "flop_gap", "lp_bound",
           "RematModel", "build_model", "block_classes"]


OBJECTIVES = ("runtime", "flops")


def cost_units(cg: CostGraph, n: str, objective: str = "runtime") -> int:
    """Integer recompute cost of a node under an objective.

    ``"runtime"``: its roofline runtime estimate in ns (communication included), at least 1 for a
    real op. ``"flops"``: its counted FLOPs in kFLOP plus 1 for any real op, so that FLOPs decide and
    among plans of equal FLOPs (memory-bound ops count none) the one recomputing fewer ops wins.
    """
    rt = cg.attr(n, "runtime_s")
    if rt <= 0:
        return 0
    if objective == "runtime":
        return max(1, math.ceil(rt * 1e9))
    if objective == "flops":
        return cg.attr(n, "flops") // 1000 + 1
    raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")


def flop_gap(cg: CostGraph, recomputed, bound_units: float) -> float:
    """The proven relative gap on counted FLOPs alone of a plan found under ``objective="flops"``.

    That objective counts kFLOPs plus 1 per recomputed op (the tie-break), so CP-SAT's bound on it,
    less the number of ops any plan could recompute, bounds the kFLOPs of every plan from below. A
    plan that recomputes no counted FLOPs is FLOP-optimal whatever the bound.
    """
    flops = sum(cg.attr(n, "flops") // 1000 for n in set(recomputed) if cg.attr(n, "runtime_s") > 0)
    if flops == 0:
        return 0.0
    ops = sum(1 for v in cg.fw_order if not cg.is_available_in_bw(v) and cg.attr(v, "runtime_s") > 0
              and not cg.attr(v, "never_recompute"))
    return max(0.0, (flops - max(0.0, bound_units - ops)) / flops)


def _set_cost_units(cg: CostGraph, saved, objective: str, rerun=()) -> int:
    """The objective value of the plan that saves ``saved`` (and reruns ``rerun``)."""
    return sum(cost_units(cg, n, objective) for n in build_schedule(cg, saved, rerun).recomputed)


def plan_cost_units(cg: CostGraph, plan: Plan, objective: str = "runtime") -> int:
    """The objective value of a plan: the summed integer cost of what it recomputes."""
    return sum(cost_units(cg, n, objective) for n in plan.recomputed)


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
    t_end = bw_time(F, B - 1)
    idx = cg.fw_index
    intervals, demands = [], []
    aux: dict[str, dict] = {}
    for (a, z, size) in fixed:
        intervals.append(m.new_fixed_size_interval_var(a, z - a + 1, f"fix_{a}_{z}"))
        demands.append(size // unit)
    for v in cands:
        size = cg.attr(v, "bytes") // unit
        a = alloc_index(cg, v)
        e = max(fw_reads.get(v, a), a)
        intervals.append(m.new_fixed_size_interval_var(a, e - a + 1, f"fw_{v}"))
        demands.append(size)
        if v not in in_m:
            continue
        lo = bw_reads.get(v, -1)
        last = m.new_int_var(bw_time(F, lo) if lo >= 0 else F, t_end, f"last_{v}")
        for u in rc_readers.get(v, ()):
            if u in in_m and u != v:
                m.add(last >= bw_time(F, st[u], idx[u])).only_enforce_if(r[u])
        at = alloc_index(cg, v)
        rc_start = m.new_int_var(bw_time(F, 0, at), bw_time(F, B - 1, at), f"rcs_{v}")
        m.add(rc_start == bw_time(F, st[v], at))
        m.add(last >= rc_start).only_enforce_if(r[v])
        aux[v] = {"last": last}
        # saved: [e+1, last]
        sv_start = e + 1
        sv_size = m.new_int_var(0, t_end + 1, f"svsz_{v}")
        m.add(sv_size == last - sv_start + 1)
        sv_end = m.new_int_var(0, t_end + 2, f"svend_{v}")
        intervals.append(m.new_optional_interval_var(sv_start, sv_size, sv_end, s[v], f"sv_{v}"))
        aux[v].update(sv_size=sv_size, sv_end=sv_end, sv_start=sv_start)
        demands.append(size)
        # recomputed: [rc_start, last]
        rc_size = m.new_int_var(1, t_end + 1, f"rcsz_{v}")
        m.add(rc_size == last - rc_start + 1).only_enforce_if(r[v])
        rc_end = m.new_int_var(F, t_end + 2, f"rce_{v}")
        intervals.append(m.new_optional_interval_var(rc_start, rc_size, rc_end, r[v], f"rc_{v}"))
        aux[v].update(rc_start=rc_start, rc_size=rc_size, rc_end=rc_end)
        demands.append(size)

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
                      direct_first=direct_first, getitem_parent=getitem_parent)


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
    fixed_prof = [0] * (T + 1)
    for a, z, size in fixed:
        lo, hi = bisect.bisect_left(points, a), bisect.bisect_right(points, z)
        if lo < hi:
            fixed_prof[lo] += size // unit
            fixed_prof[hi] -= size // unit
    for t in range(1, T + 1):
        fixed_prof[t] += fixed_prof[t - 1]
    const = list(fixed_prof[:T])
    terms: list[list[tuple[int, str]]] = [[] for _ in range(T)]
    for v in cg.candidates:
        size = cg.attr(v, "bytes") // unit
        a = alloc_index(cg, v)
        e = max(fw_reads.get(v, a), a)
        for t in range(a, e + 1):
            const[t] += size
        if v not in s:
            continue
        lo = bw_reads.get(v, -1)
        if lo < 0:  # live until its reader's recomputation, which runs before that step's node
            lo = reach[v] - 1
        for t in range(e + 1, F):
            terms[t].append((size, v))
        first = direct_first.get(v)
        for j in range(0, lo + 1):
            if first is not None and j >= first:
                const[F + j] += size
            else:
                terms[F + j].append((size, v))
    for t in _undominated(const, F):
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


def lp_bound(rm: RematModel, time_limit_s: float = 5.0) -> float | None:
    """A lower bound on the model's objective from the LP relaxation of its linear part (GLOP).

    The relaxation keeps the linear constraints without enforcement literals, the implications
    and clauses (as linear rows), and every variable's bounds; it drops the cumulative and the
    start-time constraints. Each real plan is a point of it, so its optimum bounds every plan from
    below. CP-SAT's own bound on these models is that LP's value when its search gets to it; on
    deep graphs (GPT-2 at 48 layers) its presolve and LP take the whole time limit, so the plan
    would carry no bound at all. None if GLOP does not prove its optimum in time.
    """
    proto = rm.model.proto
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    inf = lp.infinity()
    xs = [lp.NumVar(float(v.domain[0]), float(v.domain[len(v.domain) - 1]), "") for v in proto.variables]

    def row(lo: float, pairs) -> None:  # sum of coeff * literal >= lo, literals as CP-SAT indices
        const, coeffs = 0.0, {}
        for lit, co in pairs:
            if lit >= 0:
                coeffs[lit] = coeffs.get(lit, 0.0) + co
            else:  # a negated literal: 1 - x
                const += co
                coeffs[-lit - 1] = coeffs.get(-lit - 1, 0.0) - co
        ct = lp.RowConstraint(lo - const, inf, "")
        for i, co in coeffs.items():
            ct.SetCoefficient(xs[i], co)

    for c in proto.constraints:
        if c.has_linear() and not c.enforcement_literal:
            d = c.linear.domain
            lo, hi = d[0], d[len(d) - 1]
            ct = lp.RowConstraint(float(lo) if lo > -2 ** 62 else -inf,
                                  float(hi) if hi < 2 ** 62 else inf, "")
            for i, co in zip(c.linear.vars, c.linear.coeffs):
                ct.SetCoefficient(xs[i], float(co))
        elif c.has_bool_or():
            lits = list(c.bool_or.literals)
            for en in c.enforcement_literal or [None]:  # or(lits) when en holds: sum(lits) >= en
                enforced = [(en, -1.0)] if en is not None else []
                row(0.0 if en is not None else 1.0, [(x, 1.0) for x in lits] + enforced)
        elif c.has_bool_and() and c.enforcement_literal:
            for en in c.enforcement_literal:
                for x in c.bool_and.literals:
                    row(0.0, [(x, 1.0), (en, -1.0)])
    obj = lp.Objective()
    for i, co in zip(proto.objective.vars, proto.objective.coeffs):
        obj.SetCoefficient(xs[i], float(co))
    obj.SetMinimization()
    lp.SetTimeLimit(int(max(0.05, time_limit_s) * 1000))
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    scale = proto.objective.scaling_factor or 1.0
    value = (obj.Value() + proto.objective.offset) * scale
    return math.floor(value - 1e-6 * abs(value) - 1e-6)  # below GLOP's tolerance


class _Progress(cp_model.CpSolverSolutionCallback):
    """Reports elapsed time, best cost and bound to a callback as solutions arrive."""

    def __init__(self, report, floor: float | None = None):
        super().__init__()
        self._report = report
        self._t0 = time.perf_counter()
        self._floor = floor or 0.0  # a bound known from elsewhere (the LP relaxation)

    def on_solution_callback(self) -> None:
        obj, bound = self.ObjectiveValue(), max(self.BestObjectiveBound(), self._floor)
        gap = 0.0 if obj == 0 else abs(obj - bound) / max(abs(obj), 1e-9)
        self._report({"elapsed_s": time.perf_counter() - self._t0, "objective": obj,
                      "bound": bound, "gap": gap})


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


# The least time a search phase gets even when the time limit is spent (CP-SAT needs a moment to
# return the hinted plan): a solve returns within time_limit_s plus a few of these.
MIN_SLICE_S = 0.2


def _solver(time_limit_s: float, num_workers: int | None, deterministic: bool, seed: int = 0
            ) -> cp_model.CpSolver:
    solver = new_solver()
    workers = num_workers if num_workers is not None else 8
    solver.parameters.num_workers = workers
    if deterministic:
        solver.parameters.max_deterministic_time = float(time_limit_s)
        solver.parameters.interleave_search = workers > 1
    solver.parameters.max_time_in_seconds = float(time_limit_s) * (4 if deterministic else 1)
    solver.parameters.random_seed = seed
    return solver


# Plans found earlier in this process, per graph fingerprint: a sweep over budgets seeds each solve
# with every earlier plan that fits, so a larger budget never starts from worse than a smaller one's
# plan. Pure data (saved sets and their peaks), bounded, never steering anything else.
_KNOWN_PLANS: dict[str, list[tuple[frozenset, int]]] = {}
_KNOWN_PER_GRAPH = 32
# Plans with reruns (a value recomputed more than once), found below what CP-SAT's model reaches:
# (saved set, reruns, peak) per graph fingerprint.
_KNOWN_RERUNS: dict[str, list[tuple[frozenset, tuple, int]]] = {}


def _remember_reruns(cg: CostGraph, saved, rerun, peak: int) -> None:
    plans = _KNOWN_RERUNS.setdefault(cg.fingerprint, [])
    plans.append((frozenset(saved), tuple(rerun), peak))
    del plans[:-_KNOWN_PER_GRAPH]
    if len(_KNOWN_RERUNS) > 64:
        _KNOWN_RERUNS.pop(next(iter(_KNOWN_RERUNS)))


def _remember(cg: CostGraph, saved) -> None:
    plans = _KNOWN_PLANS.setdefault(cg.fingerprint, [])
    plans.append((frozenset(saved), simulate(cg, build_schedule(cg, saved)).peak_bytes))
    del plans[:-_KNOWN_PER_GRAPH]
    if len(_KNOWN_PLANS) > 64:
        _KNOWN_PLANS.pop(next(iter(_KNOWN_PLANS)))


def block_classes(cg: CostGraph) -> list[list[str]]:
    """Candidates that correspond across identical repeated blocks: one list per position.

    Blocks (``remat.block``) whose forward nodes have the same ops, shapes and dtypes in the same
    order are identical; the i-th candidate of each forms one class. Empty if there are none.
    """
    return [list(p) for stack in identical_blocks(cg) for p in stack.positions]


def _warm_start(cg: CostGraph, budget_bytes: int, time_limit_s: float, num_workers, deterministic,
                forced_saved, forbidden_saved, hint=None, objective: str = "runtime") -> set[str] | None:
    """Solve with identical blocks tied to the same decisions; None if there are no such blocks."""
    classes = block_classes(cg)
    if not classes:
        return None
    rm = build_model(cg, budget_bytes, forced_saved=forced_saved, forbidden_saved=forbidden_saved,
                     objective=objective)
    for cls in classes:
        first = rm.saved.get(cls[0])
        for v in cls[1:]:
            if first is not None and v in rm.saved:
                rm.model.add(rm.saved[v] == first)
    if hint is not None:
        _hint(rm, cg, hint)
    solver = _solver(max(0.5, time_limit_s), num_workers, deterministic)
    status = run_solver(solver, rm.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {v for v, var in rm.saved.items() if solver.value(var)}


def _blockwise(cg: CostGraph, budget_bytes: int, objective: str, time_limit_s: float, forced_saved,
               forbidden_saved) -> set[str] | None:
    """The per-block decomposition's plan (:mod:`.blockwise`), if the graph has at least 3 identical
    blocks and the plan honours the forced and forbidden saves."""
    stack = block_stack(cg)
    if stack is None or len(stack.blocks) < 3:
        return None
    saved = blockwise_saved_set(cg, budget_bytes, block_boundary_set(cg),
                                lambda n: cost_units(cg, n, objective), time_limit_s=time_limit_s)
    return saved if saved is not None and _complies(saved, forced_saved, forbidden_saved) else None


def _block_decomposition(cg: CostGraph, budget_bytes: int, objective: str, time_limit_s: float,
                         num_workers, deterministic):
    """The block decomposition's bound (:mod:`.blockbound`) and its plan: the bound's choice of
    block plans, with what lies outside the blocks left to a CP-SAT solve of the full model (the
    composition saves everything there, which may not fit). Returns (bound in cost units or None,
    saved set that fits or None)."""
    t0 = time.perf_counter()
    found = block_bound(cg, budget_bytes, lambda n: cost_units(cg, n, objective),
                        time_limit_s=0.88 * time_limit_s, cost_key=objective)
    if found is None:
        return None, None
    if found.saved is None:
        return found.bound, None
    blocks = found.block_candidates
    rm = build_model(cg, budget_bytes, objective=objective,
                     forced_saved=[v for v in blocks if v in found.saved],
                     forbidden_saved=[v for v in blocks if v not in found.saved])
    _hint(rm, cg, found.saved)
    solver = _solver(max(0.5, time_limit_s - (time.perf_counter() - t0)), num_workers, deterministic)
    if run_solver(solver, rm.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return found.bound, None
    saved = {v for v, var in rm.saved.items() if solver.value(var)}
    if simulate(cg, build_schedule(cg, saved)).peak_bytes > budget_bytes:
        return found.bound, None
    return found.bound, saved


def _complies(saved, forced_saved, forbidden_saved) -> bool:
    """Whether a saved set honours the forced and forbidden saves of a policy."""
    saved = set(saved)
    return set(forced_saved) <= saved and not saved & set(forbidden_saved)


def _hint(rm: RematModel, cg: CostGraph, saved) -> None:
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


def _next_lowest(rm: RematModel, found: list[frozenset], count: int, deadline: float, num_workers,
                 deterministic: bool, seed: int) -> list[frozenset]:
    """Up to ``count`` more lowest-peak saved sets, each different from every one before it."""
    out: list[frozenset] = []
    for S in found:
        _exclude(rm, S)
    for _ in range(count):
        left = deadline - time.perf_counter()
        if left <= 0.05:
            break
        solver = _solver(left, num_workers, deterministic, seed)
        if run_solver(solver, rm.model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            break
        S = frozenset(v for v, var in rm.saved.items() if solver.value(var))
        out.append(S)
        _exclude(rm, S)
    return out


def _exclude(rm: RematModel, saved: frozenset) -> None:
    """Forbid the exact saved set ``saved`` in the model (a no-good cut)."""
    flips = [(1 - var) if v in saved else var for v, var in rm.saved.items() if not is_const(var)]
    if flips:
        rm.model.add(sum(flips) >= 1)


def min_feasible_peak(cg: CostGraph, *, time_limit_s: float = 30.0, num_workers: int | None = None,
                      deterministic: bool = False, forced_saved=(), forbidden_saved=(), reruns: bool = True,
                      seed: int = 0) -> tuple[int, bool, list[str], list[tuple[str, int]]]:
    """The smallest feasible budget: the least peak of any plan (bytes) that saves ``forced_saved``
    and none of ``forbidden_saved``, whether that is proven optimal, and the plan reaching it (saved
    set and reruns). ``time_limit_s`` bounds the whole call (plus :data:`MIN_SLICE_S` per phase at
    worst).

    CP-SAT finds the lowest-peak plan that recomputes each value at most once; with ``reruns``,
    :func:`~remat_compiler.solvers.rerun.lower_peak` then recomputes values again where that lowers
    the peak. "Proven" means CP-SAT proved its optimum over the plans searched: without ``reruns``,
    plans that recompute each value once; with them, only where no value of the graph can be
    recomputed twice (reruns are searched locally, so where they exist there is no proof). Which plans
    reruns start from depends on the solutions CP-SAT meets, so ``seed`` (CP-SAT's random seed)
    varies the search; every plan found is remembered for later calls on the same graph."""
    t0 = time.perf_counter()
    rm = build_model(cg, None, minimize="peak", forced_saved=forced_saved, forbidden_saved=forbidden_saved)
    hints = []
    try:
        S = block_boundary_set(cg)
        hints.append((S, simulate(cg, build_schedule(cg, S)).peak_bytes))
    except ValueError:  # no repeated blocks: the (slower) drop-greedy seeds the search instead
        hints.append(greedy_saved_set(cg, 0, deadline=t0 + 0.3 * time_limit_s))
    start = min(hints, key=lambda h: h[1])[0]
    _hint(rm, cg, start)
    end = t0 + time_limit_s  # the whole call: CP-SAT's solve, then the rerun search
    cp_share = 0.7 if reruns and not deterministic else 1.0
    solver = _solver(max(MIN_SLICE_S, cp_share * time_limit_s - (time.perf_counter() - t0)), num_workers,
                     deterministic, seed)
    collect = _Collect(rm.saved)
    status = run_solver(solver, rm.model, collect)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        saved = [v for v, var in rm.saved.items() if solver.value(var)]
    elif status == cp_model.UNKNOWN:  # the time ran out before CP-SAT returned the hinted plan
        saved = sorted(start)
    else:
        raise RuntimeError(f"CP-SAT found no plan at all ({solver.status_name(status)})")
    peak = simulate(cg, build_schedule(cg, saved)).peak_bytes
    known = [(p, S) for S, p in _KNOWN_PLANS.get(cg.fingerprint, ())
             if p < peak and _complies(S, forced_saved, forbidden_saved)]
    if status != cp_model.OPTIMAL and known:  # an earlier solve already reached lower
        peak, low = min(known, key=lambda k: k[0])
        saved = sorted(low)
    _remember(cg, saved)
    # CP-SAT's optimum covers plans that recompute each value once; a plan that recomputes a value
    # twice may peak lower, and reruns are only searched locally: with reruns allowed, a proof
    # needs a graph where no value can be recomputed twice
    proven = status == cp_model.OPTIMAL and not (reruns and any(rerunnable(cg, n) for n in cg.fw_order))
    rerun = []
    if reruns:
        # Plans of nearly the same peak differ in how much reruns can take off it: lower several
        # (CP-SAT's last solutions, newest first, and the chosen one), keep the lowest.
        starts = list(dict.fromkeys([frozenset(saved), *reversed(collect.found)]))
        deadline = max(end, time.perf_counter() + MIN_SLICE_S)
        if status == cp_model.OPTIMAL:
            # a graph small enough to prove: also take the next-lowest distinct plans (each solve
            # excludes the plans before it), so the result does not hang on which optimum CP-SAT met
            starts += _next_lowest(rm, starts, 8, deadline - 0.5 * (deadline - time.perf_counter()),
                                   num_workers, deterministic, seed)
        best = (peak, frozenset(saved), ())
        for i, S in enumerate(starts):
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            found, sim = lower_peak(cg, S, cost_of=lambda n: cost_units(cg, n, "runtime"),
                                    time_limit_s=left / (len(starts) - i))
            if sim.peak_bytes < best[0]:
                best = (sim.peak_bytes, S, tuple(found))
        earlier = [(p, S, R) for S, R, p in _KNOWN_RERUNS.get(cg.fingerprint, ())
                   if _complies(S, forced_saved, forbidden_saved)]
        best = min([best, *earlier], key=lambda k: k[0])
        if best[0] < peak:
            peak, saved, rerun, proven = best[0], sorted(best[1]), list(best[2]), False
            _remember_reruns(cg, saved, rerun, peak)
    return peak, proven, saved, rerun


def solve_cpsat(cg: CostGraph, budget_bytes: int | None, *, time_limit_s: float = 30.0,
                num_workers: int | None = None, deterministic: bool = False, minimize_peak: bool = True,
                forced_saved=(), forbidden_saved=(), progress=None, warm_start: bool = True,
                block_reuse: bool = True, block_reuse_share: float = 0.4, objective: str = "runtime",
                reruns: bool = True, **opts) -> Plan:
    """Minimise recompute cost subject to the simulated peak <= ``budget_bytes``.

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int | None
        Peak bound in bytes; None returns the no-recompute plan's cost (0) with the smallest peak.
    time_limit_s : float
        For the whole call: warm start, cost solve, peak solve and, for an infeasible budget, the
        lowest-peak search that names the smallest feasible budget. Each phase that finds the time
        spent still gets :data:`MIN_SLICE_S`, and building models and plans is not interrupted, so
        the call returns within about ``time_limit_s + 1 s`` on graphs of a few thousand nodes.
        With ``deterministic`` the CP-SAT searches run on deterministic time (same plan every run)
        and may take longer in wall time.
    num_workers : int, optional
        CP-SAT workers (default 8: CP-SAT's portfolio of strategies needs several, even on few cores).
    deterministic : bool
        Use CP-SAT deterministic time for the limit and interleaved search, so the same graph and
        budget give the same plan on every run and machine (slower). Under torch.distributed the plan
        is made on rank 0 and broadcast, so ranks agree either way.
    minimize_peak : bool
        After the cost is found, minimise the peak among plans of that cost.
    warm_start : bool
        Hint CP-SAT with the no-recompute plan if it fits, else with the best of the heuristics and
        (``block_reuse``) the block-uniform plan.
    block_reuse, block_reuse_share :
        Reuse identical repeated blocks (transformer layers): with 3 or more (no policy, not
        ``deterministic``), the block decomposition (:mod:`remat_compiler.solvers.blockbound`)
        gives a proven lower bound and, from its choice of per-block plans, a plan; when that plan
        meets the bound (up to the tie-break) no search follows. Otherwise per-block options
        composed under the budget (:mod:`remat_compiler.solvers.blockwise`), or the model where
        identical blocks make the same decisions (for this share of the time limit), seed the full
        model, which may then treat each block differently. Every plan is still checked by the
        simulator.
    forced_saved, forbidden_saved :
        Candidate names that must / must not be saved (user policies).
    progress : callable, optional
        Called with ``{"elapsed_s", "objective", "bound", "gap"}`` on each improving solution.
    objective : "runtime" | "flops"
        The recompute cost minimised: estimated runtime (default; memory-bound ops cost their
        bytes moved) or counted FLOPs (what FLOP-overhead tables measure; see :func:`cost_units`;
        fewer recomputed ops break ties, a secondary criterion outside the status and gap).
    reruns : bool
        Below the lowest peak of plans that recompute each value once, look for plans that
        recompute some values again (:mod:`remat_compiler.solvers.rerun`).

    Returns
    -------
    Plan
        ``status`` "optimal", or "feasible" with the proven relative ``gap`` of the cost (under
        ``"flops"``, of the counted FLOPs; see :func:`_flops_primary`).

    Raises
    ------
    InfeasibleBudgetError
        If no plan fits; it names the smallest feasible budget.
    """
    t0 = time.perf_counter()
    end = t0 + time_limit_s

    def left(cap: float = math.inf) -> float:  # what remains of the time limit, at most ``cap``
        return max(MIN_SLICE_S, min(cap, end - time.perf_counter()))
    if opts:
        raise TypeError(f"solve_cpsat got unknown options {sorted(opts)}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    all_saved = set(save_all_set(cg))
    base_peak = simulate(cg, build_schedule(cg, all_saved)).peak_bytes
    warm, block_lb, decomposed = None, None, None
    if budget_bytes is None or base_peak <= budget_bytes:
        warm = all_saved if _complies(all_saved, forced_saved, forbidden_saved) else None
    elif warm_start:
        heuristic, _ = best_heuristic_set(cg, budget_bytes, lambda n: cost_units(cg, n, objective),
                                          deadline=t0 + 0.3 * time_limit_s)
        free = (objective == "flops" and heuristic is not None
                and flop_gap(cg, build_schedule(cg, heuristic).recomputed, 0) == 0)
        if block_reuse and not forced_saved and not forbidden_saved and not free and not deterministic:
            # identical blocks: the decomposition's bound, and its plan (often optimal); not when the
            # heuristic's plan recomputes no counted FLOPs (it is FLOP-optimal already), nor in
            # deterministic mode (its solves run against the wall clock)
            block_lb, decomposed = _block_decomposition(cg, budget_bytes, objective, left(0.85 * time_limit_s),
                                                        num_workers, deterministic)
        composed = tied = None
        if block_reuse and decomposed is None:  # per-block options composed under the budget
            composed = _blockwise(cg, budget_bytes, objective, left(min(15.0, 0.3 * time_limit_s)),
                                  forced_saved, forbidden_saved)
        if block_reuse and decomposed is None and composed is None:
            tied = _warm_start(cg, budget_bytes, left(time_limit_s * block_reuse_share), num_workers,
                               deterministic, forced_saved, forbidden_saved, heuristic, objective)
        known = [S for S, peak in _KNOWN_PLANS.get(cg.fingerprint, ()) if peak <= budget_bytes]
        warm = min([w for w in (decomposed, composed, tied, heuristic, *known)
                    if w is not None and _complies(w, forced_saved, forbidden_saved)], default=None,
                   key=lambda w: _set_cost_units(cg, w, objective))
    floor = None
    if budget_bytes is not None and warm is None and warm_start:
        # no heuristic plan fits, so the budget may lie below every plan's peak: find that floor
        # first (on 85% of the time left) rather than after a cost search that cannot succeed; it
        # names the smallest budget, or its plan starts the cost search, which gets the rest
        floor = min_feasible_peak(cg, time_limit_s=0.85 * left(), num_workers=num_workers,
                                  deterministic=deterministic, forced_saved=forced_saved,
                                  forbidden_saved=forbidden_saved, reruns=reruns)
        fits = [(S, R) for S, R, p in _KNOWN_RERUNS.get(cg.fingerprint, ())
                if reruns and p <= budget_bytes and _complies(S, forced_saved, forbidden_saved)]
        if floor[0] > budget_bytes and not fits:
            raise InfeasibleBudgetError(budget_bytes, floor[0], proven=floor[1])
        if simulate(cg, build_schedule(cg, floor[2])).peak_bytes <= budget_bytes:
            warm = set(floor[2])
    t_build = time.perf_counter()
    rm = build_model(cg, budget_bytes, forced_saved=forced_saved, forbidden_saved=forbidden_saved,
                     objective=objective)
    if warm is not None:
        _hint(rm, cg, warm)
    t_build = time.perf_counter() - t_build
    # the LP bound matters only where something must be recomputed (otherwise the optimum costs 0)
    needs_recompute = budget_bytes is not None and base_peak > budget_bytes
    relaxed = lp_bound(rm, left(min(5.0, 0.2 * time_limit_s))) if needs_recompute else None
    if block_lb is not None and math.isfinite(block_lb):  # the decomposition's, in cost units
        relaxed = max(relaxed or 0.0, block_lb / rm.cost_gcd)
    total_s = time_limit_s
    share = 0.8 if minimize_peak else 1.0  # the rest goes to the peak-minimising second solve
    warm_cost = _set_cost_units(cg, warm, objective) / rm.cost_gcd if warm is not None else None
    if (decomposed is not None and warm is not None and relaxed is not None
            and warm_cost <= relaxed + max(1.0, 1e-5 * warm_cost)):
        # the decomposition's plan meets its bound (up to a few tie-break units outside the
        # blocks): a search could not improve it meaningfully, so it stands for the search's result
        solver, status = None, "proven"
    else:
        solver = _solver(max(MIN_SLICE_S, share * total_s - (time.perf_counter() - t0)), num_workers,
                         deterministic)
        cb = _Progress(progress, relaxed) if progress else None
        status = run_solver(solver, rm.model, cb)
    if status == "proven":
        saved = set(build_schedule(cg, warm).saved)
        best_cost = _set_cost_units(cg, saved, objective) // rm.cost_gcd
        bound = relaxed
        optimal = bound >= best_cost
        gap = 0.0 if optimal or best_cost == 0 else max(0.0, (best_cost - bound) / best_cost)
        model_peak = simulate(cg, build_schedule(cg, saved)).peak_bytes
        if progress:
            progress({"elapsed_s": time.perf_counter() - t0, "objective": best_cost, "bound": bound,
                      "gap": gap})
    elif status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"CP-SAT model invalid: {rm.model.validate()}")
    elif status == cp_model.UNKNOWN and warm is not None:
        # CP-SAT stopped before reaching the hinted plan (a big graph's presolve): that plan fits
        saved = set(build_schedule(cg, warm).saved)
        best_cost = _set_cost_units(cg, saved, objective) // rm.cost_gcd
        bound = max(solver.best_objective_bound, relaxed or 0.0)
        gap = 0.0 if best_cost == 0 else max(0.0, (best_cost - bound) / best_cost)
        model_peak, optimal = simulate(cg, build_schedule(cg, saved)).peak_bytes, False
    elif status in (cp_model.INFEASIBLE, cp_model.UNKNOWN):
        # No plan yet: find the lowest-peak plan; it names the smallest budget, or seeds a second try.
        # Below what CP-SAT's model reaches, only plans that recompute a value more than once fit.
        bound = solver.best_objective_bound if status == cp_model.UNKNOWN else 0.0
        # what is left of the time limit (the cost search stops at 80% of it when it finds nothing)
        # goes to the lowest-peak search, less a share for a second cost search from its plan
        search_s = left() * (0.6 if status == cp_model.UNKNOWN else 1.0)
        min_peak, proven, low, rerun = floor or min_feasible_peak(
            cg, time_limit_s=max(MIN_SLICE_S, search_s), num_workers=num_workers,
            deterministic=deterministic, forced_saved=forced_saved, forbidden_saved=forbidden_saved,
            reruns=reruns)
        # A budget named by an earlier search (another process) may need the rerun plan that
        # search met: look again from other CP-SAT seeds before calling the budget infeasible.
        for seed in (1, 2):
            if not reruns or budget_bytes is None or not 0.9 * min_peak <= budget_bytes < min_peak \
                    or end - time.perf_counter() < 2 * MIN_SLICE_S:
                break
            best = min_feasible_peak(
                cg, time_limit_s=left() / 2, num_workers=num_workers, deterministic=deterministic,
                forced_saved=forced_saved, forbidden_saved=forbidden_saved, seed=seed)
            if best[0] < min_peak:
                min_peak, proven, low, rerun = best
        fitting = [(S, R) for S, R, p in _KNOWN_RERUNS.get(cg.fingerprint, ())
                   if reruns and budget_bytes is not None and p <= budget_bytes
                   and _complies(S, forced_saved, forbidden_saved)]
        if budget_bytes is not None and min_peak > budget_bytes and not fitting:
            raise InfeasibleBudgetError(budget_bytes, min_peak, proven=proven)
        single_fits = budget_bytes is None or simulate(cg, build_schedule(cg, low)).peak_bytes <= budget_bytes
        if status != cp_model.INFEASIBLE and single_fits:  # CP-SAT again, from the lowest-peak plan
            rm = build_model(cg, budget_bytes, forced_saved=forced_saved, forbidden_saved=forbidden_saved,
                             objective=objective)
            _hint(rm, cg, low)
            solver = _solver(left(), num_workers, deterministic)
            status = run_solver(solver, rm.model, cb)
        else:
            status = cp_model.UNKNOWN
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):  # keep the cheapest lowest-peak plan
            options = fitting + ([(low, [])] if single_fits else [])
            low, rerun = min(options, key=lambda p: _set_cost_units(cg, p[0], objective, p[1]))
            schedule = build_schedule(cg, low, rerun)
            cost = _set_cost_units(cg, low, objective, rerun)
            plan = make_plan(cg, low, budget_bytes=budget_bytes, solver="cpsat", status="feasible",
                             gap=0.0 if cost == 0 else max(0.0, 1 - bound * rm.cost_gcd / cost),
                             solve_time_s=time.perf_counter() - t0,
                             model_peak_bytes=simulate(cg, schedule).peak_bytes,
                             baseline_peak_bytes=base_peak, rerun=rerun,
                             extras={"cost_units": cost, "cost_bound_units": bound * rm.cost_gcd,
                                     "objective": objective})
            return _flops_primary(cg, plan, objective)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        saved = {v for v, var in rm.saved.items() if solver.value(var)}
        best_cost = int(round(solver.objective_value))
        bound = max(solver.best_objective_bound, relaxed or 0.0)
        optimal = status == cp_model.OPTIMAL or bound >= best_cost
        gap = 0.0 if optimal or best_cost == 0 else max(0.0, (best_cost - bound) / best_cost)
        model_peak = solver.value(rm.peak) * rm.unit_bytes
    # the peak-minimising second solve, if there is time to build its model and search
    finish_s = 0.05 * total_s  # kept for building the plan after the last solve
    if minimize_peak and total_s - (time.perf_counter() - t0) > 2 * t_build + finish_s + 0.5:
        rm2 = build_model(cg, budget_bytes, minimize="peak", max_cost=best_cost * rm.cost_gcd,
                          forced_saved=forced_saved, forbidden_saved=forbidden_saved, objective=objective)
        _hint(rm2, cg, saved)
        left = total_s - (time.perf_counter() - t0) - finish_s
        solver2 = _solver(max(0.2, min(left, 0.25 * total_s)), num_workers, deterministic)
        status2 = run_solver(solver2, rm2.model)
        if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            saved = {v for v, var in rm2.saved.items() if solver2.value(var)}
            model_peak = solver2.value(rm2.peak) * rm2.unit_bytes
    _remember(cg, saved)
    plan = make_plan(cg, saved, budget_bytes=budget_bytes, solver="cpsat",
                     status="optimal" if optimal else "feasible", gap=gap,
                     solve_time_s=time.perf_counter() - t0, model_peak_bytes=model_peak,
                     baseline_peak_bytes=base_peak,
                     extras={"cost_units": best_cost * rm.cost_gcd, "cost_bound_units": bound * rm.cost_gcd,
                             "objective": objective})
    return _flops_primary(cg, plan, objective)


def _flops_primary(cg: CostGraph, plan: Plan, objective: str) -> Plan:
    """Under ``objective="flops"``, make the plan's status and gap those of counted FLOPs alone.

    The solver minimises kFLOPs plus 1 per recomputed op; the per-op term only breaks ties between
    plans of equal FLOPs (a secondary criterion). So a plan is "optimal" when no fitting plan
    recomputes fewer FLOPs (:func:`flop_gap` is 0), and its gap is the FLOP gap; the gap on the
    whole objective, tie-break included, stays in ``extras["tiebreak_gap"]``.
    """
    if objective != "flops":
        return plan
    fg = flop_gap(cg, plan.recomputed, plan.extras["cost_bound_units"])
    plan.extras.update(flop_gap=fg, tiebreak_gap=plan.gap)
    plan.status, plan.gap = ("optimal" if fg == 0.0 or plan.status == "optimal" else "feasible",
                             0.0 if plan.status == "optimal" else fg)
    return plan
