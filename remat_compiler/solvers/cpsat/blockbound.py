"""Identical blocks, decomposed: a proven lower bound on the recompute cost, and the plan it picks.

CP-SAT's bound on the full model is the LP relaxation of its linear part. On a stack of identical
blocks the LP mixes fractions of per-block options freely, while a plan picks one option per
block: on GPT-2 at 12 layers and the checkpoint-every-block budget the LP stays about 6% below the
best plans, however long CP-SAT searches. This module bounds the same model (:mod:`.cpsat`'s plans:
each value recomputed at most once, at the first backward step that needs it) with whole options.

Notation. Blocks ``0..L-1`` in forward order; backward runs their *windows* from ``L-1`` down to
``0`` (window ``m`` starts at time ``t0_m``). A block's values are read by backward in its own window
and, its *boundary* (the block's output, the next block's input), before it. ``tau_{j+1}`` is the
first backward read of block ``j``'s values (late in window ``j + 1``; for the last block, in the
head's window). A *block plan* is a plan of one block alone, everything outside it available; the
*block plan of a plan* has the plan's decisions on the block's values, its recomputations taken at
the first step that needs them within the block. ``L_j(t)`` is block ``j``'s storage live at ``t``.

For a plan of the model and block ``j``, with ``P`` its block plan:

1. *Cost.* ``P`` recomputes what the plan recomputes in the block.
2. *Window.* From ``t0_j`` on no other block needs block ``j``'s values, so ``P`` recomputes them
   at the same steps and frees them at the same times as the plan: the peak ``W`` of fixed memory
   (what no plan changes: gradients, tangents) plus the block's live values over window ``j`` (up to
   ``tau_j``) is the plan's.
3. *Held bytes.* At every time before ``tau_{j+1}``, ``|L_j(t)| >= H = min(F, D)``: ``F``, the bytes
   ``P`` saves, while nothing of the block has been recomputed (saved values stay live until their
   last read, which comes later); ``D``, once the boundary's recomputation has run (a recomputed
   boundary pulls the block's values it needs into an earlier window: the *cascade*), the saved
   values read at or after ``t0_j``, the boundary itself until its read, and the values recomputed
   with it that are read at or after ``t0_j``. Within the step of that recomputation the bound is
   taken at the step's start, where nothing of it has run yet (the active block's memory is the
   same there).

So ``W_m + off_m + sum_{j<m} H_j <= budget`` for every window ``m`` (``off_m``: how much more fixed
memory window ``m`` has than the reference window, at its least), likewise during each block's
forward and in the head's window before ``tau_head``; and the plan's cost in the blocks is the sum
of its block plans' costs. The least sum over one block plan per block under these constraints
bounds every plan's cost from below (what lies outside the blocks counts as free, except the memory
every plan has: a value outside the blocks while the forward still reads it and between its first
and last backward read).

Blocks being identical (same ops, the same reads at the same steps relative to their window), one
block's plans serve all. Its *menu* is the staircase of (H, W, cost): H is cut into bands at
multiples of the block's value sizes; a band is stood for by one optimistic point (its least H,
the least W of any plan, its least cost) until a dynamic programme over the blocks (state: the
summed H) picks it, then replaced by the staircase of cost over W of its plans, each labelled with
the band's least H, itself solved band by band of W with stand-ins between, made exact where the
programme picks them; the programme runs again until it picks no stand-in. Every point comes
from a CP-SAT solve proven optimal, so each block plan is dominated by a point of the menu (no
larger H, W or cost), and the least total is a valid bound. The programme's choice is also a plan:
its block plans composed, everything outside the blocks saved; when it fits (the caller lets CP-SAT
adjust what lies outside the blocks) its cost meets the bound, up to what lies outside.
"""
from __future__ import annotations

import bisect
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph, block_stack, representative_block
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.parts import (add_decisions, add_first_need, alloc_index, fixed_intervals,
                                                is_const, storage_readers)
from remat_compiler.solvers.cpsat.run import new_solver, run_solver

__all__ = ["BlockBound", "block_bound"]

#: The bands of W in a block's menu, in granules of H's bands, and how many finer bands each is cut
#: into when a choice needs it (see ``_Menu``).
W_GRANULES = 4
W_SPLIT = 16


@dataclass
class BlockBound:
    """A lower bound on the cost of every plan of the model that fits (``inf``: none fits), and a
    choice of block plans composed into a saved set (everything outside the blocks saved; to be
    simulated). With ``exact`` the choice is the bound's own (its blocks cost ``bound``); without,
    the time ran out before the bound's choice was made of found plans, and ``saved`` is the best
    choice of the plans found by then (its blocks cost more than ``bound``)."""

    bound: float
    saved: set[str] | None = None
    exact: bool = True
    block_candidates: set[str] = field(default_factory=set)
    menu_size: int = 0
    time_s: float = 0.0
    solves: int = 0  # staircase solves of cost over W made for the menu so far (kept menus: all calls')


class _Layout:
    """Blocks, windows and reads of a graph; ``ok`` False where the decomposition does not apply."""

    def __init__(self, cg: CostGraph):
        self.ok = False
        stack = block_stack(cg)
        if stack is None:
            return
        self.F, self.B = len(cg.fw_order), len(cg.bw_order)
        self.stack = stack
        self.blocks = stack.blocks
        L = self.L = len(stack.blocks)
        index = {b: k for k, b in enumerate(stack.blocks)}
        self.nodes = [[n for n in cg.fw_order if cg.attr(n, "block") == b] for b in stack.blocks]
        reads: dict[str, list[int]] = {}  # forward node -> backward steps reading it
        for j, b in enumerate(cg.bw_order):
            for p in cg.preds(b):
                reads.setdefault(p, []).append(j)
        self.reads = reads
        sreads: dict[str, list[int]] = {}  # storage -> backward steps reading it (views included)
        for v, steps in reads.items():
            if cg.storage(v) is not None:
                sreads.setdefault(cg.storage(v), []).extend(steps)
        self.sreads = sreads
        bw_block = [index.get(cg.attr(n, "block")) for n in cg.bw_order]
        ws = [min((j for j, k in enumerate(bw_block) if k == m), default=None) for m in range(L)]
        if None in ws or any(ws[m] <= ws[m + 1] for m in range(L - 1)):
            return  # every block has backward nodes, in reverse block order
        self.ws = ws
        first_read = []
        for m in range(L):
            steps = [j for v in self.nodes[m] for j in reads.get(v, ())]
            if not steps:
                return
            first_read.append(min(steps))
        if any(first_read[m - 1] < ws[m] for m in range(1, L)):
            return  # a block's values are read before the next block's window
        self.tau = [None] + [first_read[m - 1] for m in range(1, L)]
        self.tau_head = first_read[L - 1]
        if self.tau_head >= ws[L - 1]:
            return
        rel_tau = {self.tau[m] - ws[m] for m in range(1, L)}
        if len(rel_tau) != 1:
            return
        self.rel_tau = rel_tau.pop()
        # identical in what the decomposition uses: ops, sizes, in-block edges, reads relative to
        # the window (reads before it only count as needs)
        idx = cg.fw_index
        cands = set(cg.candidates)
        sigs = set()
        for m in range(L):
            pos = {n: i for i, n in enumerate(self.nodes[m])}
            sigs.add(tuple(
                (cg.attr(n, "op"), cg.attr(n, "bytes"), cg.storage(n) == n, cg.attr(n, "is_tuple"),
                 n in cands, bool(cg.attr(n, "never_recompute")), idx[n] - idx[self.nodes[m][0]],
                 tuple(pos.get(p, -1) for p in cg.preds(n)),
                 tuple(j - ws[m] for j in reads.get(n, ()) if j >= ws[m]),
                 any(j < ws[m] for j in reads.get(n, ())))
                for n in self.nodes[m]))
        if len(sigs) != 1:
            return
        # a block's values read by forward nodes outside it (whose recomputation could read them at
        # any time) must be boundaries: read directly by backward before the block's window, so
        # live until then in every plan
        for m in range(L):
            inside = set(self.nodes[m])
            for v in self.nodes[m]:
                if cg.is_available_in_bw(v):
                    continue
                outside = [u for u in cg.g.successors(v) if cg.attr(u, "phase") == "fw" and u not in inside]
                if outside and not any(j < ws[m] for j in reads.get(v, ())):
                    return
        self.ok = True


class _Profile:
    """Load of intervals ``(start, end, bytes)`` at any time, by binary search."""

    def __init__(self, intervals):
        starts = sorted((a, s) for a, _z, s in intervals)
        ends = sorted((z, s) for _a, z, s in intervals)
        self.s_at = [a for a, _ in starts]
        self.e_at = [z for z, _ in ends]
        self.s_cum = [0]
        for _a, s in starts:
            self.s_cum.append(self.s_cum[-1] + s)
        self.e_cum = [0]
        for _z, s in ends:
            self.e_cum.append(self.e_cum[-1] + s)

    def __call__(self, t: int) -> int:
        return self.s_cum[bisect.bisect_right(self.s_at, t)] - self.e_cum[bisect.bisect_left(self.e_at, t)]


def _fixed_intervals(cg: CostGraph, lay: _Layout):
    """Memory every plan has, as (start, end, bytes) on the model's time axis: what the full model
    fixes (:func:`.cpmodel.fixed_intervals`); and each candidate outside the blocks while the
    forward still reads it and between its first and last backward read (saved or recomputed,
    backward reads it there)."""
    fixed, _base = fixed_intervals(cg)
    blocks = set(lay.blocks)
    fw_last = storage_readers(cg)[1]
    for v in cg.candidates:
        if cg.attr(v, "block") in blocks or cg.is_available_in_bw(v):
            continue
        a = alloc_index(cg, v)
        fixed.append((a, max(fw_last.get(v, a), a), cg.attr(v, "bytes")))
        if lay.sreads.get(v):
            fixed.append((bw_time(lay.F, min(lay.sreads[v])), bw_time(lay.F, max(lay.sreads[v])),
                          cg.attr(v, "bytes")))
    return fixed


class _BlockModel:
    """One block's plans on their own: everything outside the block is available.

    The full model's constraints on the block's nodes: backward needs what it reads; a value not
    saved is recomputed at the first step that needs it, live to its last read. Measures: ``cost``;
    ``held`` (F: bytes saved); ``W`` (the peak of fixed memory and the block's live values over its
    window up to ``tau``, ``[t0, t1]``; without ``memory`` the cumulative is left out and ``W`` is
    meaningless, which makes solves on H alone faster); ``H`` (min(F, D), module docstring 3). All
    in ``unit`` bytes.
    """

    def __init__(self, cg: CostGraph, lay: _Layout, k: int, cost_of, fixed, *, memory: bool = True):
        F = lay.F
        self.nodes = lay.nodes[k]
        M = [v for v in self.nodes if not cg.is_available_in_bw(v)]
        cand_set = set(cg.candidates)
        cands = [v for v in M if v in cand_set]
        self.ws = lay.ws[k]
        self.t0 = t0 = bw_time(F, lay.ws[k], 0)
        self.t1 = t1 = bw_time(F, lay.ws[k] + lay.rel_tau) - 1
        window_fixed = [(max(a, t0), min(z, t1), size) for a, z, size in fixed if a <= t1 and z >= t0]
        self.unit = unit = reduce(math.gcd, [cg.attr(v, "bytes") for v in cands]
                                  + [size for *_, size in window_fixed], 0) or 1
        m = cp_model.CpModel()
        direct_first = {v: min(lay.reads[v]) for v in M if lay.reads.get(v)}
        s, r, _need = add_decisions(m, cg, M, set(direct_first))
        costs = {v: int(cost_of(v)) for v in M if not is_const(r[v])}
        self.cost = m.new_int_var(0, sum(c for c in costs.values() if c > 0), "cost")
        m.add(self.cost == sum(c * r[v] for v, c in costs.items() if c > 0))
        self.held = m.new_int_var(0, sum(cg.attr(v, "bytes") // unit for v in cands), "held")
        m.add(self.held == sum(cg.attr(v, "bytes") // unit * s[v] for v in cands))
        self.model, self.s = m, s
        self._add_window(cg, lay, m, M, cands, s, r, direct_first, window_fixed, memory)

    def _add_window(self, cg, lay, m, M, cands, s, r, direct_first, window_fixed, memory) -> None:
        F, B, t0, t1, unit = lay.F, lay.B, self.t0, self.t1, self.unit
        in_m = set(M)
        st = {v: m.new_int_var(0, B - 1, f"st_{v}") for v in M}
        first = {v: m.new_int_var(0, B - 1, f"first_{v}") for v in M}
        add_first_need(m, cg, M, r, direct_first, B, first, st)
        rc_readers: dict[str, set[str]] = {}
        for u in M:
            for p in cg.preds(u):
                if cg.storage(p) is not None:
                    rc_readers.setdefault(cg.storage(p), set()).add(u)
        idx = cg.fw_index
        T = bw_time(F, B - 1) + 1
        intervals, demands, lasts = [], [], {}
        for a, z, size in window_fixed:
            intervals.append(m.new_fixed_size_interval_var(a, z - a + 1, f"fix_{a}_{z}"))
            demands.append(size // unit)
        for v in cands:
            size = cg.attr(v, "bytes") // unit
            lo = max(lay.sreads.get(v, ()), default=None)  # backward's last read (views included)
            last = m.new_int_var(bw_time(F, lo) if lo is not None else 0, T, f"last_{v}")
            for u in rc_readers.get(v, ()):
                if u != v and u in in_m:
                    m.add(last >= bw_time(F, st[u], idx[u])).only_enforce_if(r[u])
            rc_start = m.new_int_var(0, T, f"rcs_{v}")
            m.add(rc_start == bw_time(F, st[v], alloc_index(cg, v)))
            m.add(last >= rc_start).only_enforce_if(r[v])
            lasts[v] = last
            end = m.new_int_var(t0 - 1, t1, f"end_{v}")
            m.add_min_equality(end, [last, t1])
            # saved: live from the window's start to its last read
            sv_end = m.new_int_var(t0 - 1, t1, f"svend_{v}")
            m.add_max_equality(sv_end, [end, t0 - 1])
            sv_size = m.new_int_var(0, t1 - t0 + 1, f"svsz_{v}")
            m.add(sv_size == sv_end - t0 + 1)
            intervals.append(m.new_optional_interval_var(t0, sv_size, sv_end + 1, s[v], f"sv_{v}"))
            demands.append(size)
            # recomputed: from its recomputation to its last read
            start = m.new_int_var(t0, T, f"rcs2_{v}")
            m.add_max_equality(start, [rc_start, t0])
            rc_size = m.new_int_var(0, t1 - t0 + 1, f"rcsz_{v}")
            m.add_max_equality(rc_size, [end - start + 1, 0])
            rc_end = m.new_int_var(t0, T + t1, f"rce_{v}")
            m.add(rc_end == start + rc_size)
            intervals.append(m.new_optional_interval_var(start, rc_size, rc_end, r[v], f"rc_{v}"))
            demands.append(size)
        for v in M:  # a recomputed multi-output op's untaken outputs
            if cg.attr(v, "is_tuple") and cg.attr(v, "bytes") > 0 and v not in s:
                span = max([idx[u] for u in cg.g.successors(v) if u in in_m], default=idx[v]) - idx[v] + 1
                a = m.new_int_var(0, T, f"tupa_{v}")
                m.add(a == bw_time(F, st[v], idx[v]))
                a2 = m.new_int_var(t0, T, f"tupa2_{v}")
                m.add_max_equality(a2, [a, t0])
                z2 = m.new_int_var(t0 - 1, T, f"tupz_{v}")
                m.add_min_equality(z2, [a + span - 1, t1])
                sz = m.new_int_var(0, span, f"tupsz_{v}")
                m.add_max_equality(sz, [z2 - a2 + 1, 0])
                e2 = m.new_int_var(t0, 2 * T, f"tupe_{v}")
                m.add(e2 == a2 + sz)
                intervals.append(m.new_optional_interval_var(a2, sz, e2, r[v], f"tup_{v}"))
                demands.append(cg.attr(v, "bytes") // unit)
        self.W = m.new_int_var(0, sum(demands) + 1, "W")
        if memory:
            m.add_cumulative(intervals, demands, self.W)

        # H = min(F, D) (module docstring, 1): F the bytes saved (``held``); D the bytes certainly
        # live once the boundary's recomputation has run: saved values read at or after t0, the
        # boundary itself, and the values recomputed with it (before the window) read at or after t0
        boundary = [v for v in cands if lay.sreads.get(v) and max(lay.sreads[v]) < self.ws]
        terms = []
        for v in cands:
            size = cg.attr(v, "bytes") // unit
            late = m.new_bool_var(f"late_{v}")
            m.add(lasts[v] >= t0).only_enforce_if(late)
            m.add(lasts[v] <= t0 - 1).only_enforce_if(~late)
            if v in boundary:
                continue
            saved_late = m.new_bool_var(f"sl_{v}")
            m.add(saved_late >= s[v] + late - 1)
            terms.append(size * saved_late)
            if len(boundary) == 1 and not is_const(r[v]):
                early = m.new_bool_var(f"early_{v}")
                m.add(st[v] <= self.ws - 1).only_enforce_if(early)
                m.add(st[v] >= self.ws).only_enforce_if(~early)
                chained = m.new_bool_var(f"ch_{v}")
                m.add(chained >= r[v] + early + late - 2)
                terms.append(size * chained)
        if len(boundary) == 1:
            terms.append(cg.attr(boundary[0], "bytes") // unit)
        else:
            terms.extend(cg.attr(x, "bytes") // unit * s[x] for x in boundary)
        D = m.new_int_var(0, sum(cg.attr(v, "bytes") // unit for v in cands), "D")
        m.add(D == sum(terms))
        self.H = m.new_int_var(0, sum(cg.attr(v, "bytes") // unit for v in cands), "H")
        m.add_min_equality(self.H, [self.held, D])


def _clone_var(m: cp_model.CpModel, v):
    return m.get_int_var_from_proto_index(v.index)


@dataclass(eq=False)  # hashed by identity: a stand-in is refined as the object the menu holds
class _MenuPoint:
    """A point of a block's menu: its measures (bytes) and the block plan reaching them (None: a
    stand-in, no plan). A stand-in for the plans of a band whose W lies in ``(lo, hi]`` (model
    units, the exact staircase between them not yet solved) has ``w_range = (lo, hi)``."""

    H: int
    W: int
    cost: int
    saved: frozenset[int] | None  # positions in the block's node list
    w_range: tuple[int, int] | None = None
    granule: int = 0  # a W stand-in's: the bands of W (bytes) its range was cut from


def _staircase(bm: _BlockModel, measure, deadline: Deadline, H_cap: int | None = None, below=None,
               cap: int | None = None, floor: int | None = None, solves: list | None = None):
    """Block plans along the exact staircase of ``x -> least cost with measure <= x`` (and
    ``H <= H_cap``, in the model's units): each solve minimises cost, then the measure; the first
    asks for ``measure <= cap`` (None: any), the next for a smaller measure: at most ``below(x)``
    (model units; default ``x - 1``: every step of the staircase; None: stop). A solve whose
    measure is at most ``floor`` ends it, its plan left out. Returns the options, or None if a
    solve is not proven optimal by the deadline; each solve appends 1 to ``solves`` when given."""
    dom = measure.proto.domain
    hi = dom[len(dom) - 1]  # (a protobuf field: no negative index)
    pos = {v: i for i, v in enumerate(bm.nodes)}
    options = []
    while True:
        left = deadline.left()
        if left <= 0:
            return None
        m = bm.model.clone()
        x_var = _clone_var(m, measure)
        if cap is not None:
            m.add(x_var <= cap)
        if H_cap is not None:
            m.add(_clone_var(m, bm.H) <= H_cap)
        m.minimize(_clone_var(m, bm.cost) * (hi + 1) + x_var)
        solver = new_solver()
        solver.parameters.num_workers = 1
        solver.parameters.cp_model_probing_level = 0  # small models: probing costs more than it saves
        solver.parameters.linearization_level = 0
        solver.parameters.max_time_in_seconds = left
        status = run_solver(solver, m)
        if solves is not None:
            solves.append(1)
        if status == cp_model.INFEASIBLE:
            return options
        if status != cp_model.OPTIMAL:
            return None
        cost, x = divmod(int(round(solver.objective_value)), hi + 1)
        if floor is not None and x <= floor:
            return options
        options.append(_MenuPoint(
            H=solver.value(_clone_var(m, bm.H)) * bm.unit, W=solver.value(_clone_var(m, bm.W)) * bm.unit,
            cost=cost,
            saved=frozenset(pos[v] for v, var in bm.s.items() if solver.value(_clone_var(m, var)))))
        if x == 0:
            return options
        cap = x - 1 if below is None else below(x)
        if cap is None:
            return options


def _least(bm: _BlockModel, measure, deadline: Deadline) -> int | None:
    """The least value of ``measure`` over the block's plans, in bytes (None: not proven in time)."""
    m = bm.model.clone()
    m.minimize(_clone_var(m, measure))
    solver = new_solver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = max(0.01, deadline.left())
    if run_solver(solver, m) != cp_model.OPTIMAL:
        return None
    return int(round(solver.objective_value)) * bm.unit


def _edge_below(x: int, unit: int, granule: int) -> int | None:
    """The largest band edge (``k * granule - unit`` bytes, ``k >= 1``) below a plan's measure (H or
    W) of ``x`` model units, in model units; None when there is none (the plan is in the first band).

    The least cost with the measure at most an edge ``e`` is the cost of the staircase point at the
    smallest cap at or above ``e``, when that point's measure is at most ``e``: capping the measure
    at the next edge below each point's finds every edge's least cost, and whether any plan has a
    measure that low.

    >>> _edge_below(10, 1, 4), _edge_below(8, 1, 4), _edge_below(3, 1, 4)
    (7, 7, None)
    """
    k = -(-(x * unit + unit) // granule) - 1  # the largest k with k * granule - unit < x * unit
    return (k * granule - unit) // unit if k >= 1 else None


class _Menu:
    """A block's options, refined on demand.

    ``levels`` is the staircase of cost over H (the least cost of a plan with ``H <= x``). H is cut
    into bands at multiples of a granule (the gcd of the block's sizeable values), each just
    below a multiple, so a plan whose H is a multiple sits at its band's lower edge. Band ``b``
    (plans with H in ``(lo_b, hi_b]``) is stood for by ``(lo_b + 1 unit, W_min, least cost with
    H <= hi_b)`` until refined, then by the staircase of cost over W of the plans with
    ``H <= hi_b``, each labelled ``lo_b + 1 unit`` (0 for the first band). That staircase is solved
    the same way, lazily: from one edge of W's bands (multiples of ``w_granule``) to the next, so
    each point found, of W ``x``, is the least cost with W at most the edge above it; the plans
    with W between the edge below, ``lo``, and ``x`` are stood for by ``(max(lo + 1 unit, W_min),
    that cost)`` until a choice needs them, then solved the same way on bands :data:`W_SPLIT` times
    finer, down to single steps. Either way every plan of the band is dominated (no larger H, W or
    cost) by a point of the menu, so the menu's least total bounds every plan's; and a choice of
    found points only is the least total of the exact menu.
    """

    def __init__(self, bm: _BlockModel, bm_h: _BlockModel, sizes: list[int], deadline: Deadline,
                 w_granule: int | None = None):
        self.bm = bm
        big = [x for x in sizes if x >= max(sizes) // 64]
        granule = max(reduce(math.gcd, big, 0), bm.unit)
        # W's bands: 4 of H's (on GPT-2's block traced for Inductor, 1 MiB: the exact staircases of
        # cost over W took 380 solves, 48.4 s at 60.25 MiB; benchmarks.menu_check)
        self.w_granule = max(w_granule or W_GRANULES * granule, bm.unit)
        # the menu reads levels only at band edges (least cost with H <= an edge) and their least H
        # against an edge: one solve per edge the staircase steps over is enough (on GPT-2's block
        # traced for Inductor, 222 steps of one unit took 34 s; see _edge_below)
        self.levels = _staircase(bm_h, bm_h.H, deadline, below=lambda x: _edge_below(x, bm.unit, granule))
        self.w_min = _least(bm, bm.W, deadline) if self.levels is not None else None
        self.ok = self.levels is not None and self.w_min is not None
        if not self.ok:
            return
        top = max(o.H for o in self.levels)
        cuts = [g - bm.unit for g in range(granule, top + granule, granule) if g - bm.unit < top]
        edges = [-1] + cuts + [top]
        self.edges = sorted(set(edges))  # band b: (edges[b], edges[b + 1]]
        self.bands: dict[int, list[_MenuPoint]] = {}
        self.solves = 0  # staircase solves made for the bands (W's), a measure of the work

    def _label(self, b: int) -> int:
        """The least H of band b's plans (H is a multiple of the unit, above the band's lower edge)."""
        return 0 if b == 0 else self.edges[b] + self.bm.unit

    def _least_cost(self, h: int) -> int:
        return min(o.cost for o in self.levels if o.H <= h)

    def options(self) -> tuple[list[_MenuPoint], list]:
        """The current menu and, per option, what refining it takes: None (a found plan), a band
        (its stand-in) or ``(band, point)`` (a stand-in for a range of W in a refined band)."""
        menu, stand = [], []
        for b in range(len(self.edges) - 1):
            hi = self.edges[b + 1]
            if not any(o.H <= hi for o in self.levels):
                continue  # no plan has H this low
            if b in self.bands:
                menu.extend(self.bands[b])
                stand.extend(None if o.saved is not None else (b, o) for o in self.bands[b])
            else:
                menu.append(_MenuPoint(H=self._label(b), W=self.w_min, cost=self._least_cost(hi), saved=None))
                stand.append(b)
        return menu, stand

    def _w_points(self, b: int, deadline: Deadline, granule: int, cap: int | None = None,
                  floor: int | None = None):
        """Band b's staircase of cost over W, for W in ``(floor, cap]`` (model units; None: any),
        solved from one edge of W's bands of ``granule`` bytes to the next (step by step at the
        unit), each point followed by the stand-in for the plans of W between the edge below it
        and it. Returns (points, solves); points None if a solve is not proven in time."""
        bm = self.bm
        unit = bm.unit
        low = -1 if floor is None else floor

        def edge(x):
            e = _edge_below(x, unit, granule) if granule > unit else x - 1
            return e if e is not None and e > low else None

        solves = []
        points = _staircase(bm, bm.W, deadline, H_cap=self.edges[b + 1] // unit, below=edge, cap=cap,
                            floor=floor, solves=solves)
        if points is None:
            return None, len(solves)
        out = []
        for o in points:
            out.append(_MenuPoint(H=self._label(b), W=o.W, cost=o.cost, saved=o.saved))
            x = o.W // unit
            lo = edge(x)
            lo = low if lo is None else lo
            least = max(lo + 1, -(-self.w_min // unit))
            if granule > unit and least <= x - 1:
                # every plan of W in (lo, x - 1] costs at least o.cost: o is the least with a larger cap
                out.append(_MenuPoint(H=self._label(b), W=least * unit, cost=o.cost, saved=None,
                                      w_range=(lo, x - 1), granule=granule))
        return out, len(solves)

    def refine(self, todo, deadline: Deadline, workers: int = 2) -> bool:
        """Refine these stand-ins (bands, or ``(band, point)`` for W's; in parallel: CP-SAT releases
        the GIL); False if a staircase is not proven in time."""
        unit = self.bm.unit

        def task(item):
            if not isinstance(item, tuple):
                return item, self._w_points(item, deadline, self.w_granule)
            b, standin = item
            lo, hi = standin.w_range
            finer = max(unit, standin.granule // W_SPLIT // unit * unit)
            return item, self._w_points(b, deadline, finer, cap=hi, floor=lo)

        bands = sorted(item for item in todo if not isinstance(item, tuple))
        ranges = [item for item in todo if isinstance(item, tuple)]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(task, bands + ranges))
        for item, (points, solves) in done:
            self.solves += solves
            if points is None:
                return False
            if isinstance(item, tuple):
                b, standin = item
                self.bands[b] = [o for p in self.bands[b] for o in (points if p is standin else [p])]
            else:
                self.bands[item] = points
        return True


class _Frame:
    """What the dynamic programme needs beyond the menu: per block, the fixed memory of its window
    relative to the reference block's (at its least) and the least memory during its forward; and
    the least memory of the head's window, before its first read of a block's value."""

    def __init__(self, cg: CostGraph, lay: _Layout, fixed, k: int):
        F = lay.F
        load = _Profile(fixed)
        # the fixed load changes only at backward nodes: their times and the steps' starts cover it
        rel = [(j, slot) for j in range(lay.rel_tau) for slot in (0, None)]
        ref = [load(bw_time(F, lay.ws[k] + j, slot)) for j, slot in rel]
        self.offsets = [min(load(bw_time(F, lay.ws[m] + j, slot)) - r for (j, slot), r in zip(rel, ref))
                        for m in range(lay.L)]
        fw_last = storage_readers(cg)[1]
        cands = set(cg.candidates)
        self.forward = []  # fixed plus the block's own forward values, during its forward
        for m in range(lay.L):
            own = _Profile([(alloc_index(cg, v), max(fw_last.get(v, 0), alloc_index(cg, v)),
                             cg.attr(v, "bytes")) for v in lay.nodes[m] if v in cands])
            span = range(cg.fw_index[lay.nodes[m][0]], cg.fw_index[lay.nodes[m][-1]] + 1)
            self.forward.append(max(load(t) + own(t) for t in span))
        times = [F - 1] + [bw_time(F, j, slot) for j in range(lay.tau_head) for slot in (0, None)]
        self.head = max(load(t) for t in times)


def _compose(menu: list[_MenuPoint], frame: _Frame, budget: int):
    """Least summed cost of one option per block with, for every block ``m``,
    ``W_m + off_m + sum_{j<m} H_j`` and ``forward_m + sum_{j<m} H_j`` within the budget, and
    ``head + sum_j H_j`` too: a dynamic programme over blocks in forward order on the Pareto front
    of (summed H, cost). Returns (cost, option index per block), or None when nothing fits."""
    by_w = sorted(range(len(menu)), key=lambda i: menu[i].W)
    states = [(0, 0, None)]  # (summed H of the blocks before, cost, back pointer)
    history = []
    for off, fw in zip(frame.offsets, frame.forward):
        nxt = []
        for si, (S, C, _) in enumerate(states):
            if S + fw > budget:
                continue
            for i in by_w:
                if menu[i].W + off + S > budget:
                    break
                nxt.append((S + menu[i].H, C + menu[i].cost, (si, i)))
        if not nxt:
            return None
        nxt.sort(key=lambda item: (item[0], item[1]))
        front = []
        for item in nxt:  # keep the states no state of smaller summed H beats on cost
            if not front or item[1] < front[-1][1]:
                front.append(item)
        history.append(front)
        states = front
    final = [(C, i) for i, (S, C, _) in enumerate(states) if S + frame.head <= budget]
    if not final:
        return None
    cost, i = min(final)
    choice = []
    for front in reversed(history):
        si, opt = front[i][2]
        choice.append(opt)
        i = si
    return cost, choice[::-1]


def block_bound(cg: CostGraph, budget_bytes: int, cost_of, *, deadline: Deadline, menus: dict | None = None,
                cost_key=None, min_blocks: int = 3, w_granule: int | None = None) -> BlockBound | None:
    """A lower bound on the summed ``cost_of`` of every plan of the CP-SAT model that fits
    ``budget_bytes``, and its choice composed into a saved set (see the module docstring).

    The dynamic programme runs on the menu, whose bands stand in for their plans until chosen:
    the chosen ones are refined and it runs again, until its choice is made of refined options
    only (then it is the least total of the full menu). A band left unrefined when the time is up
    still stands for its plans, so the bound stays valid, only weaker; the saved set is then the
    best choice of the plans found so far (``exact`` False), if any fits.
    None when the graph has fewer than ``min_blocks`` identical blocks, they differ in what the
    decomposition uses, or the first staircases are not proven by the ``deadline``. The menu does
    not depend on the budget: it is kept in ``menus`` (a :class:`~.memo.SolveMemo`'s), by graph,
    ``cost_key`` (the objective) and the block's costs, when both are given. ``w_granule``: the
    bytes of the menu's first bands of W (default :data:`W_GRANULES` of H's; 1: no bands, every
    step of the staircases solved), which change the work, not the bound.
    """
    t_start = time.perf_counter()
    lay = _Layout(cg)
    if not lay.ok or lay.L < min_blocks:
        return None
    fixed = _fixed_intervals(cg, lay)
    k = representative_block(lay.stack)
    frame = _Frame(cg, lay, fixed, k)
    # the fingerprint does not cover costs (a runtime estimate depends on the cost model): key on
    # the reference block's costs too
    key = (cg.fingerprint, cost_key, tuple(int(cost_of(v)) for v in lay.nodes[k]), w_granule)
    keep = menus is not None and cost_key is not None
    menu = menus.get(key) if keep else None
    if menu is None:
        cands = set(cg.candidates)
        sizes = [cg.attr(v, "bytes") for v in lay.nodes[k] if v in cands]
        menu = _Menu(_BlockModel(cg, lay, k, cost_of, fixed),
                     _BlockModel(cg, lay, k, cost_of, fixed, memory=False), sizes, deadline, w_granule)
        if not menu.ok:
            return None
        if keep:
            menus[key] = menu
    while True:
        options, stand = menu.options()
        found = _compose(options, frame, budget_bytes)
        if found is None:  # not even the stand-ins fit: no plan does
            return BlockBound(bound=math.inf, time_s=time.perf_counter() - t_start)
        cost, choice = found
        todo = {stand[i] for i in choice if stand[i] is not None}
        if not todo:
            break
        # the next choice often moves to a neighbouring band: refine those along (both cores busy)
        todo |= {b + d for b in todo if not isinstance(b, tuple) for d in (-1, 1)
                 if 0 <= b + d < len(menu.edges) - 1 and b + d not in menu.bands}
        if not menu.refine(todo, deadline):
            # the time is up: the bound stands (an unrefined band still stands for its plans), and the
            # best choice of the plans found so far is still a plan (on GPT-2 under the runtime
            # objective at 25 s the bound's own choice missed the deadline, and with it the plan)
            options, _ = menu.options()
            plans = [o for o in options if o.saved is not None]
            found = _compose(plans, frame, budget_bytes)
            return BlockBound(bound=cost, saved=None if found is None else _composed(cg, lay, plans, found[1]),
                              block_candidates=_block_candidates(cg, lay), exact=False, menu_size=len(options),
                              time_s=time.perf_counter() - t_start, solves=menu.solves)
    return BlockBound(bound=cost, saved=_composed(cg, lay, options, choice),
                      block_candidates=_block_candidates(cg, lay), menu_size=len(options),
                      time_s=time.perf_counter() - t_start, solves=menu.solves)


def _block_candidates(cg: CostGraph, lay: _Layout) -> set[str]:
    return {v for ns in lay.nodes for v in ns} & set(cg.candidates)


def _composed(cg: CostGraph, lay: _Layout, options: list[_MenuPoint], choice: list[int]) -> set[str]:
    """The saved set of ``choice`` (an option per block), everything outside the blocks saved."""
    saved = set(cg.candidates) - _block_candidates(cg, lay)
    for m, i in enumerate(choice):
        saved |= {lay.nodes[m][p] for p in options[i].saved}
    return saved
