"""remat_compiler: plan activation recomputation for PyTorch training under an absolute memory budget.

>>> import remat_compiler
>>> m = remat_compiler.compile(model, memory_budget="1.5GiB")      # doctest: +SKIP
>>> loss_fn(m(x), y).backward(); print(m.plan.explain())            # doctest: +SKIP
"""
from remat_compiler.api import CompiledModule, PlannedGraph, PlanSpec, analyze, compile, plan_joint, plan_model
from remat_compiler.budget import Budget, human_bytes, parse_budget
from remat_compiler.check import check_plan
from remat_compiler.graph import CostGraph
from remat_compiler.errors import (InfeasibleBudgetError, PlanCheckError, PlanMismatchError, RematError,
                                   UntraceableModelError)
from remat_compiler.memory import AllocatorPeak, LiveStorageTracker, ResidentPeak, measure_step_peak
from remat_compiler import policies
from remat_compiler.plan import Plan
from remat_compiler.solvers import SOLVERS, Strategy, solve
from remat_compiler.solvers.cpsat import SolveMemo
from remat_compiler.trace import trace

__all__ = [
    "compile", "CompiledModule", "plan_model", "plan_joint", "PlanSpec", "PlannedGraph", "analyze", "trace",
    "CostGraph", "Plan", "check_plan", "solve", "SOLVERS", "Strategy", "SolveMemo",
    "Budget", "parse_budget", "human_bytes", "LiveStorageTracker", "measure_step_peak",
    "AllocatorPeak", "ResidentPeak",
    "RematError", "InfeasibleBudgetError", "UntraceableModelError", "PlanMismatchError", "PlanCheckError",
    "policies",
]
__version__ = "0.1.0"
