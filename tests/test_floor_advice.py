"""The budget an infeasible-budget error names is accepted by the next call (issue 33 item 8).

A time-limited search may find a low-peak plan that the next search does not find again; on a loaded
machine 16 of 1,947 random models were refused again at the budget their first error named. The
error now carries its plan (``exc.plan``) and its message says to apply it with ``plan=``: following
the message always works. Checked on random models of the project's fuzzer (seeds no other test
uses), at a tight time limit (the suite's other worker loads the machine; the seeds were also run beside
a busy process).
"""
from __future__ import annotations

import copy

import pytest

import remat_compiler as rc
from helpers import run_step
from benchmarks.fuzz import random_model

SEEDS = range(7000, 7003)
LIMIT_S = 0.3


def _step_peak(m, x) -> int:
    return run_step(m, lambda: m(x), loss=lambda out: out[0] if isinstance(out, tuple) else out,
                    hold_outputs=True, measure=True).peak


@pytest.mark.parametrize("seed", SEEDS)
def test_the_budget_an_error_names_is_accepted_next_time(seed):
    case = random_model(seed)  # programs eager runs (checked when the seeds were chosen)
    with pytest.raises(rc.InfeasibleBudgetError) as err:
        rc.compile(copy.deepcopy(case.model), memory_budget=1, time_limit_s=LIMIT_S)(case.x)
    named = err.value.min_feasible_bytes
    plan = err.value.plan
    assert plan is not None and plan.peak_bytes == named
    assert f"pass memory_budget={named}, plan=exc.plan" in str(err.value)
    # as the message says: the budget named with the error's plan (no search to lose it again)
    m = rc.compile(copy.deepcopy(case.model), memory_budget=named, plan=plan)
    assert _step_peak(m, case.x) == named == m.plan.peak_bytes
