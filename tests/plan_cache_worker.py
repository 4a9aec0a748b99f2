"""Plans the test's MLP with a plan cache in a fresh process; prints one JSON line about the plan.

``python tests/plan_cache_worker.py DIR [compile | both]``: ``plan_model`` by default, ``compile`` runs one
training step of the compiled module instead, ``both`` does the two in turn (one line each). With ``REMAT_TEST_NO_SOLVE=1`` the CP-SAT solver raises
if it is called, so a run that succeeds took its plan from the cache.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import remat_compiler as rc  # noqa: E402
from remat_compiler.examples.models import MLPChain  # noqa: E402


def model_and_input():
    torch.manual_seed(0)
    return MLPChain(32, 4), torch.randn(64, 32)


def build():
    """The same model and input as a CLI factory."""
    model, x = model_and_input()
    return model, (x,), lambda out: out.sum()


def main(directory: str, how: str = "plan_model") -> None:
    torch.set_num_threads(1)
    if os.environ.get("REMAT_TEST_NO_SOLVE"):
        import remat_compiler.solvers.cpsat as cpsat

        def refuse(*_a, **_k):
            raise AssertionError("the solver ran: the plan was not taken from the cache")
        cpsat.seed = cpsat.formulate = refuse  # solve_cpsat's first steps
    for step in (("plan_model", "compile") if how == "both" else (how,)):
        model, x = model_and_input()
        if step == "compile":
            m = rc.compile(model, 0.6, plan_cache=directory, time_limit_s=10, num_workers=2)
            m(x).sum().backward()
            planned = m.planned
        else:
            planned = rc.plan_model(model, (x,), {}, 0.6, plan_cache=directory, time_limit_s=10, num_workers=2)
        print(json.dumps({"how": step, "source": planned.source, "digest": planned.plan.digest(),
                          "solve_time_s": planned.plan.solve_time_s, "saved": planned.plan.saved}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
