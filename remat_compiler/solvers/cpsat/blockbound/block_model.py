"""One block's plans on their own, as a CP-SAT model (:class:`_BlockModel`): the full model's decisions
and value lives (:mod:`..parts`) on the block's nodes, clipped to its backward window."""
from __future__ import annotations

import math
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.parts import add_decisions, add_first_need, add_value_life, is_const
from remat_compiler.solvers.cpsat.blockbound.layout import _Layout

__all__ = ["_BlockModel"]


class _BlockModel:
    """One block's plans on their own: everything outside the block is available.

    The full model's constraints on the block's nodes: backward needs what it reads; a value not
    saved is recomputed at the first step that needs it, live to its last read. Measures: ``cost``;
    ``held`` (F: bytes saved); ``W`` (the peak of fixed memory and the block's live values over its
    window up to ``tau``, ``[t0, t1]``; without ``memory`` the cumulative is left out and ``W`` is
    meaningless, which makes solves on H alone faster); ``H`` (min(F, D), module docstring 3; where
    boundaries are pulled, the bytes saved that backward reads, 4). All in ``unit`` bytes. ``variant``
    (``(pulled, pulls)``, :mod:`.variants`): where boundaries are pulled, whether the next block takes
    this one's before the window, and whether this one recomputes a reader of the previous one's.
    """

    def __init__(self, cg: CostGraph, lay: _Layout, k: int, cost_of, fixed, *, memory: bool = True,
                 variant: tuple[int, int] | None = None):
        F = lay.F
        self.nodes = lay.nodes[k]
        M = [v for v in self.nodes if not cg.is_available_in_bw(v)]
        cand_set = set(cg.candidates)
        cands = [v for v in M if v in cand_set]
        self.ws = lay.ws[k]
        self.t0 = t0 = bw_time(F, lay.ws[k], 0)
        self.t1 = t1 = bw_time(F, lay.ws[k] + lay.rel_tau) - 1
        merged: dict[tuple[int, int], int] = {}  # one interval per span: fewer for the cumulative
        for a, z, size in fixed:
            if a <= t1 and z >= t0:
                span = (max(a, t0), min(z, t1))
                merged[span] = merged.get(span, 0) + size
        window_fixed = [(a, z, size) for (a, z), size in sorted(merged.items())]
        self.unit = unit = reduce(math.gcd, [cg.attr(v, "bytes") for v in cands]
                                  + [size for *_, size in window_fixed], 0) or 1
        m = cp_model.CpModel()
        direct_first = {v: min(lay.reads[v]) for v in M if lay.reads.get(v)}
        # the pulled boundary (module docstring, 4; every block model there has its ``variant``): the
        # next block's recomputation may need it at any step before the window, read here at the last
        self.pull_read = None
        pulled, pulls = variant if variant is not None else (0, 0)
        boundary = self.nodes[lay.pull] if lay.pull is not None else None
        if pulled and boundary in M:
            self.pull_read = boundary
            direct_first[boundary] = min(direct_first.get(boundary, self.ws - 1), self.ws - 1)
        s, r, _need = add_decisions(m, cg, M, set(direct_first))
        if pulled and boundary not in M:
            m.add_bool_or([])  # a boundary the block does not keep cannot be pulled: no plan
        if variant is not None:  # whether this block recomputes a reader of the previous block's boundary
            readers = [r[self.nodes[p]] for p in lay.pull_readers if self.nodes[p] in r]
            if pulls:
                m.add_bool_or(readers)  # none to recompute: no plan
            else:
                for x in readers:
                    m.add(x == 0)
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
            # backward's last read (views included), the pull's too
            lo = max([*lay.sreads.get(v, ()), *([self.ws - 1] if v == self.pull_read else [])], default=None)
            # the value's life as the full model has it (parts), then clipped to the window
            last, rc_start = add_value_life(m, cg, v, r, st, F, rc_readers.get(v, ()), in_m,
                                            last_bounds=(bw_time(F, lo) if lo is not None else 0, T), rc_bounds=(0, T))
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

        if lay.pull is not None:
            # a pulled boundary's layout (module docstring, 4): H is F read, the bytes saved that backward
            # reads at all (a save nothing reads is free), held until the blocks' backward begins
            read = []
            for v in cands:
                any_read = m.new_bool_var(f"ar_{v}")
                m.add(lasts[v] >= F).only_enforce_if(any_read)
                m.add(lasts[v] <= F - 1).only_enforce_if(~any_read)
                saved_read = m.new_bool_var(f"sr_{v}")
                m.add_min_equality(saved_read, [s[v], any_read])
                read.append(cg.attr(v, "bytes") // unit * saved_read)
            self.H = m.new_int_var(0, sum(cg.attr(v, "bytes") // unit for v in cands), "H")
            m.add(self.H == sum(read))
            return
        # H = min(F, D) (module docstring, 3): F the bytes saved (``held``); D the bytes certainly
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
