"""Reruns (a value recomputed more than once) and backward from the loss alone (hold_outputs=False)."""
from __future__ import annotations

import pytest
import torch

import remat_compiler as rc
from remat_compiler.examples.gpt2 import build
from helpers import assert_same, planned_step, run_step
from remat_compiler.errors import PlanCheckError
from remat_compiler.plan import Plan, make_plan
from remat_compiler.schedule import build_schedule, simulate
from remat_compiler.graph import block_boundary_set
from remat_compiler.solvers.cpsat.rerun import lower_peak

pytest.importorskip("transformers")


def _loss(out):
    return out.loss  # the caller lets the logits go before backward (hold_outputs=False)


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    model, inputs, _ = build(n_layer=2, n_embd=64, n_head=4, vocab_size=512, batch=2, seq=64)
    eager = run_step(model, lambda: model(**inputs), loss=_loss).grads
    _, cg = rc.analyze(model, (), inputs, hold_outputs=False)
    return model, inputs, eager, cg


def test_loss_only_backward_has_no_zero_gradient_for_the_logits(gpt2):
    """hold_outputs=False with a scalar loss: the only tangent is the loss's, and a backward through
    the logits is refused instead of silently missing their gradient. ``model(**inputs).loss.backward()``
    lets the logits go before backward: hold_outputs=False predicts that step to the byte, plans for
    less memory than the held-outputs plan (by at least the logits' bytes), and refuses a plan made
    for the other assumption."""
    model, inputs, eager, cg = gpt2
    logits_bytes = 2 * 64 * 512 * 4
    assert [cg.attr(t, "shape") for t in cg.tangents] == [()]
    m = rc.compile(model, 0.6, hold_outputs=False, time_limit_s=2)
    got = planned_step(model, lambda: m(**inputs), loss=_loss)  # the first step traces and plans
    assert got.peak == m.plan.peak_bytes <= m.plan.budget_bytes
    assert_same(got.grads, eager, rtol=1e-5, atol=1e-6)
    out = m(**inputs)
    with pytest.raises(RuntimeError, match="hold_outputs=True"):
        (out.loss + out.logits.sum()).backward()
    # the default keeps every output's gradient path
    held = rc.compile(model, 0.6, time_limit_s=2)
    out = held(**inputs)
    (out.loss + out.logits.sum()).backward()
    del out
    # the held plan over-predicts a loss-only step by the logits it assumed were kept
    dropping = run_step(model, lambda: held(**inputs), loss=_loss, measure=True).peak
    assert held.plan.peak_bytes - dropping >= logits_bytes
    # neither the logits nor a zero gradient for them (backward runs from the loss alone)
    assert m.plan.baseline_peak_bytes == held.plan.baseline_peak_bytes - 2 * logits_bytes
    with pytest.raises(rc.PlanMismatchError):
        rc.compile(model, plan=held.plan, hold_outputs=False)(**inputs)


def test_reruns_lower_the_peak_and_run_exactly_as_simulated(gpt2):
    """Checkpointing every block recomputes the tanh-GELU's intermediates for the next weight gradient
    and keeps them to the GELU's own backward; reruns drop and recompute them, which lowers the peak.
    The emitted module runs the plan: measured peak == predicted, gradients equal eager."""
    model, inputs, eager, cg = gpt2
    saved = block_boundary_set(cg)
    before = simulate(cg, build_schedule(cg, saved))
    rerun, sim = lower_peak(cg, saved)
    assert rerun and sim.peak_bytes < before.peak_bytes
    plan = make_plan(cg, saved, budget_bytes=sim.peak_bytes, solver="checkpoint+reruns", rerun=rerun)
    assert plan.rerun == rerun and plan.peak_bytes == sim.peak_bytes
    again = [n for n in set(plan.recomputed) if plan.recomputed.count(n) > 1]
    values = {v for v, _ in rerun}
    assert values <= set(again)  # each rerun value, and views of them taken again from the new one
    assert all(cg.storage(n) in values for n in set(again) - values)
    assert plan.recompute_flops == sum(cg.attr(n, "flops") for n in plan.recomputed)
    assert "recomputed again" in plan.explain()
    m = rc.compile(model, plan=plan, hold_outputs=False)
    got = planned_step(model, lambda: m(**inputs), loss=_loss)  # the first step traces and plans
    assert got.peak == plan.peak_bytes
    assert_same(got.grads, eager, rtol=1e-5, atol=1e-6)
    # the reruns are part of the plan document: round trip, and an edit is detected
    back = Plan.from_json(plan.to_json())
    assert back.rerun == plan.rerun and back.schedule.to_json() == plan.schedule.to_json()
    rc.check_plan(cg, back)
    edited = Plan.from_json(plan.to_json())
    edited.rerun = edited.rerun[:-1]
    with pytest.raises(PlanCheckError, match="schedule"):
        rc.check_plan(cg, edited)


def test_bad_reruns_are_refused(gpt2):
    _model, _inputs, _eager, cg = gpt2
    saved = block_boundary_set(cg)
    schedule = build_schedule(cg, saved)
    kept = next(iter(schedule.saved))
    with pytest.raises(PlanCheckError, match="only a recomputed"):
        build_schedule(cg, saved, [(kept, 3)])
    some = next(n for n in schedule.recomputed if cg.attr(n, "bytes") > 0 and not cg.attr(n, "is_tuple")
                and cg.attr(n, "op") != "getitem" and cg.storage(n) == n)
    with pytest.raises(PlanCheckError, match="steps are"):
        build_schedule(cg, saved, [(some, 0)])
    # a rerun before the value's first recomputation changes nothing and is dropped
    first = next(j for j, (rec, _b) in enumerate(schedule.bw) if some in rec)
    if first > 1:
        assert build_schedule(cg, saved, [(some, 1)]).rerun == []


def test_budget_below_single_recompute_floor_is_met_with_reruns(gpt2):
    """The smallest feasible budget now counts reruns; compiling at it gives a plan that fits."""
    from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak

    model, inputs, eager, cg = gpt2
    memo = SolveMemo()  # the second search starts from the first's plan, and the compile from both
    low, _proven, saved, rerun = min_feasible_peak(cg, time_limit_s=5, reruns=False, memo=memo)
    lowest, proven, saved2, rerun2 = min_feasible_peak(cg, time_limit_s=2, memo=memo)  # no proof: to the limit
    assert lowest <= low
    if lowest < low:
        assert rerun2 and not proven
    m = rc.compile(model, lowest, hold_outputs=False, time_limit_s=5, memo=memo)
    got = planned_step(model, lambda: m(**inputs), loss=_loss)  # the first step traces and plans
    assert got.peak == m.plan.peak_bytes <= lowest
    assert_same(got.grads, eager, rtol=1e-5, atol=1e-6)


def test_solver_uses_reruns_below_what_single_recomputation_reaches(gpt2):
    """Under a policy that pins the checkpoint-every-block saves, CP-SAT's floor is that plan's peak;
    a budget between it and the rerun plan's peak is met with reruns, and one below is refused with
    the rerun plan's peak named."""
    from remat_compiler.errors import InfeasibleBudgetError
    from remat_compiler.solvers.cpsat import solve_cpsat

    _model, _inputs, _eager, cg = gpt2
    saved = build_schedule(cg, block_boundary_set(cg)).saved
    pinned = dict(forced_saved=saved, forbidden_saved=sorted(set(cg.candidates) - set(saved)), time_limit_s=5)
    single = simulate(cg, build_schedule(cg, saved)).peak_bytes
    _rerun, sim = lower_peak(cg, saved)
    assert sim.peak_bytes < single
    plan = solve_cpsat(cg, single - 1, **pinned)
    assert plan.rerun and plan.peak_bytes <= single - 1 and sorted(plan.saved) == sorted(saved)
    rc.check_plan(cg, plan)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_cpsat(cg, plan.peak_bytes // 2, **pinned)
    assert err.value.min_feasible_bytes <= single - 1
