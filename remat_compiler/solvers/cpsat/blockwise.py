"""Plans for graphs of many identical blocks, composed from per-block options (a decomposition).

A transformer's layers are identical blocks. With every block's boundary saved (its output, the next
block's input), what one block saves or recomputes changes memory only in two ways: while the block
is *active* (its forward or its backward runs) by its own working set, and while it is *idle*
(between its forward and its backward) by the bytes it keeps saved. So a plan is one option per
block, and its peak is, for each window of the step (a run of forward or backward nodes of one
block, or of nodes between blocks)::

    R_w(option of the active block) + sum over idle blocks k of S(option of k)  <=  budget

The menu of options comes from two greedy paths over one block's values (dropping from everything
saved, saving more from the checkpoint plan); ``R_w`` and ``S`` come from one simulation of each
option applied to every block. A small CP-SAT model (one choice per block) then picks the cheapest mix, and the mix is
simulated for real: the decomposition only proposes, the simulator decides. If the mix peaks above
the budget (a block's recomputation spilling into a window it was not charged to), the window
budget is tightened and the choice solved again.

This is a heuristic for the full problem (optimal only within the menu), used by CP-SAT as a warm
start on big graphs, where the full model cannot be searched within seconds.
"""
from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.graph import BlockStack, CostGraph, block_stack, representative_block
from remat_compiler.schedule import build_schedule, peak_of, simulate
from remat_compiler.solvers.cpsat.run import make_solver, run_solver

__all__ = ["blockwise_saved_set"]


class _LocalBlock:
    """One block's recompute cost and idle bytes for a set of saved positions, without simulation.

    Backward needs what its nodes read from the block; what is not saved is recomputed from the
    closest saved values (everything outside the block is available: the base plan saves it).
    """

    def __init__(self, cg: CostGraph, stack: BlockStack, k: int, base: set[str], cost_of):
        self.block = stack.blocks[k]
        self.pos = {v[k]: i for i, v in enumerate(stack.positions)}
        self.nodes = [n for n in cg.fw_order if cg.attr(n, "block") == self.block]
        inside = set(self.nodes)
        self.fixed_saved = {n for n in self.nodes if n in base}
        self.preds = {n: [p for p in cg.preds(n) if p in inside] for n in self.nodes}
        self.direct = {p for b in cg.bw_order for p in cg.preds(b) if p in inside}
        self.cost = {n: cost_of(n) for n in self.nodes}
        self.bytes = {n: cg.attr(n, "bytes") for n in self.nodes}
        self.storage = {n: cg.storage(n) for n in self.nodes}

    def evaluate(self, saved_pos: set[int]) -> tuple[int, int]:
        """(recompute cost, bytes kept saved) with these positions saved on top of the base."""
        saved = self.fixed_saved | {n for n, i in self.pos.items() if i in saved_pos}
        need, stack = set(), list(self.direct)
        while stack:
            n = stack.pop()
            if n in need:
                continue
            need.add(n)
            if n not in saved:
                stack.extend(self.preds[n])
        recompute = [n for n in need if n not in saved]
        held = {self.storage[n] for n in need if n in saved}
        return sum(self.cost[n] for n in recompute), sum(self.bytes.get(o, 0) for o in held if o)


def _greedy_family(local: _LocalBlock, free: list[int], start: set[int], grow: bool) -> list[frozenset[int]]:
    """Options along a greedy path: from all free positions saved, drop the one that costs least per
    byte freed (``grow`` False); or from none, add the one that saves most cost per byte (True)."""
    cur = set(start)
    cost, held = local.evaluate(cur)
    path = [frozenset(cur)]
    while True:
        best = None
        for i in free:
            if (i in cur) != (not grow):
                continue
            trial = cur | {i} if grow else cur - {i}
            c, h = local.evaluate(trial)
            d_cost, d_bytes = (cost - c, h - held) if grow else (c - cost, held - h)
            if d_bytes <= 0:
                if grow or d_cost > 0:
                    continue
                score = float("-inf")  # frees nothing and costs nothing: take it
            else:
                score = d_cost / d_bytes if not grow else -d_cost / d_bytes
            if best is None or score < best[0]:
                best = (score, trial, c, h)
        if best is None:
            return path
        _, cur, cost, held = best
        path.append(frozenset(cur))


def _menu(cg: CostGraph, stack: BlockStack, base: set[str], cost_of) -> list[frozenset[int]]:
    """Options as sets of free position indices saved on top of ``base``.

    Two greedy paths on one block (dropping from everything saved, and saving more starting from the
    checkpoint plan), each block's cost and saved bytes judged by :class:`_LocalBlock`; both paths
    include none and all of the positions.
    """
    free = [i for i, p in enumerate(stack.positions) if not set(p) & base]
    local = _LocalBlock(cg, stack, representative_block(stack), base, cost_of)
    options: list[frozenset[int]] = []
    for path in (_greedy_family(local, free, set(free), grow=False),
                 _greedy_family(local, free, set(), grow=True)):
        for opt in path:
            if opt not in options:
                options.append(opt)
    return options


@dataclass
class _BlockOption:
    saved: set[str]
    cost: int           # recompute cost of one block
    idle_bytes: int     # S: the most a block holds while idle
    window_peak: list[int]  # R_w per window
    peak: int           # simulated peak of the option in every block


def _windows(cg: CostGraph, stack: BlockStack):
    """Check points (forward node i, backward step F + j) grouped into windows.

    Returns per window its active block index and its idle blocks, and for each block index its idle
    range of check points (exclusive bounds). Backward nodes outside every block (gradient sums
    between layers) belong to the block whose backward ran last; forward ones to none.
    """
    index = {b: k for k, b in enumerate(stack.blocks)}
    F = len(cg.fw_order)
    active = [index.get(cg.attr(n, "block")) for n in cg.fw_order] + \
             [index.get(cg.attr(n, "block")) for n in cg.bw_order]
    fw_end = [-1] * len(stack.blocks)
    bw_start = [len(active)] * len(stack.blocks)
    for c, k in enumerate(active):
        if k is None:
            continue
        if c < F:
            fw_end[k] = max(fw_end[k], c)
        else:
            bw_start[k] = min(bw_start[k], c)
    windows, window_of = [], []
    last = None
    for c, k in enumerate(active):
        idle = frozenset(i for i in range(len(stack.blocks)) if fw_end[i] < c < bw_start[i])
        if k is None and last is not None and c >= bw_start[last]:
            k = last  # nodes between a block's backward nodes: that block's values are still live
        last = k if k is not None else last
        key = (k, idle)
        if not windows or windows[-1] != key:
            windows.append(key)
        window_of.append(len(windows) - 1)
    return windows, window_of, fw_end, bw_start


def _evaluate(cg: CostGraph, stack: BlockStack, saved: set[str], windows, window_of, fw_end, bw_start,
              cost_of) -> _BlockOption:
    """Simulate a uniform option; split each event's live bytes into idle blocks' and the rest."""
    schedule = build_schedule(cg, saved)
    sim = simulate(cg, schedule)
    F = len(cg.fw_order)
    checkpoint = list(range(F))  # check point of each event
    for j, (rec, _b) in enumerate(schedule.bw):
        checkpoint.extend([F + j] * (len(rec) + 1))
    n_ev = len(sim.events)
    first_ev = {}
    for e, c in enumerate(checkpoint):
        first_ev.setdefault(c, e)
    index = {b: k for k, b in enumerate(stack.blocks)}
    idle_diff = [0] * (n_ev + 1)
    per_block: dict[int, list[tuple[int, int]]] = {}
    for key, (a, z) in sim.spans.items():
        k = index.get(cg.attr(key[0], "block"))
        if k is None:
            continue
        lo = first_ev.get(fw_end[k] + 1, n_ev)
        hi = first_ev.get(bw_start[k], n_ev) - 1
        a, z = max(a, lo), min(z, hi)
        if a > z:
            continue
        size = sim.sizes[key]
        idle_diff[a] += size
        idle_diff[z + 1] -= size
        per_block.setdefault(k, []).extend([(a, size), (z + 1, -size)])
    idle_bytes = 0
    for points in per_block.values():
        cur = 0
        for _e, d in sorted(points):
            cur += d
            idle_bytes = max(idle_bytes, cur)
    window_peak = [0] * len(windows)
    idle = 0
    for e, (_n, live) in enumerate(sim.events):
        idle += idle_diff[e]
        w = window_of[checkpoint[e]]
        window_peak[w] = max(window_peak[w], live - idle)
    rep = stack.blocks[representative_block(stack)]
    cost = sum(cost_of(n) for n in schedule.recomputed if cg.attr(n, "block") == rep)
    return _BlockOption(saved=set(schedule.saved), cost=cost, idle_bytes=idle_bytes, window_peak=window_peak,
                   peak=sim.peak_bytes)


def _choose(options: list[_BlockOption], windows, n_blocks: int, cap: int, seconds: float, deadline: Deadline):
    """One option per block: least total cost with every window within ``cap``, and its predicted
    peak; None if none fits."""
    m = cp_model.CpModel()
    x = [[m.new_bool_var(f"x_{k}_{o}") for o in range(len(options))] for k in range(n_blocks)]
    held = []
    for k in range(n_blocks):
        m.add_exactly_one(x[k])
        h = m.new_int_var(0, max(o.idle_bytes for o in options), f"s_{k}")
        m.add(h == sum(o.idle_bytes * x[k][i] for i, o in enumerate(options)))
        held.append(h)
    for w, (active, idle) in enumerate(windows):
        idle_sum = sum(held[k] for k in idle)
        if active is None:
            m.add(max(o.window_peak[w] for o in options) + idle_sum <= cap)
        else:
            m.add(sum(o.window_peak[w] * x[active][i] for i, o in enumerate(options)) + idle_sum <= cap)
    m.minimize(sum(o.cost * x[k][i] for k in range(n_blocks) for i, o in enumerate(options)))
    solver = make_solver(max(0.1, seconds), 2, deadline.deterministic)
    status = run_solver(solver, m, deadline=deadline)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choice = [next(i for i in range(len(options)) if solver.value(x[k][i])) for k in range(n_blocks)]
    return choice, _predicted_peak(options, windows, choice)


def _predicted_peak(options: list[_BlockOption], windows, choice: list[int]) -> int:
    """The decomposition's peak of a choice: its largest window."""
    peak = 0
    for w, (active, idle) in enumerate(windows):
        own = max(o.window_peak[w] for o in options) if active is None else options[choice[active]].window_peak[w]
        peak = max(peak, own + sum(options[choice[k]].idle_bytes for k in idle))
    return peak


def blockwise_saved_set(cg: CostGraph, budget_bytes: int, base, cost_of, *, deadline: Deadline,
                        tries: int = 6) -> set[str] | None:
    """A saved set fitting ``budget_bytes`` composed of per-block options, or None.

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int
    base : iterable of str
        What every option saves (the checkpoint-every-block plan: block boundaries and everything
        outside the blocks).
    cost_of : callable
        Recompute cost of a node (the solver's objective).
    deadline : Deadline
        Bounds the whole call, simulations included (the menu gets 60% of it).
    """
    stack = block_stack(cg)
    if stack is None:
        return None
    base = set(base)
    menu = _menu(cg, stack, base, cost_of)
    windows, window_of, fw_end, bw_start = _windows(cg, stack)
    options = []
    for opt in menu:
        saved = base | {v for i in opt for v in stack.positions[i]}
        options.append(_evaluate(cg, stack, saved, windows, window_of, fw_end, bw_start, cost_of))
        if deadline.elapsed() > 0.6 * deadline.seconds and len(options) >= 2:
            break
    n = len(stack.blocks)
    pos_of = {v: (p, k) for p, pos in enumerate(stack.positions) for k, v in enumerate(pos)}
    uniform = min((o for o in options if o.peak <= budget_bytes), key=lambda o: o.cost, default=None)
    cap = budget_bytes
    for _ in range(tries):
        found = _choose(options, windows, n, cap, min(2.0, max(0.2, deadline.left())), deadline)
        if found is None or (uniform is not None and uniform.cost * n <= sum(options[i].cost for i in found[0])):
            break
        choice, predicted = found
        saved = {v for v in base if v not in pos_of}
        for k, i in enumerate(choice):
            saved |= {v for v in options[i].saved if v in pos_of and pos_of[v][1] == k}
        peak = peak_of(cg, saved)
        if peak <= budget_bytes:
            return saved
        # the mix peaks above its prediction: ask for a mix predicted lower by at least the excess
        cap = min(cap, predicted) - (peak - budget_bytes)
    return None if uniform is None else uniform.saved  # the same option in every block
