"""The lowest-peak search honours a policy's forced and forbidden saves even when CP-SAT returns
nothing in its time (its start plan is then the floor's), and the search below the floor keeps the
floor's own reruns where nothing else fits (it crashed with ``min() arg is an empty sequence``)."""
from __future__ import annotations

from ortools.sat.python import cp_model

from helpers import stack_graph
from remat_compiler.graph.blocks import block_boundary_set
from remat_compiler.solvers.cpsat import min_feasible_peak
from remat_compiler.solvers.cpsat.run import Job


def test_a_floor_found_without_cp_sat_keeps_the_policy(monkeypatch):
    cg = stack_graph()
    start = block_boundary_set(cg)  # what the search starts from: the policy forbids some, forces others
    forbidden = sorted(start)[:2]
    forced = [v for v in cg.candidates if v not in start][:2]
    real = Job.solve

    def nothing(self, model, seconds, **kw):  # CP-SAT returns no solution in its time
        status, solver = real(self, model, min(seconds, 1e-3), **kw)
        return cp_model.UNKNOWN, solver
    monkeypatch.setattr(Job, "solve", nothing)
    _peak, _proven, saved, _rerun = min_feasible_peak(cg, time_limit_s=1, forbidden_saved=forbidden,
                                                      forced_saved=forced, reruns=False)
    assert not set(saved) & set(forbidden)
    assert set(forced) <= set(saved)
