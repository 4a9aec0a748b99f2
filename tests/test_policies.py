"""User policies (remat_compiler/policies.py) reach CP-SAT as hard constraints, and gradients hold."""
from __future__ import annotations

import pytest
import torch

import remat_compiler as rc
from remat_compiler.examples.models import MLPChain
from remat_compiler.policies import (MATMUL_OPS, apply_policy, first_of, never_save, save, save_matmuls,
                                     save_only)
from remat_compiler.schedule import save_all_set

FAST = dict(time_limit_s=5, num_workers=2)


def _setup():
    torch.manual_seed(0)
    model = MLPChain(width=64, depth=4)
    x = torch.randn(256, 64)
    model(x).pow(2).mean().backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    _, cg = rc.analyze(model, (x,))
    return model, x, eager, cg


def _train(model, x, **kwargs):
    m = rc.compile(model, **kwargs)
    for p in model.parameters():
        p.grad = None
    m(x).pow(2).mean().backward()
    return m.plan, {n: p.grad for n, p in model.named_parameters()}


def test_save_matmuls_keeps_every_matmul_and_gradients_hold():
    model, x, eager, cg = _setup()
    matmuls = [v for v in save_all_set(cg) if cg.attr(v, "op") in MATMUL_OPS]
    assert matmuls
    plan, grads = _train(model, x, memory_budget=0.8, policy=save_matmuls, **FAST)
    assert set(matmuls) <= set(plan.saved)
    assert plan.peak_bytes <= plan.budget_bytes
    for n, g in grads.items():
        assert torch.allclose(g, eager[n], rtol=1e-5, atol=1e-7), n


def test_save_only_and_never_save_forbid_everything_else():
    model, x, eager, cg = _setup()
    plan, grads = _train(model, x, memory_budget=None, policy=save_only("aten.addmm*"), **FAST)
    # no budget: everything would be saved, but only addmm outputs may be
    assert plan.saved and all(cg.attr(v, "op") == "aten.addmm.default" for v in plan.saved)
    assert plan.recomputed
    for n, g in grads.items():
        assert torch.allclose(g, eager[n], rtol=1e-5, atol=1e-7), n
    plan, _ = _train(model, x, memory_budget=None, policy=never_save("layers.1"), **FAST)
    in_layer_1 = [v for v in save_all_set(cg) if (cg.attr(v, "module") + ".").startswith("layers.1.")]
    assert in_layer_1 and plan.saved and not set(in_layer_1) & set(plan.saved)


def test_first_of_takes_the_first_opinion():
    _, _, _, cg = _setup()
    mm = next(v for v in save_all_set(cg) if cg.attr(v, "op") == "aten.addmm.default")
    assert first_of(never_save("aten.addmm*"), save_matmuls)(cg, mm) == "recompute"
    assert first_of(save_matmuls, never_save("aten.addmm*"))(cg, mm) == "save"
    assert save(mm)(cg, mm) == "save" and save("nothing")(cg, mm) is None
    forced, forbidden = apply_policy(cg, first_of(save(mm), never_save("*")))
    assert forced == [mm] and mm not in forbidden and len(forbidden) == len(save_all_set(cg)) - 1
    with pytest.raises(ValueError, match="expected 'save'"):
        apply_policy(cg, lambda cg, v: "keep")


def test_a_policy_needs_cpsat():
    model, x, _, cg = _setup()
    with pytest.raises(ValueError, match="cpsat"):
        _train(model, x, memory_budget=None, solver="save_all", policy=save_matmuls)


def test_an_infeasible_budget_under_a_policy_names_the_smallest_budget_with_it():
    from remat_compiler.errors import InfeasibleBudgetError
    from remat_compiler.solvers.cpsat import min_feasible_peak

    model, x, _, cg = _setup()
    single = dict(FAST, reruns=False)  # proofs are over plans that recompute each value once
    free, free_proven, *_ = min_feasible_peak(cg, **single)
    forced, forbidden = apply_policy(cg, save_matmuls)
    kept, kept_proven, saved, _ = min_feasible_peak(cg, forced_saved=forced, forbidden_saved=forbidden, **single)
    assert free_proven and kept_proven
    assert kept > free and set(forced) <= set(saved)  # keeping every matmul output costs memory
    with pytest.raises(InfeasibleBudgetError) as err:
        _train(model, x, memory_budget=kept - 1, policy=save_matmuls, **single)
    assert err.value.min_feasible_bytes == kept
    plan, _ = _train(model, x, memory_budget=kept, policy=save_matmuls, **single)
    assert plan.peak_bytes <= kept
