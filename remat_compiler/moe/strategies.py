"""The hand-picked MoE recompute strategies as solvers: ``moe_origin``, ``moe_fast``, ``moe_custom``.

Each one fixes a saved set by a rule over the MoE segments that :mod:`passes.moe` tagged
(``cost_graph.g.nodes[n]["moe"]``) and goes through :func:`~remat_compiler.solvers.basic.fixed_plan`,
so it is simulated, checked and emitted like any other plan. Outside the MoE segments every strategy
saves what backward reads there (as :func:`~remat_compiler.schedule.save_all_set` does); inside:

==============  ===================================================================================
``moe_origin``  the segment's input, the routing probabilities and expert indices (and values that
                must never be recomputed); everything else is recomputed in backward when needed,
                both all-to-alls and both GEMMs included (Megatron ``--recompute-modules moe``)
``moe_fast``    everything backward reads except the activation's outputs (SwiGLU), which are
                recomputed from GEMM1's saved output: no GEMM, no communication again
                (Megatron ``moe_act``)
``moe_custom``  ``moe_fast`` over the graph traced with the fused GEMM2 -> A2A -> Unpermute
                (``MoELayer(combine="fused")``), whose backward never needs the expert output y:
                ``solve_moe_custom.prepare_model`` switches every MoELayer to ``combine="fused"``
                while the step is traced
``moe_cpsat``   CP-SAT (``solve_cpsat``, same options) over the fused-combine graph
==============  ===================================================================================

The default ``solver="cpsat"`` plans the graph as the model is (``combine="autograd"`` unless the
user set ``"fused"``); ``moe_cpsat`` offers CP-SAT the fused custom backward.

Example
-------
>>> compiled = remat_compiler.compile(model, solver="moe_custom")   # doctest: +SKIP
>>> compiled(x).backward(g); print(compiled.plan.explain())          # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from remat_compiler.costgraph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.schedule import save_all_set
from remat_compiler.solvers import register_solver
from remat_compiler.solvers.basic import fixed_plan
from remat_compiler.solvers.cpsat import solve_cpsat

from .layer import MoELayer

__all__ = ["moe_segments", "segment_inputs", "origin_saved_set", "fast_saved_set", "fused_combine_mode",
           "solve_moe_origin", "solve_moe_fast", "solve_moe_custom", "solve_moe_cpsat"]


def moe_segments(cg: CostGraph) -> dict[str, dict[str, list[str]]]:
    """The forward nodes of each tagged MoE segment, by role: ``{segment: {role: [names]}}``.

    Names are in forward order; segments are keyed by module path (see :mod:`passes.moe`).
    """
    segments: dict[str, dict[str, list[str]]] = {}
    for n in cg.fw_order:
        tag = cg.attr(n, "moe")
        if tag:
            segments.setdefault(tag["segment"], defaultdict(list))[tag["role"]].append(n)
    return {seg: dict(roles) for seg, roles in segments.items()}


def _members(roles: dict[str, list[str]]) -> set[str]:
    return {n for names in roles.values() for n in names}


def segment_inputs(cg: CostGraph, roles: dict[str, list[str]]) -> list[str]:
    """Candidates produced outside a segment that its forward nodes read (storage owners).

    Parameters
    ----------
    cg : CostGraph
    roles : dict
        One segment of :func:`moe_segments`.
    """
    inside = _members(roles)
    cands = set(cg.candidates)
    found = []
    for n in sorted(inside, key=lambda x: cg.attr(x, "order")):
        for p in cg.preds(n):
            owner = cg.storage(p)
            if p not in inside and owner in cands and owner not in inside and owner not in found:
                found.append(owner)
    return found


def _segments_or_raise(cg: CostGraph, name: str) -> dict[str, dict[str, list[str]]]:
    segments = moe_segments(cg)
    if not segments:
        raise ValueError(f"{name} needs an MoE block in the model (remat_compiler.moe.MoELayer or "
                         f"transformers' MixtralSparseMoeBlock); none was found in the traced graph. "
                         f"Use solver='cpsat' for other models")
    return segments


def _outside_and_pinned(cg: CostGraph, segments) -> tuple[list[str], list[str]]:
    """Save-all candidates outside every segment; segment candidates that must not be recomputed."""
    inside = set().union(*(_members(r) for r in segments.values()))
    outside = [n for n in save_all_set(cg) if n not in inside]
    pinned = [n for n in cg.candidates if n in inside and cg.attr(n, "never_recompute")]
    return outside, pinned


def _owners(cg: CostGraph, names) -> list[str]:
    cands = set(cg.candidates)
    return [cg.storage(n) for n in names if cg.storage(n) in cands]


def origin_saved_set(cg: CostGraph) -> list[str]:
    """Saved set of ``moe_origin``: each segment's input, probs and expert indices, nothing else inside.

    Raises
    ------
    ValueError
        If the graph has no MoE segment.
    """
    segments = _segments_or_raise(cg, "moe_origin")
    saved, pinned = _outside_and_pinned(cg, segments)
    saved += pinned
    for roles in segments.values():
        saved += segment_inputs(cg, roles)
        saved += _owners(cg, roles.get("probs", []) + roles.get("routing", []))
    return list(dict.fromkeys(saved))


def fast_saved_set(cg: CostGraph, *, name: str = "moe_fast") -> list[str]:
    """Saved set of ``moe_fast``: what backward reads, minus the activation's outputs (plus GEMM1's).

    Raises
    ------
    ValueError
        If the graph has no MoE segment, or a segment's expert GEMMs were not recognised.
    """
    segments = _segments_or_raise(cg, name)
    act = set()
    keep = []
    for seg, roles in segments.items():
        if not roles.get("act") or not roles.get("gemm1"):
            raise ValueError(f"{name}: MoE segment {seg!r} has no recognised GEMM1 / activation "
                             f"(its experts module needs exactly two expert GEMMs); use solver='cpsat'")
        act.update(roles["act"])
        keep += _owners(cg, roles["gemm1"])
    pinned = [n for n in act if cg.attr(n, "never_recompute")]
    saved = [n for n in save_all_set(cg) if n not in act] + keep + pinned
    return list(dict.fromkeys(saved))


def solve_moe_origin(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """Checkpoint each whole MoE segment: save its input and routing, recompute the rest.

    Parameters
    ----------
    cg : CostGraph
        A graph with MoE segments tagged by :mod:`passes.moe`.
    budget_bytes : int | None
        Checked, not optimised for.

    Returns
    -------
    Plan

    Raises
    ------
    ValueError
        If the graph has no MoE segment.
    StrategyOverBudgetError
        If the plan's peak is above ``budget_bytes`` (it names the strategy's own peak).
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, origin_saved_set(cg), budget_bytes, "moe_origin", t0)


def solve_moe_fast(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """Recompute only the activation (SwiGLU) of each MoE segment, from GEMM1's saved output.

    Parameters, returns and raises as :func:`solve_moe_origin`.
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, fast_saved_set(cg), budget_bytes, "moe_fast", t0)


def _require_fused(cg: CostGraph, name: str) -> None:
    segments = _segments_or_raise(cg, name)
    for seg, roles in segments.items():
        if not any(cg.attr(n, "moe")["fused"] for n in _members(roles)):
            raise ValueError(
                f"{name}: MoE segment {seg!r} was not traced with the fused combine (only "
                f"remat_compiler.moe.MoELayer has one, and compile(..., solver={name!r}) traces every "
                f"MoELayer with combine='fused'); use solver='moe_fast' or 'cpsat' for this model")


def solve_moe_custom(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """``moe_fast`` over the fused GEMM2 -> A2A -> Unpermute: the expert output y is never saved.

    ``solve_moe_custom.prepare_model`` (:func:`fused_combine_mode`) makes :func:`remat_compiler.compile`
    and :func:`remat_compiler.plan_model` trace every MoELayer with ``combine="fused"``.

    Parameters, returns and raises as :func:`solve_moe_origin`; also raises ValueError if a segment
    was traced without the fused combine.
    """
    t0 = time.perf_counter()
    _require_fused(cg, "moe_custom")
    return fixed_plan(cg, fast_saved_set(cg, name="moe_custom"), budget_bytes, "moe_custom", t0)


def solve_moe_cpsat(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """CP-SAT over the graph traced with the fused combine (options as ``solve_cpsat``).

    Raises
    ------
    ValueError
        If a segment was traced without the fused combine.
    InfeasibleBudgetError
        As ``solve_cpsat``.
    """
    _require_fused(cg, "moe_cpsat")
    plan = solve_cpsat(cg, budget_bytes, **opts)
    plan.solver = "moe_cpsat"
    return plan


@contextlib.contextmanager
def fused_combine_mode(model: torch.nn.Module):
    """Set ``combine_mode = "fused"`` on every :class:`MoELayer` of ``model``; restore it on exit.

    Example
    -------
    >>> with fused_combine_mode(model):       # doctest: +SKIP
    ...     gm, cg = remat_compiler.analyze(model, (x,))
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    before = [m.combine_mode for m in layers]
    try:
        for m in layers:
            m.combine_mode = "fused"
        yield model
    finally:
        for m, mode in zip(layers, before):
            m.combine_mode = mode


solve_moe_custom.prepare_model = fused_combine_mode
solve_moe_cpsat.prepare_model = fused_combine_mode

register_solver("moe_origin", solve_moe_origin)
register_solver("moe_fast", solve_moe_fast)
register_solver("moe_custom", solve_moe_custom)
register_solver("moe_cpsat", solve_moe_cpsat)
