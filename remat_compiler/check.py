"""Two checks of a plan: its own consistency (:func:`check_plan`) and the emitted code's memory
(:func:`check_emitted`), which does not go through the simulator."""
from __future__ import annotations

import torch.fx as fx

from remat_compiler.graph import CostGraph
from remat_compiler.passes.allocator import allocator_named
from remat_compiler.emitted import EmittedPeak, emitted_peak
from remat_compiler.errors import PlanCheckError
from remat_compiler.plan import Plan
from remat_compiler.schedule import SimResult, build_schedule, simulate

__all__ = ["check_plan", "check_emitted"]


def check_plan(cg: CostGraph, plan: Plan) -> SimResult:
    """Check that a plan is consistent with its graph and its own numbers.

    The schedule is rebuilt from ``plan.saved`` and ``plan.rerun`` alone and compared with the plan's
    own schedule, then simulated with :func:`remat_compiler.schedule.simulate`: the simulated peak must
    equal ``plan.peak_bytes``, be at most the solver's own bound (``plan.model_peak_bytes``) and at most
    the budget, and the recompute cost must match. This catches a solver whose model disagrees with
    the simulator, a plan edited by hand or made for other options; it re-runs the simulator that
    :func:`remat_compiler.plan.make_plan` took ``peak_bytes`` from, so it cannot catch a simulator (or
    codegen) that is wrong: :func:`check_emitted` does, on the emitted code.

    Returns
    -------
    SimResult
        The simulation, for reports and timeline pictures.

    Raises
    ------
    PlanMismatchError
        If the plan was made for another graph.
    PlanCheckError
        If anything disagrees or the plan does not fit its budget.
    """
    plan.check_applies_to(cg)
    schedule = build_schedule(cg, plan.saved, plan.rerun)
    if schedule.to_json() != plan.schedule.to_json():
        raise PlanCheckError(f"{plan.solver}: the plan's schedule is not the one its saved set implies")
    sim = simulate(cg, schedule)
    problems = []
    if sim.peak_bytes != plan.peak_bytes:
        problems.append(f"simulated peak {sim.peak_bytes} != plan's predicted peak {plan.peak_bytes}")
    if sim.peak_bytes > plan.model_peak_bytes:
        problems.append(f"simulated peak {sim.peak_bytes} exceeds the solver's bound {plan.model_peak_bytes}")
    if plan.budget_bytes is not None and sim.peak_bytes > plan.budget_bytes:
        problems.append(f"simulated peak {sim.peak_bytes} exceeds the budget {plan.budget_bytes}")
    if sim.recompute_flops != plan.recompute_flops:
        problems.append(f"recompute FLOPs {sim.recompute_flops} != plan's {plan.recompute_flops}")
    if abs(sim.recompute_s - plan.recompute_s) > 1e-9 * max(1.0, plan.recompute_s):
        problems.append(f"recompute time {sim.recompute_s} != plan's {plan.recompute_s}")
    if problems:
        raise PlanCheckError(f"plan by {plan.solver} rejected: " + "; ".join(problems))
    return sim


def check_emitted(fw: fx.GraphModule, bw: fx.GraphModule, plan: Plan, cg: CostGraph,
                  peak_bytes: int | None = None) -> EmittedPeak:
    """Check that the emitted forward and backward peak exactly where the plan says (``peak_bytes``
    where given: a plan made on :func:`remat_compiler.fusion.inductor_view` peaks lower than its
    code run op by op, which writes every value, and is checked at that code's own simulated peak).

    The two GraphModules are walked in their emitted order with reference counts on their FakeTensor
    storages (:func:`remat_compiler.emitted.emitted_peak`); neither the schedule nor the simulator
    is consulted. From ``cg`` only graph-level facts are read: how many forward outputs are the
    user's, which are updated inputs, whether the caller holds its outputs, and the allocator that
    charges each storage (:mod:`remat_compiler.passes.allocator`).

    Parameters
    ----------
    fw, bw : fx.GraphModule
        What :func:`remat_compiler.codegen.emit` returned for ``plan``.
    plan : Plan
    cg : CostGraph
        The graph the plan was made for.

    Returns
    -------
    EmittedPeak

    Raises
    ------
    PlanCheckError
        If the emitted code's peak is not ``plan.peak_bytes``; the message names where the emitted
        code peaks (or first goes above the plan) and both figures.

    Example
    -------
    >>> fw, bw = emit(gm, plan); check_emitted(fw, bw, plan, cg).peak_bytes   # doctest: +SKIP
    """
    walked = emitted_peak(fw, bw, num_fwd_outputs=len(cg.fw_outputs),
                          input_updates=cg.g.graph.get("input_updates", ()), hold_outputs=cg.hold_outputs,
                          allocator=allocator_named(cg.allocator))
    expected = plan.peak_bytes if peak_bytes is None else peak_bytes
    if walked.peak_bytes == expected:
        return walked
    if walked.peak_bytes > expected:
        node, live = walked.first_above(expected)
        where = (f"first above the plan at {node} ({live} bytes live), and peaks at {walked.peak_node} "
                 f"({walked.peak_bytes} bytes)")
    else:
        where = f"peaks at {walked.peak_node} ({walked.peak_bytes} bytes)"
    raise PlanCheckError(f"plan by {plan.solver}: the emitted code {where}; the plan predicts "
                         f"{expected} bytes")
