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

4. *Pulled boundaries.* Where no block's value is read by backward before the block's own window,
   as in a bfloat16 decoder stack (its residual sum is read by the next layer's float32 copy and
   its residual add, whose backward passes need neither), the boundary is read by the next block's
   forward only: that block's recomputation may *pull* it at any step before the window, pulling
   with it what it is computed from, and a chain of pulls may reach further back. Then the block
   plan of a plan is taken in one of four *variants* ``(pulled, pulls)``: whether its boundary is
   pulled (modelled as a read at the last step before its window: its window is the same whenever
   the pull runs), and whether it recomputes a reader of the previous block's boundary; consecutive
   blocks agree (block ``m``'s ``pulled`` is block ``m + 1``'s ``pulls``). H is ``F`` read: the
   bytes saved that backward reads at all, which no block frees before the blocks' backward begins.
   So ``forward_m + sum_{j<m} H_j`` and the head's forward plus ``sum_j H_j`` stay within the
   budget; in the windows, where a pull may already have freed a block's share, only ``W_m + off_m``
   (and the head's window's fixed memory) does. Each variant has its own menu
   (:mod:`.variants`).

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
adjust what lies outside the blocks) its cost meets the bound, up to what lies outside. A caller with
a tolerance need not wait for that: before each refinement, the choice's stand-ins are replaced by
plans solved for that choice alone (:mod:`.direct`), the plans found so far are composed on what
they save (:func:`_plans_composed`), and where the cheaper is within the tolerance of the bound it is
the answer, the bound staying the stand-ins'.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace


from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph, representative_block
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.blockbound.block_model import _BlockModel
from remat_compiler.solvers.cpsat.blockbound.compose import _compose, _Frame, fits
from remat_compiler.solvers.cpsat.blockbound.direct import direct_plans
from remat_compiler.solvers.cpsat.blockbound.layout import _fixed_intervals, _Layout
from remat_compiler.solvers.cpsat.blockbound.menu import _Menu, _MenuPoint
from remat_compiler.solvers.cpsat.blockbound.tail import head_menu
from remat_compiler.solvers.cpsat.blockbound.variants import VARIANTS, _Menus

__all__ = ["BlockBound", "block_bound"]


@dataclass
class BlockBound:
    """A lower bound on the cost of every plan of the model that fits (``inf``: none fits), and a
    choice of block plans composed into a saved set (everything outside the blocks saved; to be
    simulated). With ``exact`` the choice is the bound's own (its blocks cost ``bound``); without,
    either the caller's ``accept`` took plans solved for a choice that still had stand-ins, or the
    time ran out before the bound's choice was made of found plans and ``saved`` is the best choice
    of the plans found by then (either way its blocks may cost more than ``bound``)."""

    bound: float
    saved: set[str] | None = None
    saved_cost: float | None = None  # what ``saved`` recomputes, as its block plans and the tail's point claim
    exact: bool = True
    block_candidates: set[str] = field(default_factory=set)
    menu_size: int = 0
    time_s: float = 0.0
    solves: int = 0  # staircase solves of cost over W made for the menu so far (kept menus: all calls')
    head_times: tuple[int, int] | None = None  # the head's span on the model's time axis: after the
    # blocks' forward, before its first read of a block's value (where every block holds what it saves)


def block_bound(cg: CostGraph, budget_bytes: int, cost_of, *, deadline: Deadline, menus: dict | None = None,
                cost_key=None, min_blocks: int = 3, w_granule: int | None = None, accept=None,
                head_extra: int = 0, tail: bool = True) -> BlockBound | None:
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
    step of the staircases solved), which change the work, not the bound. ``accept(cost, bound)``:
    where given, before refining a choice its stand-ins are replaced by plans solved for it alone
    (:mod:`.direct`), and the plans found so far are composed (:func:`_plans_composed`); if the
    cheaper's cost is accepted against the bound (the caller's tolerance), those plans are the answer
    (``exact`` False) and the bound stays the stand-ins'. ``head_extra``: bytes the head's window is
    taken to hold beyond its fixed memory (a caller's measure of what lies outside the blocks there;
    the bound is then that of the smaller problem). ``tail``: charge the head's span the tail's menu
    (:mod:`.tail`: what the values outside the blocks keep there against what they recompute); without
    it they count as free there, a weaker bound whose choice saves everything outside the blocks.
    """
    t_start = time.perf_counter()
    lay = _Layout(cg)
    if not lay.ok or lay.L < min_blocks:
        return None
    fixed = _fixed_intervals(cg, lay)
    k = representative_block(lay.stack)
    frame = _Frame(cg, lay, fixed, k)
    frame.head += head_extra
    head_times = (cg.fw_index[lay.nodes[-1][-1]] + 1, bw_time(lay.F, lay.tau_head, 0) - 1)
    # the fingerprint does not cover costs (a runtime estimate depends on the cost model): key on
    # the reference block's costs too
    key = (cg.fingerprint, cost_key, tuple(int(cost_of(v)) for v in lay.nodes[k]), w_granule)
    keep = menus is not None and cost_key is not None
    menu = menus.get(key) if keep else None
    if menu is None:
        cands = set(cg.candidates)
        sizes = [cg.attr(v, "bytes") for v in lay.nodes[k] if v in cands]
        parts = []
        for variant in (VARIANTS if lay.pull is not None else (None,)):
            one = _Menu(_BlockModel(cg, lay, k, cost_of, fixed, variant=variant),
                        _BlockModel(cg, lay, k, cost_of, fixed, memory=False, variant=variant), sizes, deadline,
                        w_granule)
            if one.empty:
                continue  # no block plan of this variant
            if not one.ok:
                return None
            parts.append((variant, one))
        if not parts:
            return None
        menu = _Menus(parts)
        if keep:
            menus[key] = menu
    if tail and menu.tail is None:  # kept with the blocks' menus: it depends on the graph and the costs alone
        menu.tail = head_menu(cg, lay, fixed, cost_of, deadline)
    the_tail = menu.tail if tail else ([(0, 0, None)], frozenset())
    frame.head_menu = [(x, charge) for x, charge, _ in the_tail[0]]
    if not tail and menu.tail is not None:
        # the head charged ``head_extra`` leaves the tail that much: its saved set keeps the tail as
        # the menu's point of the most bytes within it does (a point's charge is not the bound's)
        within = [p for p in menu.tail[0] if p[0] <= head_extra and p[2] is not None]
        if within:
            the_tail = ([(0, 0, max(within, key=lambda p: p[0])[2])], menu.tail[1])
    while True:
        options, stand = menu.options()
        found = _compose(options, frame, budget_bytes)
        if found is None:  # not even the stand-ins fit: no plan does
            return BlockBound(bound=math.inf, time_s=time.perf_counter() - t_start)
        cost, choice, (extra, charge) = found
        todo = {stand[i] for i in choice if stand[i] is not None}
        if not todo:
            break
        if accept is not None:
            direct = direct_plans(menu, options, stand, choice, frame, budget_bytes, deadline, extra=extra)
            tried = [p for p in ((direct, (extra, charge)) if direct is not None else None,
                                 _plans_composed(options, frame, budget_bytes)) if p is not None]
            best = min(tried, key=lambda p: sum(o.cost for o in p[0]) + p[1][1], default=None)
            plan_cost = None if best is None else sum(o.cost for o in best[0]) + best[1][1]
            if best is not None and accept(plan_cost, cost):
                return BlockBound(bound=cost, saved=_saved(cg, lay, best[0], best[1], the_tail),
                                  saved_cost=plan_cost,
                                  block_candidates=_block_candidates(cg, lay), exact=False, menu_size=len(options),
                                  time_s=time.perf_counter() - t_start, solves=menu.solves, head_times=head_times)
        # the next choice often moves to a neighbouring band: refine those along (both cores busy)
        todo |= menu.neighbours(todo)
        if not menu.refine(todo, deadline):
            # the time is up: the bound stands (an unrefined band still stands for its plans), and the
            # best choice of the plans found so far, on what they save, is still a plan (on GPT-2 under
            # the runtime objective at 25 s the bound's own choice missed the deadline, and with it the plan)
            options, _ = menu.options()
            found_plans = _plans_composed(options, frame, budget_bytes)
            saved = None if found_plans is None else _saved(cg, lay, *found_plans, the_tail)
            return BlockBound(bound=cost, saved=saved,
                              saved_cost=None if found_plans is None else
                              sum(o.cost for o in found_plans[0]) + found_plans[1][1],
                              block_candidates=_block_candidates(cg, lay), exact=False, menu_size=len(options),
                              time_s=time.perf_counter() - t_start, solves=menu.solves, head_times=head_times)
    points, head, exact = [options[i] for i in choice], (extra, charge), True
    if lay.pull is not None and not fits(points, frame, budget_bytes, extra):
        # the bound's windows leave out what the blocks below hold (a pull may have freed it): its
        # choice may not fit as composed; the plans, charged so, are chosen from the whole menu
        exact = False
        found_plans = _plans_refined(menu, frame, budget_bytes, deadline)
        if found_plans is not None:
            points, head = found_plans
    return BlockBound(bound=cost, saved=_saved(cg, lay, points, head, the_tail),
                      saved_cost=sum(o.cost for o in points) + head[1],
                      exact=exact, block_candidates=_block_candidates(cg, lay), menu_size=len(options),
                      time_s=time.perf_counter() - t_start, solves=menu.solves, head_times=head_times)


#: The lattice on which :func:`_plans_refined` picks the stand-ins to refine (plans are rounded up to
#: it, so what fits on it fits on the finer one the answer is composed on): on the 70B's menu with its
#: stand-ins a programme on 2^14 points took 15 s
EXPLORE_LATTICE = 1 << 12


def _plans_refined(menu: _Menus, frame: _Frame, budget: int, deadline: Deadline):
    """The cheapest composition of block plans on their own saved bytes (:func:`_plans_composed`)
    over the whole menu: a band's stand-in stands for its plans (its H for their saved bytes, the
    least) until the programme (on :data:`EXPLORE_LATTICE`) picks it, then it is refined, until the
    programme picks plans only; then the plans found are composed. On Llama-70B at seq 16384 and 0.3
    of the no-recompute peak, the plans found for the bound's choice composed at 3.5899e11 FLOP units,
    these at 3.5377e11 (the bound: 3.5294e11). A round (a programme and a refinement) starts only
    while the deadline leaves as long as the last one took (each running to its end overran it by 5
    to 10 s there). None where no composition of plans fits."""
    took = 0.0
    while deadline.left() > took:
        started = time.perf_counter()
        options, stand = menu.options()
        plans = [_on_saved(o) or o for o in options]  # a stand-in as it is: its H, the least
        found = _compose(plans, frame, budget, plans=True, lattice=EXPLORE_LATTICE)
        if found is None:
            break
        todo = {stand[i] for i in found[1] if stand[i] is not None}
        if not todo or not menu.refine(todo, deadline):
            break
        took = time.perf_counter() - started
    return _plans_composed(menu.options()[0], frame, budget)


def _plans_composed(options: list[_MenuPoint], frame: _Frame, budget: int):
    """The cheapest composition of the plans found so far (no stand-in) on their own saved bytes
    (``F``, what a block holds until its values are first read; labelled ``H`` is the band's least),
    one per block, and the head menu's point it leaves the tail: (plans, (x, charge)), or None where
    none fits."""
    plans = [p for p in map(_on_saved, options) if p is not None]
    found = _compose(plans, frame, budget, plans=True)
    return None if found is None else ([plans[i] for i in found[1]], found[2])


def _on_saved(o: _MenuPoint) -> _MenuPoint | None:
    """A found plan labelled with what it saves (``H`` = ``F``) for a composition of plans; None for a
    stand-in."""
    return replace(o, H=o.F) if o.saved is not None and o.F is not None else None


def _saved(cg: CostGraph, lay: _Layout, points: list[_MenuPoint], head: tuple[int, int], tail) -> set[str]:
    """The saved set of these block plans, one per block, with the tail (:mod:`.tail`) kept as the head
    menu's point ``head`` keeps it where a solution of it is known, everything else outside the blocks
    saved."""
    saved = _composed(cg, lay, points, list(range(lay.L)))
    points_, values = tail
    kept = next((what for x, c, what in points_ if (x, c) == head), None)
    if kept is None:
        return saved
    outside = values - _block_candidates(cg, lay)
    return (saved - outside) | kept


def _block_candidates(cg: CostGraph, lay: _Layout) -> set[str]:
    return {v for ns in lay.nodes for v in ns} & set(cg.candidates)


def _composed(cg: CostGraph, lay: _Layout, options: list[_MenuPoint], choice: list[int]) -> set[str]:
    """The saved set of ``choice`` (an option per block), everything outside the blocks saved."""
    saved = set(cg.candidates) - _block_candidates(cg, lay)
    for m, i in enumerate(choice):
        saved |= {lay.nodes[m][p] for p in options[i].saved}
    return saved
