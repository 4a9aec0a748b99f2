"""check_plan: re-derive a plan's schedule, simulate it independently, and reject what does not fit."""
from __future__ import annotations

from remat_compiler.graph import CostGraph
from remat_compiler.errors import PlanCheckError
from remat_compiler.plan import Plan
from remat_compiler.schedule import SimResult, build_schedule, simulate

__all__ = ["check_plan"]


def check_plan(cg: CostGraph, plan: Plan) -> SimResult:
    """Check a plan against its graph with a liveness simulation that knows nothing of the solver.

    The schedule is rebuilt from ``plan.saved`` and ``plan.rerun`` alone, compared with the plan's own
    schedule, and simulated; the simulated peak must equal ``plan.peak_bytes``, be at most the solver's own bound
    (``plan.model_peak_bytes``) and at most the budget, and the recompute cost must match.

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
