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

import math
import time
from dataclasses import dataclass
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.budget import human_bytes
from remat_compiler.clock import Deadline
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.schedule import (Schedule, bw_time, build_schedule, no_recompute, recomputed_outputs,
                                     save_all_set, simulate)
from remat_compiler.solvers.combine_choice import CombineUnion
from remat_compiler.solvers.cpsat.costs import cost_units
from remat_compiler.solvers.cpsat.parts import (add_decisions, add_first_need, add_value_intervals, alloc_index,
                                                is_const, storage_readers)
from remat_compiler.solvers.cpsat.run import make_solver, run_solver
from remat_compiler.solvers.greedy import best_heuristic_set

__all__ = ["Choice", "ChoiceModel", "WarmStart", "union_steps", "build_choice_model", "piece_comm_units",
           "hint_pure_choice", "solve_choice", "reasons"]


@dataclass
class Choice:
    """What the one solve chose.

    Attributes
    ----------
    modes : dict of str to str
        Each segment's combine, ``"autograd"`` or ``"fused"``.
    saved : list of str
        The forward values saved (names are the same in every mode's graph).
    model_peak_bytes : int
        The model's peak variable: a bound of the simulated peak of the saved set on the graph
        traced with ``modes``, equal to it when the peak stage is proven optimal (a plan reports
        the simulated one, :attr:`~remat_compiler.plan.Plan.peak_bytes`).
    cost : int
        The recompute cost, with what each segment's chosen backward piece's collectives cost
        above the other piece's (:func:`piece_comm_units`), in
        :func:`~remat_compiler.solvers.cpsat.costs.cost_units`.
    status : str
        ``"optimal"`` or ``"feasible"`` (of the recompute cost).
    solve_time_s : float
    gap : float
        The proven relative gap of the cost (0 when optimal).
    """

    modes: dict[str, str]
    saved: list[str]
    model_peak_bytes: int
    cost: int
    status: str
    solve_time_s: float
    gap: float = 0.0


@dataclass
class ChoiceModel:
    """The built model and the handles to read a solution back: the per-segment Booleans (true:
    fused), the save decisions, the peak variable (in ``unit_bytes``) and the cost expression."""

    model: cp_model.CpModel
    fused: dict[str, cp_model.IntVar]
    saved: dict[str, cp_model.IntVar]
    peak: cp_model.IntVar
    cost: cp_model.LinearExpr
    unit_bytes: int
    recomputed: dict[str, cp_model.IntVar] | None = None
    need: dict[str, cp_model.IntVar] | None = None


def union_steps(union: CombineUnion) -> list[tuple[str, str, str | None]]:
    """The union backward: ``(mode, name, segment)`` per step, ``mode`` ``"shared"`` (autograd's
    name) or the piece's mode; each segment's autograd piece runs, then its fused one."""
    cg_a = union.graphs["autograd"]
    starts = {both["autograd"].start: seg for seg, both in union.pieces.items()}
    inside = {n for both in union.pieces.values() for n in both["autograd"].nodes}
    steps = []
    for j, n in enumerate(cg_a.bw_order):
        if j in starts:
            seg = starts[j]
            steps += [("autograd", m, seg) for m in union.pieces[seg]["autograd"].nodes]
            steps += [("fused", m, seg) for m in union.pieces[seg]["fused"].nodes]
        if n not in inside:
            steps.append(("shared", n, None))
    return steps


def _time_maps(union: CombineUnion, steps):
    """``to_union[mode](t)``: a time of that mode's all-one-mode graph on the union's axis."""
    F = len(union.graphs["autograd"].fw_order)
    step_of = {"autograd": {}, "fused": {}}
    fused_name = {a: f for a, f in union.shared}
    for k, (mode, n, _seg) in enumerate(steps):
        if mode == "shared":
            step_of["autograd"][n] = k
            step_of["fused"][fused_name[n]] = k
        else:
            step_of[mode][n] = k

    def mapper(mode):
        order = union.graphs[mode].bw_order

        def to_union(t: int) -> int:
            if t < F:
                return t
            j, slot = divmod(t - F, F + 1)
            return bw_time(F, step_of[mode][order[j]], slot if slot < F else None)
        return to_union
    return {mode: mapper(mode) for mode in ("autograd", "fused")}


def _readers_by_segment(union: CombineUnion) -> dict[str, set[str]]:
    """Autograd-graph names of the values outside the pieces that each segment's pieces read."""
    autograd_name = {f: a for a, f in union.shared}
    found: dict[str, set[str]] = {}
    for seg, both in union.pieces.items():
        for mode, piece in both.items():
            cg = union.graphs[mode]
            inside = set(piece.nodes)
            for n in piece.nodes:
                for p in cg.preds(n):
                    if p in inside:
                        continue
                    for q in (p, cg.storage(p)):
                        if q is not None:
                            found.setdefault(autograd_name.get(q, q) if mode == "fused" else q, set()).add(seg)
    return found


def build_choice_model(union: CombineUnion, budget_bytes: int | None, *, objective: str = "runtime"):
    """Build the one model (see the module docstring).

    Parameters
    ----------
    union : CombineUnion
    budget_bytes : int | None
        Upper bound of the peak (None: unbounded).
    objective : "runtime" | "flops"
        What the recompute cost counts (:func:`~remat_compiler.solvers.cpsat.costs.cost_units`).

    Returns
    -------
    ChoiceModel
    """
    cg = union.graphs["autograd"]  # the forward, and the shared backward by its names
    graphs = union.graphs
    steps = union_steps(union)
    B = len(steps)
    F, fw_reads, _bw, rc_readers = storage_readers(cg)
    m = cp_model.CpModel()
    fused = {seg: m.new_bool_var(f"fused_{seg}") for seg in union.pieces}
    lit = {"autograd": {s: ~b for s, b in fused.items()}, "fused": fused}
    to_union = _time_maps(union, steps)

    # the backward's reads of forward values, each with the literal of its piece (None: always)
    in_m = {v for v in cg.fw_order if not cg.is_available_in_bw(v)}
    M = [v for v in cg.fw_order if v in in_m]
    direct_first: dict[str, int] = {}
    cond_direct: dict[str, list] = {}
    bw_last: dict[str, int] = {}
    cond_last: dict[str, list] = {}
    for k, (mode, n, seg) in enumerate(steps):
        g = graphs["autograd" if mode == "shared" else mode]
        when = None if mode == "shared" else lit[mode][seg]
        for p in g.preds(n):
            # a read through a backward view (a detach of the saved log-softmax) reads its forward
            # storage too, as in the base model's storage_readers
            o = g.storage(p)
            if o is not None and g.attr(o, "phase") != "fw":
                o = None
            direct = g.attr(p, "phase") == "fw" and p in in_m
            if when is None:
                if direct:
                    direct_first.setdefault(p, k)
                if o is not None:
                    bw_last[o] = k
            else:
                if direct:
                    cond_direct.setdefault(p, []).append((k, when))
                if o is not None:
                    cond_last.setdefault(o, []).append((k, when))
    s, r, need = add_decisions(m, cg, M, set(direct_first))
    for v, reads in cond_direct.items():
        for _k, when in reads:
            if not is_const(need[v]):
                m.add_implication(when, need[v])

    # first[v]: the first step needing v; st[v]: where a recomputed v is materialised
    st = {v: m.new_int_var(0, direct_first.get(v, B - 1), f"st_{v}") for v in M}
    first = {v: m.new_int_var(0, B - 1, f"first_{v}") for v in M}
    cond_reads = {}  # a piece's read of v: at its step when the piece is present, else never (B - 1)
    for v, reads in cond_direct.items():
        for k, when in reads:
            x = m.new_int_var(0, B - 1, f"xc_{v}_{k}")
            m.add(x == k).only_enforce_if(when)
            m.add(x == B - 1).only_enforce_if(~when)
            cond_reads.setdefault(v, []).append(x)
    add_first_need(m, cg, M, r, direct_first, B, first, st, more_reads=cond_reads)

    # intervals: (start, end, bytes, literal or None; end may be a variable)
    fixed = _fixed_intervals(union, to_union, lit)
    cands = cg.candidates
    sizes = [cg.attr(c, "bytes") for c in cg.fw_order if cg.storage(c) == c] + [b for _a, _z, b, _w in fixed]
    unit = reduce(math.gcd, [b for b in sizes if b > 0], 0) or 1
    intervals, demands = [], []
    for i, (a, z, size, when) in enumerate(fixed):
        if when is None:
            intervals.append(m.new_fixed_size_interval_var(a, z - a + 1, f"fix_{i}"))
        else:
            intervals.append(m.new_optional_fixed_size_interval_var(a, z - a + 1, when, f"opt_{i}"))
        demands.append(size // unit)
    idx = cg.fw_index
    for v in cands:
        size = cg.attr(v, "bytes") // unit
        a = alloc_index(cg, v)
        e = max(fw_reads.get(v, a), a)
        intervals.append(m.new_fixed_size_interval_var(a, e - a + 1, f"fw_{v}"))
        demands.append(size)
        if v not in in_m:
            continue
        more, more_demands, _aux = add_value_intervals(m, cg, v, size, s, r, st, F, B, e, bw_last.get(v, -1),
                                                       rc_readers.get(v, ()), in_m, cond_last.get(v, ()))
        intervals += more
        demands += more_demands
    cand_set = set(cands)
    for v in M:  # a recomputed multi-output op: its untaken outputs, and those it takes, while it runs
        if not cg.attr(v, "is_tuple"):
            continue
        if cg.attr(v, "bytes") > 0 and v not in cand_set:
            span = max([idx[u] for u in cg.g.successors(v) if u in in_m], default=idx[v]) - idx[v] + 1
            start = m.new_int_var(bw_time(F, 0, idx[v]), bw_time(F, B - 1, idx[v]), f"tups_{v}")
            m.add(start == bw_time(F, st[v], idx[v]))
            intervals.append(m.new_optional_fixed_size_interval_var(start, span, r[v], f"tup_{v}"))
            demands.append(cg.attr(v, "bytes") // unit)
        if cg.attr(v, "never_recompute"):
            continue
        for u in recomputed_outputs(cg, v):
            if u in r:
                present = m.new_bool_var(f"tmp_{u}")
                m.add_bool_and([r[v], ~r[u]]).only_enforce_if(present)
                m.add_bool_or([~r[v], r[u], present])
            else:
                present = r[v]
            at = m.new_int_var(bw_time(F, 0, idx[v]), bw_time(F, B - 1, idx[v]), f"tmps_{u}")
            m.add(at == bw_time(F, st[v], idx[v]))
            intervals.append(m.new_optional_fixed_size_interval_var(at, 1, present, f"tmp_{u}"))
            demands.append(cg.attr(u, "bytes") // unit)
    cap_hi = sum(demands) + 1
    peak_hi = cap_hi if budget_bytes is None else min(cap_hi, budget_bytes // unit)
    peak = m.new_int_var(0, max(peak_hi, 0), "peak")
    m.add_cumulative(intervals, demands, peak)
    costs = {v: cost_units(cg, v, objective) for v in M}
    cost = sum(costs[v] * r[v] for v in M if costs[v] > 0)
    for seg, units in piece_comm_units(union, objective).items():  # the dearer piece's collectives
        least = min(units.values())
        if units["fused"] > least:
            cost += (units["fused"] - least) * fused[seg]
        if units["autograd"] > least:
            cost += (units["autograd"] - least) * (1 - fused[seg])
    m.minimize(cost)  # the least cost; solve_choice then the least peak at it, in a second stage
    return ChoiceModel(m, fused, s, peak, cost, unit, r, need)


def piece_comm_units(union: CombineUnion, objective: str = "runtime") -> dict[str, dict[str, int]]:
    """Per segment and mode, the cost of the collectives its backward piece runs, in
    :func:`~remat_compiler.solvers.cpsat.costs.cost_units` (the runtime objective: their roofline
    time, communication at the cost model's link bandwidth).

    Under expert parallelism the pieces hold different collectives (the fused one sends the
    probabilities to the experts and ``dL/dp`` back besides ``G``), which every rank runs once in
    backward whatever is saved: the choice model adds, for the piece chosen, what its collectives
    cost above the other piece's. Without a group both are 0.

    Returns
    -------
    dict of str to dict of str to int
        ``{segment: {"autograd": units, "fused": units}}``.
    """
    found = {}
    for seg, both in union.pieces.items():
        found[seg] = {}
        for mode, piece in both.items():
            g = union.graphs[mode]
            found[seg][mode] = sum(cost_units(g, n, objective) for n in piece.nodes if g.attr(n, "comm_bytes") > 0)
    return found


def _fixed_intervals(union: CombineUnion, to_union, lit) -> list[tuple[int, int, int, object]]:
    """The lives no save decision changes, on the union's axis, with the literal they need (None:
    in every choice). From each mode's no-recompute simulation: a piece's own values with its
    literal; a value outside the pieces that one segment's pieces read, per mode to that mode's
    last read (the same life in both modes if they agree)."""
    cg_a, cg_f = union.graphs["autograd"], union.graphs["fused"]
    sims = {"autograd": no_recompute(cg_a), "fused": no_recompute(cg_f)}
    piece_seg = {mode: {n: seg for seg, both in union.pieces.items() for n in both[mode].nodes}
                 for mode in ("autograd", "fused")}
    fused_name = {a: f for a, f in union.shared}
    read_by = _readers_by_segment(union)
    cands = set(cg_a.candidates)
    out = []
    for mode in ("autograd", "fused"):
        for key, size in sims[mode].sizes.items():
            seg = piece_seg[mode].get(key[0])
            if seg is None or size <= 0:
                continue
            a, z = sims[mode].times[key]
            out.append((to_union[mode](a), to_union[mode](z), size, lit[mode][seg]))
    for key, size in sims["autograd"].sizes.items():
        n = key[0]
        if n in cands or size <= 0 or n in piece_seg["autograd"]:
            continue
        a, z = sims["autograd"].times[key]
        ta, tz = to_union["autograd"](a), to_union["autograd"](z)
        other = sims["fused"].times.get((fused_name.get(n, n), key[1]))
        if other is None:
            raise ValueError(f"value {n!r} of the autograd graph has no counterpart in the fused one")
        fa, fz = to_union["fused"](other[0]), to_union["fused"](other[1])
        segs = read_by.get(n, set())
        if (ta, tz) == (fa, fz):
            out.append((ta, tz, size, None))
        elif ta == fa and len(segs) == 1:
            (seg,) = segs
            out.append((ta, tz, size, lit["autograd"][seg]))
            out.append((fa, fz, size, lit["fused"][seg]))
        else:  # read by two segments' pieces: live to the later end either way (an upper bound)
            out.append((min(ta, fa), max(tz, fz), size, None))
    return out


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


def solve_choice(union: CombineUnion, budget_bytes: int | None, *, time_limit_s: float = 30.0,
                 num_workers: int | None = None, objective: str = "runtime", deterministic: bool = False,
                 deadline: Deadline | None = None) -> Choice:
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

    Returns
    -------
    Choice
        Its status and gap are the cost stage's (the peak only breaks ties).

    Raises
    ------
    InfeasibleBudgetError
        If no choice of combines and saved set was found under the budget (none fits, or none was
        found in time). Its smallest feasible budget is not searched (it names the budget itself,
        unproven): :func:`remat_compiler.api.choose_combines` then plans the model as it is, with
        :func:`~remat_compiler.solvers.cpsat.solve_cpsat`'s reruns and lowest-peak search.
    RuntimeError
        If CP-SAT calls the model invalid (a bug here, never a budget that does not fit).
    """
    t0 = time.perf_counter()
    deadline = deadline if deadline is not None else Deadline(time_limit_s, deterministic=deterministic)
    deterministic = deadline.deterministic
    cm = build_choice_model(union, budget_bytes, objective=objective)
    warm = hint_pure_choice(cm, union, budget_bytes, deadline)
    solver = make_solver(deadline.slice(0.8), num_workers, deterministic=deterministic)
    status = _checked(run_solver(solver, cm.model, deadline=deadline), cm.model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE or warm is None:
            raise InfeasibleBudgetError(budget_bytes or 0, budget_bytes or 0, proven=False,
                                        advice="or solver='moe_cpsat' / 'cpsat' on one combine to find the "
                                               "smallest")
        if warm.filled is None:  # not even the fill finished: the warm start's own plan
            return _warm_choice(union, cm, warm, objective, time.perf_counter() - t0)
        # no plan found in time: the warm start is a whole plan under the budget, a feasible one
        bound, solver, status = solver.best_objective_bound, warm.filled, cp_model.FEASIBLE
    else:
        bound = solver.best_objective_bound
    best = int(solver.value(cm.cost))
    gap = 0.0 if status == cp_model.OPTIMAL or best == 0 else min(1.0, max(0.0, best - bound) / best)
    found = solver
    if not isinstance(cm.cost, int):  # some value costs something: the least peak at the least cost
        cm.model.add(cm.cost <= best)
        cm.model.clear_hints()
        for i, value in enumerate(solver.response_proto.solution):
            cm.model.proto.solution_hint.vars.append(i)
            cm.model.proto.solution_hint.values.append(value)
        cm.model.minimize(cm.peak)
        second = make_solver(deadline.slice(), num_workers, deterministic=deterministic)
        if _checked(run_solver(second, cm.model, deadline=deadline), cm.model) in (cp_model.OPTIMAL,
                                                                                      cp_model.FEASIBLE):
            found = second
    modes = {seg: "fused" if found.boolean_value(b) else "autograd" for seg, b in cm.fused.items()}
    saved = [v for v, var in cm.saved.items() if found.value(var)]
    return Choice(modes, saved, found.value(cm.peak) * cm.unit_bytes, int(found.value(cm.cost)),
                  "optimal" if status == cp_model.OPTIMAL else "feasible", time.perf_counter() - t0, gap)


def _warm_choice(union: CombineUnion, cm: ChoiceModel, warm: WarmStart, objective: str,
                 solve_time_s: float) -> Choice:
    """The warm start as the choice, where CP-SAT returned no solution at all in the time: every
    segment in its combine, its saved set, the simulated peak of that graph (exact), the recompute
    cost of its plan (the pieces' communication aside), feasible with gap 1 (nothing proven)."""
    cg, schedule = union.graphs[warm.mode], warm.schedule
    cost = sum(cost_units(cg, n, objective) for n in schedule.recomputed)
    return Choice(dict.fromkeys(cm.fused, warm.mode), list(schedule.saved), simulate(cg, schedule).peak_bytes,
                  cost, "feasible", solve_time_s, 1.0 if cost else 0.0)


def _checked(status: int, model: cp_model.CpModel) -> int:
    """``status``, unless CP-SAT found the model invalid: then RuntimeError naming why (never
    treated as a budget that does not fit)."""
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"the combine-choice CP-SAT model is invalid: {model.validate() or 'MODEL_INVALID'}; "
                           "plan with solver='moe_cpsat' (the fused combine everywhere) meanwhile")
    return status


def reasons(modes: dict[str, str], peak_bytes: int, flipped_peak_bytes: dict[str, int],
            recompute_s: float | None = None, flipped_recompute_s: dict[str, float] | None = None
            ) -> dict[str, str]:
    """Why each segment got its combine, for ``plan.explain()``.

    Parameters
    ----------
    modes : dict of str to str
        Each segment's chosen combine (:attr:`Choice.modes`).
    peak_bytes : int
        The simulated step peak of the saved set on the graph traced with ``modes`` (not the
        model's peak variable, which is only a bound unless the solve proved it).
    flipped_peak_bytes : dict of str to int
        Per segment, the simulated step peak of the same saved set with that segment's combine
        switched to the other one (what it needs then is recomputed; a comparison, not a solve). A
        segment it lacks was not compared (said so).
    recompute_s, flipped_recompute_s : optional
        The estimated recompute time of the saved set on the chosen graph and, per segment, on the
        switched one: said too where given (a combine that the peak does not separate is chosen
        for what it saves recomputing).
    """
    found = {}
    for seg, mode in modes.items():
        other = "autograd" if mode == "fused" else "fused"
        if seg not in flipped_peak_bytes:
            found[seg] = (f"chosen in the one CP-SAT solve with the saved set (step peak {human_bytes(peak_bytes)}); "
                          f"not compared with the {other} combine here: each comparison traces the step again, "
                          f"and the time set aside for them was spent")
            continue
        found[seg] = (f"chosen in the one CP-SAT solve with the saved set: step peak "
                      f"{human_bytes(peak_bytes)}, against {human_bytes(flipped_peak_bytes[seg])} "
                      f"with the {other} combine here and the same saved set")
        if recompute_s is not None and flipped_recompute_s and seg in flipped_recompute_s:
            found[seg] += (f" (recompute est. {recompute_s * 1e3:.3f} ms against "
                           f"{flipped_recompute_s[seg] * 1e3:.3f} ms)")
    return found
