"""No process-wide state changes an answer: ``deterministic=True`` gives the same plan in a fresh
process and after other solves in this one; what earlier solves found is reused only through a
:class:`~remat_compiler.solvers.cpsat.SolveMemo` the caller owns."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import remat_compiler as rc
from helpers import stack_graph
from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak, solve_cpsat

ROOT = Path(__file__).resolve().parents[1]


def checkpoint_budget(cg) -> int:
    """Halfway between the smallest feasible budget (found deterministically) and the no-recompute
    peak: a budget where the plan must recompute, and has choices."""
    smallest, *_ = min_feasible_peak(cg, time_limit_s=1, deterministic=True, num_workers=2)
    return (smallest + rc.solve(cg, None, "save_all").peak_bytes) // 2


def deterministic_plan(cg) -> dict:
    """The deterministic plan at the checkpoint budget, as comparable data."""
    plan = rc.solve(cg, checkpoint_budget(cg), "cpsat", deterministic=True, time_limit_s=1, num_workers=2)
    return {"saved": sorted(plan.saved), "rerun": [list(r) for r in plan.rerun], "peak": plan.peak_bytes,
            "cost": plan.extras["cost_units"], "status": plan.status, "fingerprint": cg.fingerprint}


def test_deterministic_plan_is_the_same_in_a_fresh_process_and_after_other_solves():
    cg = stack_graph()
    first = deterministic_plan(cg)
    assert first["cost"] > 0  # the budget makes it recompute: there is a choice to make
    # other solves on the same graph in this process: budgets, the lowest-peak search, with a memo
    memo = SolveMemo()
    smallest, *_ = min_feasible_peak(cg, time_limit_s=1, memo=memo)
    for budget in (smallest, checkpoint_budget(cg)):
        rc.solve(cg, budget, "cpsat", time_limit_s=1, memo=memo)
    assert memo.plans[cg.fingerprint]  # the memo did keep what those solves found
    assert deterministic_plan(cg) == first
    code = ("import json; from tests.test_determinism import stack_graph, deterministic_plan; "
            "print(json.dumps(deterministic_plan(stack_graph())))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "tests")))}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == first


def test_deterministic_refuses_a_memo():
    cg = stack_graph()
    with pytest.raises(ValueError, match="no memo"):
        solve_cpsat(cg, None, deterministic=True, memo=SolveMemo())


def test_a_memo_seeds_only_the_solves_given_it():
    """Plans found on a graph reach a later solve only through the memo passed to both: a sweep's
    later budgets start from its earlier plans, a solve without the memo from nothing."""
    cg = stack_graph()
    memo = SolveMemo()
    low = rc.solve(cg, checkpoint_budget(cg), "cpsat", time_limit_s=3, memo=memo)
    assert (frozenset(low.saved), low.peak_bytes) in memo.plans[cg.fingerprint]
    assert frozenset(low.saved) in memo.fitting(cg, low.peak_bytes, lambda s: True)
    before = {k: list(v) for k, v in memo.plans.items()}
    rc.solve(cg, checkpoint_budget(cg), "cpsat", time_limit_s=3)
    assert memo.plans == before  # a solve without the memo leaves it alone
