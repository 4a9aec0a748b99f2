"""The hand-picked MoE recompute strategies as solvers: ``moe_origin``, ``moe_fast``, ``moe_custom``.

Each one fixes a saved set by a rule over the MoE segments that :mod:`remat_compiler.passes.moe` tagged
(``cost_graph.g.nodes[n]["moe"]``) and goes through :func:`~remat_compiler.solvers.baselines.fixed_plan`,
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
                its registry entry's ``prepare`` (:func:`~remat_compiler.moe.layer.fused_combine_mode`)
                switches every MoELayer to ``combine="fused"`` while the step is traced, and every
                transformers MoE block whose experts follow the pattern to the fused down
                projection + combine (:mod:`remat_compiler.moe.hf`)
``moe_cpsat``   CP-SAT (``solve_cpsat``, same options) over the fused-combine graph
==============  ===================================================================================

``moe_cpsat`` offers CP-SAT the fused custom backward everywhere; the default ``solver="cpsat"``
chooses between the two combines per segment in its one solve where every MoELayer keeps
``combine="autograd"``, for MoELayers and for transformers MoE blocks whose experts can run the
fused combine alike (:func:`remat_compiler.combines.chooses_combines`,
:mod:`remat_compiler.solvers.cpsat.choice`), and otherwise plans the graph as the model is.

Example
-------
>>> compiled = remat_compiler.compile(model, solver="moe_custom")   # doctest: +SKIP
>>> compiled(x).backward(g); print(compiled.plan.explain())          # doctest: +SKIP
"""
from __future__ import annotations

import time
from collections import defaultdict

from remat_compiler.errors import StrategyNotApplicableError
from remat_compiler.graph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.schedule import peak_of, rerunnable, save_all_set
from remat_compiler.solvers.baselines import fixed_plan
from remat_compiler.solvers.cpsat import solve_cpsat

__all__ = ["moe_segments", "segment_inputs", "origin_saved_set", "fast_saved_set",
           "act_reruns", "solve_moe_origin", "solve_moe_fast", "solve_moe_custom", "solve_moe_cpsat"]


def moe_segments(cg: CostGraph) -> dict[str, dict[str, list[str]]]:
    """The forward nodes of each tagged MoE segment, by role: ``{segment: {role: [names]}}``.

    Names are in forward order; segments are keyed by module path (see :mod:`remat_compiler.passes.moe`).
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
        raise StrategyNotApplicableError(
            f"{name} needs an MoE block in the model (remat_compiler.moe.MoELayer, or a transformers MoE "
            f"block that passes.moe.MOE_BLOCKS names: Mixtral's, OLMoE's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V3's); "
            f"none was found in the traced graph. Use solver='cpsat' for other models")
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
    StrategyNotApplicableError
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
    StrategyNotApplicableError
        If the graph has no MoE segment, or a segment's expert GEMMs were not recognised.
    """
    segments = _segments_or_raise(cg, name)
    act = set()
    keep = []
    for seg, roles in segments.items():
        if not roles.get("act") or not roles.get("gemm1"):
            raise StrategyNotApplicableError(
                f"{name}: MoE segment {seg!r} has no recognised GEMM1 / activation (its experts module "
                f"needs exactly two expert GEMMs); use solver='cpsat'")
        act.update(roles["act"])
        keep += _owners(cg, roles["gemm1"])
    pinned = [n for n in act if cg.attr(n, "never_recompute")]
    saved = [n for n in save_all_set(cg) if n not in act] + keep + pinned
    return list(dict.fromkeys(saved))


def solve_moe_origin(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """Checkpoint each whole MoE segment: save its input and routing, recompute the rest.

    Parameters
    ----------
    cg : CostGraph
        A graph with MoE segments tagged by :mod:`remat_compiler.passes.moe`.
    budget_bytes : int | None
        Checked, not optimised for.

    Returns
    -------
    Plan

    Raises
    ------
    StrategyNotApplicableError
        If the graph has no MoE segment.
    StrategyOverBudgetError
        If the plan's peak is above ``budget_bytes`` (it names the strategy's own peak).
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, origin_saved_set(cg), budget_bytes, "moe_origin", t0)


def solve_moe_fast(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """Recompute only the activation (SwiGLU) of each MoE segment, from GEMM1's saved output.

    Parameters, returns and raises as :func:`solve_moe_origin`.
    """
    t0 = time.perf_counter()
    return fixed_plan(cg, fast_saved_set(cg), budget_bytes, "moe_fast", t0)


def _require_fused(cg: CostGraph, name: str) -> None:
    segments = _segments_or_raise(cg, name)
    for seg, roles in segments.items():
        if not any(cg.attr(n, "moe")["fused"] for n in _members(roles)):
            raise StrategyNotApplicableError(
                f"{name}: MoE segment {seg!r} was not traced with the fused combine (compile(..., "
                f"solver={name!r}) traces every remat_compiler.moe.MoELayer with combine='fused', and "
                f"a transformers MoE block with it where its experts run transformers' default "
                f"experts_implementation='grouped_mm' with gated, bias-free, untransposed weights in "
                f"one dtype: remat_compiler.moe.hf.why_not_fusable(block.experts) says why one does "
                f"not); use solver='moe_fast' or 'cpsat' for this model")


def solve_moe_custom(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """``moe_fast`` over the fused GEMM2 -> A2A -> Unpermute: the expert output y is never saved.

    Its registry entry's ``prepare`` (:func:`remat_compiler.moe.layer.fused_combine_mode`) makes
    :func:`remat_compiler.compile` and :func:`remat_compiler.plan_model` trace every MoELayer with
    ``combine="fused"``.

    Parameters, returns and raises as :func:`solve_moe_origin`; also raises StrategyNotApplicableError if a segment
    was traced without the fused combine.
    """
    t0 = time.perf_counter()
    _require_fused(cg, "moe_custom")
    saved = fast_saved_set(cg, name="moe_custom")
    rerun = act_reruns(cg)
    if rerun and peak_of(cg, saved, rerun) >= peak_of(cg, saved):
        rerun = []  # the reruns are kept only where they lower the peak
    return fixed_plan(cg, saved, budget_bytes, "moe_custom", t0, rerun=rerun)


def act_reruns(cg: CostGraph) -> list[tuple[str, int]]:
    """Reruns that drop each recomputed activation value between the fused combine's backward and the
    activation's own backward: ``(v, j)`` with ``j`` the first activation-role backward step reading ``v``.

    The fused backward reads the SwiGLU output ``a`` in its one op for both GEMMs
    (:func:`~remat_compiler.moe.combine.combine_dgrad`: ``dW2 = (p a)^T G``, ``d(probs) = <G W2^T, a>``),
    so ``a``, ``G`` and the op's outputs are live at once; without reruns the recomputed
    ``silu(gate)`` (read again only by the SwiGLU backward) is held across that moment too.
    Recomputing it a second time costs a pointwise op and no counted FLOPs.
    """
    index = cg.bw_index
    reruns = []
    for roles in moe_segments(cg).values():
        for v in roles.get("act", []):
            if not rerunnable(cg, v):
                continue
            steps = sorted(index[u] for u in cg.g.successors(v)
                           if u in index and (cg.attr(u, "moe") or {}).get("role") == "act")
            if steps:
                reruns.append((v, steps[0]))
    return reruns


def solve_moe_cpsat(cg: CostGraph, budget_bytes: int | None, **opts) -> Plan:
    """CP-SAT over the graph traced with the fused combine (options as ``solve_cpsat``).

    Raises
    ------
    StrategyNotApplicableError
        If a segment was traced without the fused combine.
    InfeasibleBudgetError
        As ``solve_cpsat``.
    """
    _require_fused(cg, "moe_cpsat")
    return solve_cpsat(cg, budget_bytes, solver_name="moe_cpsat", **opts)
