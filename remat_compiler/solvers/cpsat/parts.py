"""Pieces of the CP-SAT model that the full model (:mod:`.model`) and the one-block models of the
block decomposition (:mod:`.blockbound`) share: when a forward value is allocated, which intervals no
plan changes, the decisions, and at which backward step a recomputed value is materialised."""
from __future__ import annotations

from ortools.sat.python import cp_model

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import SimResult, bw_time, no_recompute

__all__ = ["alloc_index", "is_const", "storage_readers", "fixed_intervals", "add_decisions", "add_first_need",
           "add_value_life", "add_value_intervals", "add_candidate_intervals"]


def alloc_index(cg: CostGraph, v: str) -> int:
    """Forward index of the op that allocates v: a multi-output op allocates all its outputs at once."""
    if cg.attr(v, "op") == "getitem":
        parent = cg.preds(v)[0]
        if cg.attr(parent, "is_tuple"):
            return cg.fw_index[parent]
    return cg.fw_index[v]


def storage_readers(cg: CostGraph):
    """For each storage owner: the last forward step that reads it (the forward's outputs: its last
    step), the last backward step that reads it, and the forward nodes that read it. Returns
    (number of forward steps, fw_reads, bw_reads, rc_readers)."""
    fw_reads: dict[str, int] = {}
    bw_reads: dict[str, int] = {}
    rc_readers: dict[str, set[str]] = {}
    F = len(cg.fw_order)
    for i, u in enumerate(cg.fw_order):
        for p in cg.fw_preds(u):
            o = cg.storage(p)
            if o is None:
                continue
            fw_reads[o] = max(fw_reads.get(o, -1), i)
            if p not in cg.attr(u, "fw_only_reads"):  # a read its recomputation makes too
                rc_readers.setdefault(o, set()).add(u)
    for o in cg.fw_outputs:  # the forward's outputs live until it returns
        if o is not None and cg.storage(o) is not None:
            fw_reads[cg.storage(o)] = F - 1
    for j, b in enumerate(cg.bw_order):
        for p in cg.preds(b):
            o = cg.storage(p)
            if o is None:
                continue
            bw_reads[o] = max(bw_reads.get(o, -1), j)
    return F, fw_reads, bw_reads, rc_readers


def fixed_intervals(cg: CostGraph) -> tuple[list[tuple[int, int, int]], SimResult]:
    """Everything whose life no plan changes (what is not a candidate: tangents, backward values,
    outputs), as (start, end, bytes) on the model's time axis, from the save-all plan's simulation;
    and that simulation."""
    cands = set(cg.candidates)
    base = no_recompute(cg)
    fixed = [(*base.times[key], size) for key, size in base.sizes.items() if key[0] not in cands and size > 0]
    return fixed, base


def is_const(var) -> bool:
    """Whether a CP-SAT variable is fixed to one value."""
    dom = var.proto.domain
    return len(dom) == 2 and dom[0] == dom[1]


def add_decisions(m: cp_model.CpModel, cg: CostGraph, M: list[str], read: set):
    """The plan's decisions on the model nodes ``M`` (forward values backward may need): ``s[v]``
    (candidates only: saved from the forward), ``r[v]`` (recomputed in backward; 0 for random and
    mutating ops), ``need[v]`` (backward needs v: it reads it (``read``), or something recomputed
    reads it). A needed candidate is saved or recomputed, never both; anything else is recomputed
    exactly when needed. Returns (s, r, need)."""
    in_m = set(M)
    cands = set(cg.candidates)
    s, r, need = {}, {}, {}
    for v in M:
        need[v] = m.new_constant(1) if v in read else m.new_bool_var(f"n_{v}")
        r[v] = m.new_constant(0) if cg.attr(v, "never_recompute") else m.new_bool_var(f"r_{v}")
        if v in cands:
            s[v] = m.new_bool_var(f"s_{v}")
            m.add(s[v] <= need[v])
            m.add(r[v] + s[v] >= need[v])
            m.add(r[v] + s[v] <= 1)
        else:
            m.add(r[v] == need[v])
    for u in M:  # needs through recomputation edges
        for p in cg.preds(u):
            if p in in_m:
                m.add_implication(r[u], need[p])
    return s, r, need


def add_first_need(m: cp_model.CpModel, cg: CostGraph, M: list[str], r: dict, direct_first: dict[str, int],
                   B: int, first: dict, st: dict, more_reads: dict | None = None):
    """Constrain ``first[v]``, the first backward step that needs v (its first direct read, or the
    step where a recomputed reader is materialised; ``B - 1`` if none), and ``st[v]``, the step
    where v is materialised when recomputed (``first[v]``, except a multi-output op's getitems,
    taken at the op's own step). ``more_reads[v]``: step variables of further reads of v (reads
    made only under a literal, :mod:`.choice`), also candidates for the first.

    Start times are exact, not bounds: a value's last read may be a recomputation that reads it, so
    an early start would let the model end a saved value's life before its real last read. Returns
    the per-edge step variables ``xs[(v, w)]`` and each getitem's parent op.
    """
    in_m = set(M)
    xs = {}
    getitem_parent = {u: cg.preds(u)[0] for u in M
                      if cg.attr(u, "op") == "getitem" and cg.preds(u)[0] in in_m}
    for v in M:
        terms = ([direct_first[v]] if v in direct_first else []) + list((more_reads or {}).get(v, ()))
        for w in cg.g.successors(v):
            if w not in in_m:
                continue
            at = first[w] if getitem_parent.get(w) == v else st[w]
            x = m.new_int_var(0, B - 1, f"x_{v}_{w}")
            xs[(v, w)] = x
            if is_const(r[w]):  # never recomputed
                m.add(x == B - 1)
            else:
                m.add(x == at).only_enforce_if(r[w])
                m.add(x == B - 1).only_enforce_if(~r[w])
            terms.append(x)
        m.add_min_equality(first[v], terms or [B - 1])
        if v in getitem_parent:
            m.add(st[v] == st[getitem_parent[v]]).only_enforce_if(r[v])
        else:
            m.add(st[v] == first[v])
    return xs, getitem_parent


def add_value_life(m: cp_model.CpModel, cg: CostGraph, v: str, r: dict, st: dict, F: int, readers, in_m, *,
                   last_bounds: tuple[int, int], rc_bounds: tuple[int, int], more_last=()) -> tuple:
    """When a candidate ``v``'s life in backward ends and when its recomputation starts: ``last``, at
    least every recomputed reader's time (``readers``: nodes reading v's storage, those in ``in_m``)
    and each ``(step, literal)`` of ``more_last`` under its literal; ``rc_start``, the time of
    ``v``'s recomputation at step ``st[v]``, with ``last >= rc_start`` when it is recomputed
    (``r[v]``). The full and choice models' intervals (:func:`add_value_intervals`) and the block
    models' windowed ones (:mod:`.blockbound`) are built on it.

    Returns
    -------
    tuple
        ``(last, rc_start)``, integer variables within ``last_bounds`` and ``rc_bounds``.
    """
    last = m.new_int_var(*last_bounds, f"last_{v}")
    for k, when in more_last:
        m.add(last >= bw_time(F, k)).only_enforce_if(when)
    idx = cg.fw_index
    for u in readers:
        if u in in_m and u != v:
            m.add(last >= bw_time(F, st[u], idx[u])).only_enforce_if(r[u])
    at = alloc_index(cg, v)
    rc_start = m.new_int_var(*rc_bounds, f"rcs_{v}")
    m.add(rc_start == bw_time(F, st[v], at))
    m.add(last >= rc_start).only_enforce_if(r[v])
    return last, rc_start


def add_value_intervals(m: cp_model.CpModel, cg: CostGraph, v: str, size: int, s: dict, r: dict, st: dict,
                        F: int, B: int, fw_end: int, bw_read: int, readers, in_m, more_last=()) -> tuple:
    """The live intervals of a candidate ``v`` that backward may need (see :mod:`.model`): saved,
    ``[fw_end + 1, last]`` under ``s[v]``; recomputed, ``[bw_time(F, st[v], a), last]`` under ``r[v]``
    (``a``: its op's forward index). ``last`` is at least its last direct backward read (step
    ``bw_read``, -1 if none), every recomputed reader's time (``readers``: nodes reading v's storage)
    and each ``(step, literal)`` of ``more_last`` under its literal (reads only some choices make).

    Returns
    -------
    tuple
        ``(intervals, demands, aux)``: the two optional intervals, their demands (``size`` each) and
        the variables ``last``, ``sv_*`` and ``rc_*`` (for hints).
    """
    t_end = bw_time(F, B - 1)
    at = alloc_index(cg, v)
    last, rc_start = add_value_life(m, cg, v, r, st, F, readers, in_m,
                                    last_bounds=(bw_time(F, bw_read) if bw_read >= 0 else F, t_end),
                                    rc_bounds=(bw_time(F, 0, at), bw_time(F, B - 1, at)), more_last=more_last)
    sv_start = fw_end + 1  # saved: [fw_end + 1, last]
    sv_size = m.new_int_var(0, t_end + 1, f"svsz_{v}")
    m.add(sv_size == last - sv_start + 1)
    sv_end = m.new_int_var(0, t_end + 2, f"svend_{v}")
    saved = m.new_optional_interval_var(sv_start, sv_size, sv_end, s[v], f"sv_{v}")
    rc_size = m.new_int_var(1, t_end + 1, f"rcsz_{v}")  # recomputed: [rc_start, last]
    m.add(rc_size == last - rc_start + 1).only_enforce_if(r[v])
    rc_end = m.new_int_var(F, t_end + 2, f"rce_{v}")
    recomputed = m.new_optional_interval_var(rc_start, rc_size, rc_end, r[v], f"rc_{v}")
    aux = {"last": last, "sv_size": sv_size, "sv_end": sv_end, "sv_start": sv_start, "rc_start": rc_start,
           "rc_size": rc_size, "rc_end": rc_end}
    return [saved, recomputed], [size, size], aux


def add_candidate_intervals(m: cp_model.CpModel, cg: CostGraph, unit: int, fw_reads: dict, in_m,
                            value_intervals) -> tuple[list, list, dict]:
    """Every candidate's forward interval (from its allocation to its last forward read), and, for a
    candidate in ``in_m`` (one backward may need), the intervals ``value_intervals(v, size, fw_end)``
    returns (:func:`add_value_intervals` with the caller's backward reads): ``(intervals, demands, aux)``
    in ``unit`` bytes, ``aux`` each such candidate's hint variables."""
    intervals, demands, aux = [], [], {}
    for v in cg.candidates:
        size = cg.attr(v, "bytes") // unit
        a = alloc_index(cg, v)
        e = max(fw_reads.get(v, a), a)
        intervals.append(m.new_fixed_size_interval_var(a, e - a + 1, f"fw_{v}"))
        demands.append(size)
        if v in in_m:
            more, more_demands, aux[v] = value_intervals(v, size, e)
            intervals += more
            demands += more_demands
    return intervals, demands, aux
