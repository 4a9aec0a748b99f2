"""What a recomputation costs: the objectives' integer units, and the proven gap on counted FLOPs."""
from __future__ import annotations

import math

from remat_compiler.graph import CostGraph
from remat_compiler.plan import Plan

__all__ = ["OBJECTIVES", "cost_units", "plan_cost_units", "step_cost_units", "tolerance_units", "check_tolerance",
           "flop_gap", "flops_status"]

OBJECTIVES = ("runtime", "flops")


def cost_units(cg: CostGraph, n: str, objective: str = "runtime") -> int:
    """Integer recompute cost of a node under an objective.

    ``"runtime"``: its roofline runtime estimate in ns (communication included), at least 1 for a
    real op. ``"flops"``: its counted FLOPs in kFLOP plus 1 for any real op, so that FLOPs decide and
    among plans of equal FLOPs (memory-bound ops count none) the one recomputing fewer ops wins.
    """
    rt = cg.attr(n, "runtime_s")
    if rt <= 0:
        return 0
    if objective == "runtime":
        return max(1, math.ceil(rt * 1e9))
    if objective == "flops":
        return cg.attr(n, "flops") // 1000 + 1
    raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")


def step_cost_units(cg: CostGraph, objective: str = "runtime") -> int:
    """The whole step's cost in the objective's units: every op of forward and backward run once
    (what a ``tolerance`` is a fraction of)."""
    return sum(cost_units(cg, n, objective) for n in cg.order)


def tolerance_units(cg: CostGraph, objective: str, tolerance: float) -> int:
    """The absolute gap a ``tolerance`` allows a cost search, in the objective's units (before a
    model divides its costs by their gcd): that fraction of :func:`step_cost_units`."""
    return int(tolerance * step_cost_units(cg, objective)) if tolerance > 0 else 0


def check_tolerance(tolerance) -> float:
    """``tolerance`` as a float in [0, 1), or ValueError saying what it is."""
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r}: expected a fraction of the step's estimated cost in [0, 1) "
                         f"(0 proves the plan optimal; 0.01 stops within 1% of the step of the best plan)")
    return float(tolerance)


def flop_gap(cg: CostGraph, recomputed, bound_units: float) -> float:
    """The proven relative gap on counted FLOPs alone of a plan found under ``objective="flops"``.

    That objective counts kFLOPs plus 1 per recomputed op (the tie-break), so CP-SAT's bound on it,
    less the number of ops any plan could recompute, bounds the kFLOPs of every plan from below. A
    plan that recomputes no counted FLOPs is FLOP-optimal whatever the bound.
    """
    flops = sum(cg.attr(n, "flops") // 1000 for n in set(recomputed) if cg.attr(n, "runtime_s") > 0)
    if flops == 0:
        return 0.0
    ops = sum(1 for v in cg.fw_order if not cg.is_available_in_bw(v) and cg.attr(v, "runtime_s") > 0
              and not cg.attr(v, "never_recompute"))
    return max(0.0, (flops - max(0.0, bound_units - ops)) / flops)


def plan_cost_units(cg: CostGraph, plan: Plan, objective: str = "runtime") -> int:
    """The objective value of a plan: the summed integer cost of what it recomputes."""
    return sum(cost_units(cg, n, objective) for n in plan.recomputed)


def flops_status(cg: CostGraph, recomputed, status: str, gap: float, bound_units: float
                 ) -> tuple[str, float, dict]:
    """Under ``objective="flops"``, a plan's status and gap as those of counted FLOPs alone, and the
    extras that keep the rest.

    The solver minimises kFLOPs plus 1 per recomputed op; the per-op term only breaks ties between
    plans of equal FLOPs (a secondary criterion). So a plan is "optimal" when no fitting plan
    recomputes fewer FLOPs (:func:`flop_gap` is 0), and its gap is the FLOP gap; the gap on the
    whole objective, tie-break included, stays in ``extras["tiebreak_gap"]``.
    """
    fg = flop_gap(cg, recomputed, bound_units)
    optimal = status == "optimal"
    return ("optimal" if fg == 0.0 or optimal else "feasible", 0.0 if optimal else fg,
            {"flop_gap": fg, "tiebreak_gap": gap})
