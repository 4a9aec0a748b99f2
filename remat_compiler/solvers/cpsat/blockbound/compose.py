"""The composition: one plan per block chosen from the menu under the budget, by a DP over the blocks
(:func:`_compose`, on a :class:`_Frame`)."""
from __future__ import annotations



from remat_compiler.graph import CostGraph
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.parts import alloc_index, storage_readers
from remat_compiler.solvers.cpsat.blockbound.layout import _Layout, _Profile
from remat_compiler.solvers.cpsat.blockbound.menu import _MenuPoint

__all__ = ["_Frame", "_compose", "fits"]


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


def fits(points: list[_MenuPoint], frame: _Frame, budget: int) -> bool:
    """Whether these block plans (one per block, forward order) meet the composition's constraints:
    each block's window and forward, and the head's window, under ``budget`` with the held bytes of
    the blocks below (:func:`_compose`). Until the head first reads a block's value nothing of the
    blocks has been recomputed or freed, so there (each block's forward, the head) a plan's blocks
    hold what they save, ``F``, not only ``H``, its least (a stand-in's ``H`` where it has no plan)."""
    held = saved = 0
    for o, off, fw in zip(points, frame.offsets, frame.forward):
        if saved + fw > budget or o.W + off + held > budget:
            return False
        held += o.H
        saved += o.H if o.F is None else o.F
    return saved + frame.head <= budget
