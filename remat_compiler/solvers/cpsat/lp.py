"""A lower bound on a model's recompute cost from the LP relaxation of its linear part (GLOP)."""
from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

from remat_compiler.solvers.cpsat.model import RematModel

__all__ = ["lp_bound"]


def lp_bound(rm: RematModel, time_limit_s: float = 5.0) -> float | None:
    """A lower bound on the model's objective from the LP relaxation of its linear part (GLOP).

    The relaxation keeps the linear constraints without enforcement literals, the implications
    and clauses (as linear rows), and every variable's bounds; it drops the cumulative and the
    start-time constraints. Each real plan is a point of it, so its optimum bounds every plan from
    below. CP-SAT's own bound on these models is that LP's value when its search gets to it; on
    deep graphs (GPT-2 at 48 layers) its presolve and LP take the whole time limit, so the plan
    would carry no bound at all. None if GLOP does not prove its optimum in time.
    """
    proto = rm.model.proto
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    inf = lp.infinity()
    xs = [lp.NumVar(float(v.domain[0]), float(v.domain[len(v.domain) - 1]), "") for v in proto.variables]

    def row(lo: float, pairs) -> None:  # sum of coeff * literal >= lo, literals as CP-SAT indices
        const, coeffs = 0.0, {}
        for lit, co in pairs:
            if lit >= 0:
                coeffs[lit] = coeffs.get(lit, 0.0) + co
            else:  # a negated literal: 1 - x
                const += co
                coeffs[-lit - 1] = coeffs.get(-lit - 1, 0.0) - co
        ct = lp.RowConstraint(lo - const, inf, "")
        for i, co in coeffs.items():
            ct.SetCoefficient(xs[i], co)

    for c in proto.constraints:
        if c.has_linear() and not c.enforcement_literal:
            d = c.linear.domain
            lo, hi = d[0], d[len(d) - 1]
            ct = lp.RowConstraint(float(lo) if lo > -2 ** 62 else -inf,
                                  float(hi) if hi < 2 ** 62 else inf, "")
            for i, co in zip(c.linear.vars, c.linear.coeffs):
                ct.SetCoefficient(xs[i], float(co))
        elif c.has_bool_or():
            lits = list(c.bool_or.literals)
            for en in c.enforcement_literal or [None]:  # or(lits) when en holds: sum(lits) >= en
                enforced = [(en, -1.0)] if en is not None else []
                row(0.0 if en is not None else 1.0, [(x, 1.0) for x in lits] + enforced)
        elif c.has_bool_and() and c.enforcement_literal:
            for en in c.enforcement_literal:
                for x in c.bool_and.literals:
                    row(0.0, [(x, 1.0), (en, -1.0)])
    obj = lp.Objective()
    for i, co in zip(proto.objective.vars, proto.objective.coeffs):
        obj.SetCoefficient(xs[i], float(co))
    obj.SetMinimization()
    lp.SetTimeLimit(int(max(0.05, time_limit_s) * 1000))
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    scale = proto.objective.scaling_factor or 1.0
    value = (obj.Value() + proto.objective.offset) * scale
    return math.floor(value - 1e-6 * abs(value) - 1e-6)  # below GLOP's tolerance
