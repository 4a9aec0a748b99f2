"""The combine-choice CP-SAT model over a union backward: the records a choice is (:class:`Choice`,
:class:`ChoiceModel`), the union's time axis and the model's build (:func:`build_choice_model`), and
the cost of each piece's collectives (:func:`piece_comm_units`). The recipe is
:mod:`remat_compiler.solvers.cpsat.choice`'s docstring.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.schedule import bw_time, no_recompute, recomputed_outputs
from remat_compiler.solvers.combine_choice import CombineUnion
from remat_compiler.solvers.cpsat.costs import cost_units
from remat_compiler.solvers.cpsat.parts import (add_candidate_intervals, add_decisions, add_first_need,
                                                add_value_intervals, is_const, storage_readers)

__all__ = ["Choice", "ChoiceModel", "union_steps", "build_choice_model", "piece_comm_units"]


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
    more, more_demands, _aux = add_candidate_intervals(
        m, cg, unit, fw_reads, in_m,
        lambda v, size, e: add_value_intervals(m, cg, v, size, s, r, st, F, B, e, bw_last.get(v, -1),
                                               rc_readers.get(v, ()), in_m, cond_last.get(v, ())))
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
