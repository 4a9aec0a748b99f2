"""A block's menu: the plans it offers the composition, as points of cost against held bytes and
window peak, found by staircases of CP-SAT solves and refined where a choice needs it (:class:`_Menu`)."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import reduce

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.solvers.cpsat.run import new_solver, run_solver
from remat_compiler.solvers.cpsat.blockbound.block_model import _BlockModel

__all__ = ["W_GRANULES", "W_SPLIT", "_MenuPoint", "_Menu", "_staircase", "_least", "_edge_below"]


#: The bands of W in a block's menu, in granules of H's bands, and how many finer bands each is cut
#: into when a choice needs it (see ``_Menu``).
W_GRANULES = 4
W_SPLIT = 16


def _clone_var(m: cp_model.CpModel, v):
    """``v``, a variable of the model ``m`` was copied from, as ``m``'s own."""
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
    F: int | None = None  # a plan's saved bytes (all live until the head's first read of a block)
    variant: tuple[int, int] | None = None  # its menu's (pulled, pulls) (:mod:`.variants`)


def _staircase(bm: _BlockModel, measure, deadline: Deadline, H_cap: int | None = None, below=None,
               cap: int | None = None, floor: int | None = None, solves: list | None = None,
               F_cap: int | None = None):
    """Block plans along the exact staircase of ``x -> least cost with measure <= x`` (and
    ``H <= H_cap``, ``F <= F_cap``, in the model's units): each solve minimises cost, then the
    measure; the first asks for ``measure <= cap`` (None: any), the next for a smaller measure: at
    most ``below(x)`` (model units; default ``x - 1``: every step of the staircase; None: stop). A solve whose
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
        if F_cap is not None:
            m.add(_clone_var(m, bm.held) <= F_cap)
        cost_var = _clone_var(m, bm.cost)
        cdom = cost_var.proto.domain
        one_objective = cdom[len(cdom) - 1] * (hi + 1) + hi < 2 ** 62
        # cost first, then the measure: in one objective where it fits CP-SAT's 64-bit integers, else
        # (a 70B block's W in 512-byte units) in two solves, the second at the first's cost
        m.minimize(cost_var * (hi + 1) + x_var if one_objective else cost_var)
        status, solver = _solve_small(m, left)
        if solves is not None:
            solves.append(1)
        if status == cp_model.INFEASIBLE:
            return options
        if status != cp_model.OPTIMAL:
            return None
        if not one_objective:
            m.add(cost_var == solver.value(cost_var))
            m.minimize(x_var)
            status, solver = _solve_small(m, deadline.left())
            if status != cp_model.OPTIMAL:
                return None
        cost, x = solver.value(cost_var), solver.value(x_var)
        if floor is not None and x <= floor:
            return options
        options.append(_MenuPoint(
            H=solver.value(_clone_var(m, bm.H)) * bm.unit, W=solver.value(_clone_var(m, bm.W)) * bm.unit,
            cost=cost, F=solver.value(_clone_var(m, bm.held)) * bm.unit,
            saved=frozenset(pos[v] for v, var in bm.s.items() if solver.value(_clone_var(m, var)))))
        if x == 0:
            return options
        cap = x - 1 if below is None else below(x)
        if cap is None:
            return options


def _solve_small(m: cp_model.CpModel, seconds: float):
    """A block model's solve on one worker: (status, solver)."""
    solver = new_solver()
    solver.parameters.num_workers = 1
    # small models: probing and the LP cost more than they save (the benchmark GPT-2's block: its
    # menu's 77 solves took 6.8 s so, 10.5 s with linearization level 1, 253 s with level 2)
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.linearization_level = 0
    solver.parameters.max_time_in_seconds = max(0.01, seconds)
    return run_solver(solver, m), solver


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


def _levels_and_w_min(bm: _BlockModel, bm_h: _BlockModel, granule: int, deadline: Deadline):
    """The staircase of cost over H at H's band edges, and the least W (None: not proven in time).

    After the staircase's first point (the cheapest plan's least H, the staircase's top), the rest
    runs on two threads (CP-SAT releases the GIL), in two halves either side of the band edge nearest
    half the top, and the least W after the first half done. The halves give the one staircase's
    points: the upper half stops at its first point at or below the middle edge, which is the least
    cost under that edge, the lower half's first point."""
    below = lambda x: _edge_below(x, bm.unit, granule)  # noqa: E731
    top = _staircase(bm_h, bm_h.H, deadline, below=lambda x: None)
    if top is None:  # not proven in time
        return None, None
    if not top:  # no plan (a block's variant may have none: :mod:`.variants`)
        return [], None
    x0 = top[0].H // bm.unit
    cap, mid = below(x0), below(x0 // 2 + 1)
    with ThreadPoolExecutor(max_workers=2) as pool:
        if cap is None:
            halves = []
        elif mid is None or mid >= cap:
            halves = [pool.submit(_staircase, bm_h, bm_h.H, deadline, below=below, cap=cap)]
        else:
            halves = [pool.submit(_staircase, bm_h, bm_h.H, deadline, below=below, cap=cap, floor=mid),
                      pool.submit(_staircase, bm_h, bm_h.H, deadline, below=below, cap=mid)]
        w_min = pool.submit(_least, bm, bm.W, deadline)
        parts = [h.result() for h in halves]
        w_min = w_min.result()
    if any(part is None for part in parts):
        return None, None
    return top + [o for part in parts for o in part], w_min


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
        self.levels, self.w_min = _levels_and_w_min(bm, bm_h, granule, deadline)
        self.empty = self.levels == []
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
            out.append(_MenuPoint(H=self._label(b), W=o.W, cost=o.cost, saved=o.saved, F=o.F))
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
