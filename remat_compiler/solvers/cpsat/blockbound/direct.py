"""A plan for the bound's choice without refining its stand-ins: each block that chose a stand-in gets
the cheapest block plan of that band under the window peak the choice leaves it (:func:`direct_plans`).

The bound's choice is a list of menu points, one per block; a stand-in point stands for a band's
plans (H up to the band's upper edge) with optimistic measures. Refining its band solves the whole
staircase of cost over W there (38 solves, 5.3 of the 13.5 s of GPT-2's solve under Inductor's
decompositions); the choice needs one plan of it: the least cost with ``H <= hi`` and
``W <= budget - off_m - S_m``, where ``S_m`` is the held bytes the choice puts below block ``m``.
The plans so found may hold more than their stand-in's label, so the composition is checked again on
their own measures (:func:`~.compose.fits`). Their cost is never below the bound (the bound is the least over
the menu, whose stand-ins dominate these plans), so where it meets the bound within the caller's
tolerance the refinement can stop: the bound stays the stand-ins' (a valid one) and the plan is within
tolerance of it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from remat_compiler.clock import Deadline
from remat_compiler.solvers.cpsat.blockbound.compose import _Frame, fits
from remat_compiler.solvers.cpsat.blockbound.menu import _MenuPoint, _staircase
from remat_compiler.solvers.cpsat.blockbound.variants import _Menus

__all__ = ["direct_plans"]


def direct_plans(menu: _Menus, options: list[_MenuPoint], stand: list, choice: list[int], frame: _Frame,
                 budget: int, deadline: Deadline, workers: int = 2, extra: int = 0) -> list[_MenuPoint] | None:
    """One block plan per block for ``choice`` (option indices into ``options``; ``stand[i]`` the band
    or ``(band, point)`` option ``i`` stands for, None for a found plan): found plans kept, each
    stand-in replaced by the cheapest plan of its band holding at most its label and a share of the
    head's spare bytes, under the window peak the choice then leaves (ties to the least W). None if a
    block has no such plan, a solve is not proven by ``deadline``, or the plans do not fit together
    (:func:`~.compose.fits`) with the tail keeping ``extra`` bytes in the head's span."""
    unit = menu.menus[0][1].bm.unit  # the variants' models share the block's unit
    # a stand-in's H is its band's least; the plans found may hold more, and until the head's first
    # read of a block they hold all they save (F, :func:`~.compose.fits`): each gets an equal share of
    # what the head's window leaves over the labels and the kept plans' F, capping both its H and its
    # F, and the windows above are capped as if every share were taken
    labelled = sum(options[i].H if stand[i] is not None or options[i].F is None else options[i].F
                   for i in choice)
    spare = max(0, budget - frame.head - extra - labelled) // max(1, sum(stand[i] is not None for i in choice))
    # where boundaries are pulled, the windows are charged what the blocks below save (:func:`fits`)
    held = saved = 0
    wanted = {}
    for m, i in enumerate(choice):
        item, h = stand[i], options[i].H
        f = h if options[i].F is None else options[i].F
        if item is not None:
            mi, item = item
            b = item if not isinstance(item, tuple) else item[0]
            h_cap = min(menu.menus[mi][1].edges[b + 1], h + spare) // unit
            w_cap = (budget - frame.offsets[m] - (saved if frame.pulled else held)) // unit
            wanted.setdefault((mi, h_cap, w_cap, (h + spare) // unit), []).append(m)
            h, f = h_cap * unit, h + spare
        held += h
        saved += f
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = dict(zip(wanted, pool.map(lambda caps: _cheapest(menu.menus[caps[0]], *caps[1:], deadline),
                                          wanted)))
    if any(p is None for p in found.values()):
        return None
    points = [options[i] for i in choice]
    for caps, blocks in wanted.items():
        for m in blocks:
            points[m] = found[caps]
    return points if fits(points, frame, budget, extra) else None


def _cheapest(menu: tuple, h_cap: int, w_cap: int, f_cap: int, deadline: Deadline) -> _MenuPoint | None:
    """The block plan of least cost with ``H <= h_cap``, ``W <= w_cap`` and ``F <= f_cap`` (model
    units): the first step of the staircase of cost over W under those caps
    (:func:`~.menu._staircase`); None if there is none or it is not proven by the deadline."""
    if w_cap < 0:
        return None
    variant, menu = menu
    points = _staircase(menu.bm, menu.bm.W, deadline, H_cap=h_cap, cap=w_cap, below=lambda x: None, F_cap=f_cap)
    if not points:
        return None
    points[0].variant = variant
    return points[0]
