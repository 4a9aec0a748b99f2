"""GPT-2 (transformers, small random config): gradients, measured peak and monotonicity by budget."""
from __future__ import annotations

import pytest

import remat_compiler as rc
from remat_compiler.examples.gpt2 import build
from helpers import assert_same, planned_step, run_step
from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak

pytest.importorskip("transformers")
TIME_LIMIT_S = 2


@pytest.fixture(scope="module")
def runs():
    model, inputs, loss_fn = build(n_layer=4, n_embd=128, n_head=4, vocab_size=512, batch=4, seq=128)
    # the caller holds the output (logits and all) through backward, as the plans assume
    eager_grads = run_step(model, lambda: model(**inputs), loss=loss_fn, hold_outputs=True).grads
    results = {}
    memo = SolveMemo()  # one per graph, as a sweep has: each budget starts from the plans before it

    def run(budget):
        compiled = rc.compile(model, memory_budget=budget, time_limit_s=TIME_LIMIT_S, memo=memo)
        got = planned_step(model, lambda: compiled(**inputs), loss=loss_fn, hold_outputs=True)  # the first traces
        results[budget] = (compiled.plan, got.peak, got.grads)
        return compiled.planned.cg

    cg = [run(budget) for budget in (1.0, 0.6, 0.4)][0]  # the step's graph (each compile traced it)
    # the smallest budget known to be feasible (CP-SAT's lowest-peak solve stops at its time limit;
    # it also knows the plans found at the larger budgets above)
    smallest, *_ = min_feasible_peak(cg, time_limit_s=TIME_LIMIT_S, memo=memo)
    run(smallest)
    return eager_grads, results, smallest


def test_gradients_match_eager_at_every_budget(runs):
    eager, results, _ = runs
    for budget, (plan, _peak, grads) in results.items():
        assert_same(grads, eager, budget, rtol=1e-5, atol=1e-6, none_ok=True)


def test_measured_peak_under_budget_and_equal_to_prediction(runs):
    _, results, _ = runs
    for budget, (plan, peak, _grads) in results.items():
        assert peak <= plan.budget_bytes, budget
        assert peak == plan.peak_bytes, (budget, peak, plan.peak_bytes)


def test_recomputation_is_used_and_reported(runs):
    _, results, smallest = runs
    assert results[1.0][0].recomputed == [] or results[1.0][0].recompute_flops == 0
    low = results[smallest][0]
    assert low.recompute_flops > 0 and low.status in ("optimal", "feasible") and 0 <= low.gap <= 1
    assert low.peak_bytes < 0.45 * low.baseline_peak_bytes


def test_monotone_smaller_budget_never_larger_measured_peak(runs):
    _, results, _ = runs
    by_budget = sorted((plan.budget_bytes, peak) for plan, peak, _ in results.values())
    peaks = [p for _, p in by_budget]
    assert peaks == sorted(peaks)
