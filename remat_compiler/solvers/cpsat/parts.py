"""Pieces of the CP-SAT model that the full model (:mod:`.model`) and the one-block models of the
block decomposition (:mod:`.blockbound`) share: when a forward value is allocated, which intervals no
plan changes, the decisions, and at which backward step a recomputed value is materialised."""
from __future__ import annotations

from ortools.sat.python import cp_model

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import SimResult, no_recompute

__all__ = ["alloc_index", "is_const", "storage_readers", "fixed_intervals", "add_decisions", "add_first_need"]


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
                   B: int, first: dict, st: dict):
    """Constrain ``first[v]``, the first backward step that needs v (its first direct read, or the
    step where a recomputed reader is materialised; ``B - 1`` if none), and ``st[v]``, the step
    where v is materialised when recomputed (``first[v]``, except a multi-output op's getitems,
    taken at the op's own step).

    Start times are exact, not bounds: a value's last read may be a recomputation that reads it, so
    an early start would let the model end a saved value's life before its real last read. Returns
    the per-edge step variables ``xs[(v, w)]`` and each getitem's parent op.
    """
    in_m = set(M)
    xs = {}
    getitem_parent = {u: cg.preds(u)[0] for u in M
                      if cg.attr(u, "op") == "getitem" and cg.preds(u)[0] in in_m}
    for v in M:
        terms = [direct_first[v]] if v in direct_first else []
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
