"""The head's own menu: what the values outside the blocks (and the last block's values no backward
step of it reads) hold at the head's forward peak, against what they must recompute.

The decomposition counts what lies outside the blocks as free, beyond the memory every plan has
(:func:`.layout._fixed_intervals`). At the head's forward peak ``t`` (the largest fixed load after the
blocks' forward, where the dynamic programme charges ``head + sum_j H_j``) a plan also holds the
values it keeps there for backward: on a bfloat16 Mistral-7B stack the embedding's output, the
attention mask, the rotary tables and the final norm's copies, 407 MB at seq 8192 that the bound
took as free to drop. Dropping one is not free: its recomputation needs its inputs, held at ``t``
or recomputed in turn, and the chain may reach into the last block (the norm's float32 copy needs
the last block's output, whose recomputation needs its MLP's matmul).

:func:`head_menu` bounds that trade where boundaries are pulled (module docstring of
:mod:`..blockbound`, 4: ``H_j`` is the bytes block ``j`` saves that its backward, recomputations
included, reads). For a plan, let ``X`` be the values *of the tail*: candidates outside the blocks
allocated by ``t`` and last read by the forward before it, and candidates of the last block that are
not ancestors within it of a value its backward reads (nor such values). At ``t`` the plan holds the
bytes of those of ``X`` it keeps past ``t``: none of them is counted in ``head`` (the forward is done
with them, backward has not begun) nor in any ``H_j`` (no block plan reads them in backward: the last
block's would only through an ancestor of what its backward reads). And it recomputes every one of
``X`` that backward reads and it does not keep, with, in turn, each input of a recomputed one that it
does not keep and that is in ``X``; no block plan recomputes any of them, so their cost is beyond the
block plans'. Everything else is taken as available for free (a relaxation): values of the other
blocks and the rest of the last block's, what is not a candidate, and values the forward still reads
at ``t``. So the least cost of ``X``'s recomputation with at most ``x`` bytes kept at ``t``, ``T(x)``,
is at most what the plan pays beyond its block plans where it keeps ``x``, and its blocks fit
``head + x + sum_j H_j`` within the budget. The menu is the staircase of ``T``: points ``(x_k, T_k)``,
each ``x_k`` the least bytes kept at cost ``T_k`` (or a lower bound on them), the last at ``x = 0``
(or, where no assignment keeps less, at the least ``x`` any keeps), so that a plan keeping ``x`` is
charged, by the point with the largest ``x_k <= x``, at most what it pays. Without pulled boundaries
a block's ``H`` may count every byte its plan saves, a tail value of the last block among them, and
the menu is left out.
"""
from __future__ import annotations

import networkx as nx
from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph
from remat_compiler.solvers.cpsat.blockbound.layout import _Layout, _Profile
from remat_compiler.solvers.cpsat.parts import alloc_index, storage_readers
from remat_compiler.solvers.cpsat.run import make_solver, run_solver

__all__ = ["head_menu", "MAX_POINTS"]

MAX_POINTS = 32  # staircase points solved at most (the last point, x = 0, is added whatever is left)


def head_menu(cg: CostGraph, lay: _Layout, fixed, cost_of, deadline: Deadline
              ) -> tuple[list[tuple[int, int, frozenset | None]], frozenset]:
    """The staircase ``[(x_k, T_k, kept)]`` of the module docstring, by decreasing ``x``, with the tail
    values a solution at the point keeps (None where none is known); ``[(0, 0, None)]`` (the bound as
    without it) where boundaries are not pulled, or the tail has nothing backward reads; and the
    tail's values."""
    times = range(cg.fw_index[lay.nodes[-1][-1]] + 1, lay.F)
    if lay.pull is None or not times:
        # without pulled boundaries a block holds min(F, D), F every byte its plan saves: a value of
        # the last block kept for the tail's sake would be counted twice
        return [(0, 0, None)], frozenset()
    t = max(times, key=_Profile(fixed))
    cands = set(cg.candidates)
    blocks = set(lay.blocks)
    last = set(lay.nodes[-1])
    fw_last = storage_readers(cg)[1]
    bw_read = {v for v in cands if lay.read_in_backward(v)}
    # the last block's values its own plan may recompute or read in backward: ancestors within it of
    # what its backward reads (their cost is the block plan's, their bytes may be its H)
    within = cg.g.subgraph(last)
    planned = {u for v in last & bw_read for u in (v, *nx.ancestors(within, v))}

    def kept_past(v: str) -> bool:  # allocated by t, the forward done with it before t
        return alloc_index(cg, v) <= t and fw_last.get(cg.storage(v) or v, 0) < t

    tail = set()
    for v in cands:
        if cg.is_available_in_bw(v) or not kept_past(v):
            continue
        block = cg.attr(v, "block")
        if block not in blocks or (v in last and v not in planned):
            tail.add(v)
    needed = {v for v in tail if v in bw_read}
    if not needed:
        return [(0, 0, None)], frozenset()
    charge = {v: int(cost_of(v)) for v in tail}

    m = cp_model.CpModel()
    keep = {v: m.new_bool_var(f"k{i}") for i, v in enumerate(sorted(tail))}
    redo = {v: m.new_bool_var(f"r{i}") for i, v in enumerate(sorted(tail))}
    for v in tail:
        if cg.attr(v, "never_recompute"):
            m.add(redo[v] == 0)
        if v in needed:
            m.add_bool_or([keep[v], redo[v]])
        for u in _inputs(cg, v, tail):
            m.add_bool_or([redo[v].Not(), keep[u], redo[u]])
    # bytes kept at t, by storage: a view kept keeps its storage
    owners: dict[str, list[str]] = {}
    for v in tail:
        owners.setdefault(cg.storage(v) or v, []).append(v)
    held = []
    for owner, views in owners.items():
        size = int(cg.attr(owner, "bytes"))
        if size <= 0:
            continue
        z = m.new_bool_var(f"z{owner}")
        for v in views:
            m.add_implication(keep[v], z)
        held.append((z, size))
    kept = sum(size * z for z, size in held)
    cost = sum(c * redo[v] for v, c in charge.items() if c)

    points: list[tuple[int, int, frozenset | None]] = []
    cap = None
    for _ in range(MAX_POINTS):
        if deadline.left() <= 0:
            break
        found = _least(m, cost, kept, cap, deadline)
        if found is None:  # nothing keeps at most ``cap``: no plan keeps less
            return (points or [(0, 0, None)]), frozenset(tail)
        t_k, proven, _ = found
        if not proven:
            return points + [(0, t_k, None)], frozenset(tail)
        found = _least(m, kept, cost, t_k, deadline)
        if found is None:
            break
        x_k, _, solver = found  # a lower bound where not proven: a smaller x only weakens the charge
        what = None if solver is None else frozenset(v for v in tail if solver.value(keep[v]))
        points.append((x_k, t_k, what))
        if x_k <= 0:
            return points, frozenset(tail)
        cap = x_k - 1
    return points + [(0, points[-1][1] if points else 0, None)], frozenset(tail)


def _inputs(cg: CostGraph, v: str, tail: set[str]) -> set[str]:
    """The values of the tail that ``v``'s recomputation reads: its inputs, a view (not a candidate)
    standing for the value that owns its storage (the last block's output reads its MLP's matmul
    through a view)."""
    found = set()
    for u in cg.preds(v):
        owner = u if u in tail else cg.storage(u)
        if owner in tail:
            found.add(owner)
    return found


def _least(m: cp_model.CpModel, objective, other, cap, deadline: Deadline):
    """Minimise ``objective`` with ``other <= cap`` (no cap: None): (a lower bound on the least value,
    whether it is proven, the solver where it holds a solution), or None where nothing meets the cap."""
    model = m.clone()
    if cap is not None:
        model.add(other <= cap)
    model.minimize(objective)
    solver = make_solver(max(0.05, min(2.0, deadline.left())), 1, False, 0)
    status = run_solver(solver, model, None, deadline)
    if status == cp_model.INFEASIBLE:
        return None
    solution = solver if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if status == cp_model.OPTIMAL:
        return int(round(solver.objective_value)), True, solution
    return max(0, int(solver.best_objective_bound)), False, solution
