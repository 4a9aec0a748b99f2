"""The composition: one plan per block chosen from the menu under the budget, by a DP over the blocks
(:func:`_compose`, on a :class:`_Frame`)."""
from __future__ import annotations

import numpy as np

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.parts import alloc_index, storage_readers
from remat_compiler.solvers.cpsat.blockbound.layout import _Layout, _Profile
from remat_compiler.solvers.cpsat.blockbound.menu import _MenuPoint

__all__ = ["_Frame", "_compose", "fits"]


class _Frame:
    """What the dynamic programme needs beyond the menu: per block, the fixed memory of its window
    relative to the reference block's (at its least) and the least memory during its forward; and
    the least memory of the head's forward and window, before its first read of a block's value
    (where boundaries are pulled, ``head`` is the forward's and ``head_bw`` the window's)."""

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
        # the head's forward (its logits and loss, beside every block's held bytes) and its window
        fw_times = list(range(cg.fw_index[lay.nodes[-1][-1]] + 1, F))
        bw_times = [bw_time(F, j, slot) for j in range(lay.tau_head) for slot in (0, None)]
        self.pulled = lay.pull is not None
        # values outside the blocks that the blocks' forward reads and no backward step does (a
        # decoder's attention mask): not in the windows' fixed memory, as a plan that recomputes none
        # of their readers frees them, but live in a window whose block recomputes one. Plans are
        # charged them in every window (a composition of plans then fits as it claims); the bound not
        block_nodes = {n for ns in lay.nodes for n in ns}
        self.window_extra = sum(
            cg.attr(v, "bytes") for v in cg.candidates
            if v not in block_nodes and not cg.is_available_in_bw(v) and not lay.read_in_backward(v)
            and any(u in block_nodes for u in cg.g.successors(v)))
        #: what the tail keeps at the head's peak against what it recomputes (:mod:`.tail`): a bound
        #: charges its blocks ``head + x`` there and adds ``T``, for the cheapest point ``(x, T)``
        self.head_menu: list[tuple[int, int]] = [(0, 0)]
        if self.pulled:
            self.head = max(load(t) for t in fw_times)
            self.head_bw = max((load(t) for t in bw_times), default=0)
        else:
            self.head = max(load(t) for t in fw_times + bw_times)
            self.head_bw = 0


def _compose(menu: list[_MenuPoint], frame: _Frame, budget: int, *, plans: bool = False,
             lattice: int | None = None):
    """Least summed cost of one option per block with, for every block ``m``,
    ``W_m + off_m + sum_{j<m} H_j`` and ``forward_m + sum_{j<m} H_j`` within the budget, and
    ``head + sum_j H_j`` too: a dynamic programme over blocks in forward order on the Pareto front
    of (summed H, cost), each block's step over every state and option at once (numpy: in Python,
    the three calls on a bfloat16 Mistral-7B menu of hundreds of options took 40 s); the head's span
    is charged the cheapest point of ``frame.head_menu`` (:mod:`.tail`). Where boundaries are pulled
    (``frame.pulled``; module docstring of :mod:`..blockbound`, 4) H is what a block holds until the
    blocks' backward begins: the windows are ``W_m + off_m`` alone, the head's backward its fixed
    memory, and consecutive blocks' variants agree (:func:`_compose_pulled`, on a lattice of at most
    ``lattice`` points where given; ``plans``: the options are plans, composed on what they save). Returns
    (cost, option index per block, the head menu's point taken), or None when nothing fits; the cost
    includes the point's charge."""
    if frame.pulled:
        return _compose_pulled(menu, frame, budget, plans=plans, lattice=lattice)
    by_w = np.array(sorted(range(len(menu)), key=lambda i: menu[i].W), dtype=np.int64)  # ties: by W
    H = np.array([menu[i].H for i in by_w], dtype=np.int64)
    W = np.array([menu[i].W for i in by_w], dtype=np.int64)
    cost = np.array([menu[i].cost for i in by_w], dtype=np.int64)
    S, C = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)  # the front: summed H, cost
    history = []  # per block: (state index, option index) of each front entry
    for off, fw in zip(frame.offsets, frame.forward):
        live = S + fw <= budget
        ok = live[:, None] & (S[:, None] + W[None, :] + off + (frame.window_extra if plans else 0) <= budget)
        si, oi = np.nonzero(ok)
        if si.size == 0:
            return None
        nS, nC = S[si] + H[oi], C[si] + cost[oi]
        order = np.lexsort((nC, nS))  # by summed H, then cost
        nS, nC, si, oi = nS[order], nC[order], si[order], oi[order]
        # keep the states no state of smaller (or equal) summed H beats on cost
        before = np.concatenate(([np.iinfo(np.int64).max], np.minimum.accumulate(nC)[:-1]))
        keep = nC < before
        S, C = nS[keep], nC[keep]
        history.append((si[keep], oi[keep]))
    best = i = head = None
    for extra, charge in frame.head_menu:
        final = np.nonzero(S + frame.head + extra <= budget)[0]
        if final.size:
            at = int(final[np.argmin(C[final])])
            if best is None or int(C[at]) + charge < best:
                best, i, head = int(C[at]) + charge, at, (extra, charge)
    if best is None:
        return None
    choice = []
    for si, oi in reversed(history):
        choice.append(int(by_w[oi[i]]))
        i = int(si[i])
    return best, choice[::-1], head


#: The most points of the summed-H lattice :func:`_compose_pulled` keeps (a coarser step past it), for
#: a bound and for plans (whose H, their saved bytes, share no step, and whose windows are charged;
#: each H rounded up to a step: on Mistral-7B at seq 8192 and 0.3 of the no-recompute peak, 2^12 steps
#: composed plans of 2.6113e10 FLOP units, 2^14 of 2.5907e10, against a bound of 2.5839e10)
LATTICE_MAX = 1 << 15
PLAN_LATTICE_MAX = 1 << 14


def _compose_pulled(menu: list[_MenuPoint], frame: _Frame, budget: int, *, plans: bool,
                    lattice: int | None = None):
    """:func:`_compose` where boundaries are pulled. A block's window no longer depends on what the
    blocks before it hold, so each option is allowed or not per block by its own ``W``, and of the
    allowed options with the same H and variant only the cheapest matters: a min-plus programme on a
    lattice of summed H (the menu's H are its bands' labels, multiples of one step: on a 70B stack of
    80 blocks, 1,668 options, the Pareto programme took 110 s), one cost array per ``pulled`` of the
    last block. Where the step is finer than ``budget / LATTICE_MAX`` a coarser one is taken, H
    rounded down for a bound (a relaxation) and up for ``plans`` (what fits so, fits); ``lattice``:
    the most points, in place of :data:`LATTICE_MAX` or :data:`PLAN_LATTICE_MAX`."""
    H = np.array([o.H for o in menu], dtype=np.int64)
    W = np.array([o.W for o in menu], dtype=np.int64)
    cost = np.array([o.cost for o in menu], dtype=np.int64)
    pulled = np.array([o.variant[0] for o in menu], dtype=np.int64)
    pulls = np.array([o.variant[1] for o in menu], dtype=np.int64)
    rank = [(o.cost, o.W, o.H if o.F is None else o.F) for o in menu]
    step = int(np.gcd.reduce(H[H > 0])) if (H > 0).any() else 1
    most = lattice or (PLAN_LATTICE_MAX if plans else LATTICE_MAX)
    if budget // step + 1 > most:
        step = -(-budget // (most - 1))
    h = -(-H // step) if plans else H // step
    n = budget // step + 1
    inf = np.iinfo(np.int64).max // 4
    best = np.full((2, n), inf, dtype=np.int64)
    best[:, 0] = 0  # the first block may recompute a reader of what comes before the blocks, or not
    history = []  # per block: the option taken at each (pulled, summed H)
    groups: dict[int, list[tuple[int, int, int, int, int]]] = {}
    by_key = _by_key(h, W, cost, pulled, pulls, n) if plans else None  # the same for every block
    for off, fw in zip(frame.offsets, frame.forward):
        limit = (budget - fw) // step  # a lattice point's bytes are at most (a bound) or least (plans) its H's
        best[:, max(0, limit + 1):] = inf  # the blocks before hold too much for this block's forward
        new = np.full((2, n), inf, dtype=np.int64)
        arg = np.full((2, n), -1, dtype=np.int64)
        if plans:
            _step_charged(new, arg, best, by_key, budget - off - frame.window_extra, step)
            best = new
            history.append(arg)
            continue
        if off not in groups:  # the cheapest allowed option per (H, variant); of those, the least W
            # (what its window adds to the blocks below), then the least saved bytes
            cheapest: dict[tuple[int, int, int], int] = {}
            for i in np.nonzero(W + off <= budget)[0]:
                key = (int(h[i]), int(pulled[i]), int(pulls[i]))
                if key not in cheapest or rank[i] < rank[cheapest[key]]:
                    cheapest[key] = int(i)
            groups[off] = [(hh, p, q, int(cost[i]), i) for (hh, p, q), i in cheapest.items() if hh < n]
        for hh, p, q, c, i in groups[off]:
            cand = best[q, :n - hh] + c
            better = cand < new[p, hh:]
            new[p, hh:][better] = cand[better]
            arg[p, hh:][better] = i
        best = new
        history.append(arg)
    if frame.head_bw > budget:
        return None
    total = chosen = None
    for extra, charge in frame.head_menu:
        head = (budget - frame.head - extra) // step
        if head < 0:
            continue
        ends = best[:, :head + 1]
        if ends.min() >= inf:
            continue
        at = np.unravel_index(int(np.argmin(ends)), ends.shape)
        if total is None or int(ends[at]) + charge < total:
            total, (p, s), chosen = int(ends[at]) + charge, at, (extra, charge)
    if total is None:
        return None
    choice = []
    for arg in reversed(history):
        i = int(arg[p, s])
        choice.append(i)
        p, s = int(pulls[i]), s - int(h[i])
    return total, choice[::-1], chosen


def _by_key(h, W, cost, pulled, pulls, n: int) -> list[tuple]:
    """The options by (lattice H, variant) for :func:`_step_charged`: per key ``(hh, p, q, ids, ws,
    cs)``, the options in order of W (then cost), their W, and at each position the option and cost
    of the cheapest among the first k + 1 (a prefix minimum)."""
    keys: dict[tuple[int, int, int], list[int]] = {}
    for i in range(len(h)):
        if h[i] < n:
            keys.setdefault((int(h[i]), int(pulled[i]), int(pulls[i])), []).append(i)
    out = []
    for (hh, p, q), idx in keys.items():
        idx = np.array(sorted(idx, key=lambda i: (W[i], cost[i])), dtype=np.int64)
        cs = cost[idx]
        at = np.zeros(cs.size, dtype=np.int64)  # the cheapest among the first k + 1, by position
        for k in range(1, cs.size):
            at[k] = k if cs[k] < cs[at[k - 1]] else at[k - 1]
        out.append((hh, p, q, idx[at], W[idx], cs[at]))
    return out


def _step_charged(new, arg, best, by_key, room: int, step: int) -> None:
    """One block's step of :func:`_compose_pulled` for plans, each window charged what the blocks
    below save (at most a lattice point's bytes): option ``i`` is allowed at summed H ``s`` where
    ``W_i + s * step <= room``; per (H, variant), the cheapest of those allowed, by the prefix
    minimum of :func:`_by_key` (built once for all blocks)."""
    n = new.shape[1]
    inf = np.iinfo(np.int64).max // 4
    caps = room - np.arange(n, dtype=np.int64) * step
    for hh, p, q, ids, ws, cs in by_key:
        pos = np.searchsorted(ws, caps[:n - hh], side="right") - 1
        ok = pos >= 0
        at = np.maximum(pos, 0)
        cand = np.where(ok, best[q, :n - hh] + cs[at], inf)
        better = cand < new[p, hh:]
        new[p, hh:][better] = cand[better]
        arg[p, hh:][better] = ids[at][better]


def fits(points: list[_MenuPoint], frame: _Frame, budget: int, extra: int = 0) -> bool:
    """Whether these block plans (one per block, forward order) meet the composition's constraints:
    each block's window and forward, and the head's window, under ``budget`` with the held bytes of
    the blocks below (:func:`_compose`). Until the head first reads a block's value nothing of the
    blocks has been recomputed or freed, so there (each block's forward, the head) a plan's blocks
    hold what they save, ``F``, not only ``H``, its least (a stand-in's ``H`` where it has no plan).
    Where boundaries are pulled the windows are charged ``F`` too, as :func:`_compose_pulled` charges
    plans (the bound's windows charge nothing: a pull may have freed it), and every window the values
    outside the blocks only their recomputation reads (``frame.window_extra``). ``extra``: what the tail
    keeps in the head's span (a point of ``frame.head_menu``)."""
    held = saved = 0
    for o, off, fw in zip(points, frame.offsets, frame.forward):
        if saved + fw > budget or o.W + off + frame.window_extra + (saved if frame.pulled else held) > budget:
            return False
        held += o.H
        saved += o.H if o.F is None else o.F
    return saved + frame.head + extra <= budget and frame.head_bw <= budget
