"""The fused down projection + combine of transformers' MoE experts (issue 16 A, remat_compiler.moe.hf).

Mixtral (a sparse block) and Qwen2-MoE (routed experts beside a gated shared expert), built by
:mod:`examples.zoo` at their default configs (sizes shrunk), at 128 tokens so that the activations
outweigh the experts' weights: ``moe_fast`` over the graph as the model is, ``moe_custom`` and
``moe_cpsat`` over the graph traced with the fused combine. Each: gradients allclose to eager's,
measured peak = predicted, under the budget; ``moe_custom`` saves exactly ``y`` (and the inverse
permutation that only ``y``'s reordering needed) less than ``moe_fast`` per layer, and no GEMM2 or
unpermute value. In bfloat16 under Mixtral's float32 router too. The swap restores the model and keeps
its forward bit for bit; the custom op matches autograd in float64.
"""
from __future__ import annotations

import copy

import pytest
import torch

import remat_compiler as rc
from helpers import SEED, assert_same, eager_step, planned_step, run_step
from remat_compiler.solvers import solve

pytest.importorskip("transformers")
from remat_compiler.examples.zoo import build  # noqa: E402
from remat_compiler.moe.hf import (FUSED_CHILD, grouped_combine_dgrad, hf_fused_combine_mode,  # noqa: E402
                                   why_not_fusable)

BATCH, SEQ = 4, 32
TOL = dict(rtol=1e-5, atol=1e-6)  # float32
CPSAT_BUDGET = 0.9  # of the fused graph's no-recompute peak
# family -> (MoE layers, top-k at the default config)
FAMILIES = {"mixtral": (2, 2), "qwen2_moe": (2, 4)}
HIDDEN = 32


def _experts(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def runs(request):
    """Eager's step, then moe_fast, moe_custom and moe_cpsat compiled, stepped once and measured."""
    family = request.param
    model, inputs, _ = build(family, batch=BATCH, seq=SEQ)
    _, eager = eager_step(model, lambda ref: ref(**inputs), seed=SEED)
    out = {"family": family, "eager": eager, "tokens": inputs["input_ids"].numel()}
    for solver in ("moe_fast", "moe_custom", "moe_cpsat"):
        budget = None
        if solver == "moe_cpsat":
            budget = int(CPSAT_BUDGET * solve(out["moe_custom"][0].planned.cg, None, "save_all").peak_bytes)
        net = copy.deepcopy(model)
        m = rc.compile(net, memory_budget=budget, solver=solver,
                       **({"time_limit_s": 1} if solver == "moe_cpsat" else {}))
        got = planned_step(net, lambda: m(**inputs), seed=SEED)  # the first step traces and plans
        out[solver] = (m, got, got.peak, budget)
    return out


def _roles(cg, names):
    return [(cg.attr(n, "moe") or {}).get("role") for n in names]


def test_strategies_match_eager_and_their_prediction(runs):
    for solver in ("moe_fast", "moe_custom", "moe_cpsat"):
        m, got, measured, budget = runs[solver]
        label = (runs["family"], solver)
        assert_same(got, runs["eager"], label, **TOL)  # every gradient there
        assert measured == m.plan.peak_bytes, (label, measured, m.plan.peak_bytes)
        assert budget is None or measured <= budget, (label, measured, budget)
    fast_cg, custom_cg = runs["moe_fast"][0].planned.cg, runs["moe_custom"][0].planned.cg
    assert not any((fast_cg.attr(n, "moe") or {}).get("fused") for n in fast_cg.g.nodes)
    fused = [(custom_cg.attr(n, "moe") or {}) for n in custom_cg.g.nodes]
    assert {t["segment"] for t in fused if t.get("fused")} == {t["segment"] for t in fused if t}
    # the fused backward holds no more than fast's (here less: fast's peak holds a layer's y)
    assert runs["moe_custom"][2] < runs["moe_fast"][2], runs["family"]


def test_custom_saves_no_y(runs):
    layers, k = FAMILIES[runs["family"]]
    rows = runs["tokens"] * k
    y_bytes, inv_perm_bytes = rows * HIDDEN * 4, rows * 8  # float32 y; the int64 inverse permutation
    fast, custom, cpsat = (runs[s][0] for s in ("moe_fast", "moe_custom", "moe_cpsat"))
    assert fast.plan.saved_bytes - custom.plan.saved_bytes == layers * (y_bytes + inv_perm_bytes)
    fast_cg, cg = fast.planned.cg, custom.planned.cg
    assert "gemm2" in _roles(fast_cg, fast.plan.saved)  # the eager graph's backward reads y
    assert not {"gemm2", "unpermute"} & set(_roles(cg, custom.plan.saved)), runs["family"]
    assert "gemm2" not in _roles(cpsat.planned.cg, cpsat.plan.saved), runs["family"]


def test_bfloat16_experts_under_a_float32_router():
    """Mixtral cast to bfloat16 keeps float32 routing weights (its router's softmax is float32): the
    fused backward runs in the experts' dtype; its gradients are as near float32's as eager's, and it
    saves the bfloat16 y and the inverse permutation less than moe_fast."""
    model, inputs, _ = build("mixtral", batch=BATCH, seq=SEQ)
    want = run_step(model, lambda: model(**inputs), seed=SEED).grads  # float32
    model = model.to(torch.bfloat16)
    # the float32 gradients rounded to bfloat16, as model.to() rounds those the model holds (the step
    # used to return the model's own gradient tensors, which the cast changed in place)
    want = {n: g.to(torch.bfloat16) for n, g in want.items()}
    eager = eager_step(model, lambda ref: ref(**inputs), steps=1, seed=SEED)[1].grads
    plans = {}
    for solver in ("moe_fast", "moe_custom"):
        net = copy.deepcopy(model)
        m = rc.compile(net, solver=solver)
        got = planned_step(net, lambda: m(**inputs), seed=SEED)
        grads = got.grads
        assert got.peak == m.plan.peak_bytes, solver
        plans[solver] = m
    cg = plans["moe_custom"].planned.cg
    assert any((cg.attr(n, "moe") or {}).get("fused") for n in cg.g.nodes)

    def rel(got, name):
        return ((got[name].float() - want[name]).norm() / want[name].norm()).item()

    for name in want:  # grads holds moe_custom's
        assert rel(grads, name) <= 2 * rel(eager, name) + 2 ** -8, (name, rel(grads, name), rel(eager, name))
    layers, k = FAMILIES["mixtral"]
    rows = inputs["input_ids"].numel() * k
    saved = {s: m.plan.saved_bytes for s, m in plans.items()}
    assert saved["moe_fast"] - saved["moe_custom"] == layers * (rows * HIDDEN * 2 + rows * 8), saved


def test_swap_restores_the_model_and_keeps_forward_outputs():
    model, inputs, _ = build("mixtral")
    lm = model.model
    experts = _experts(lm)
    params = dict(lm.named_parameters())
    torch.manual_seed(SEED)
    want = lm(**inputs).logits
    with hf_fused_combine_mode(lm):
        assert all("forward" in vars(e) and FUSED_CHILD in e._modules for e in experts)
        assert dict(lm.named_parameters()) == params
        torch.manual_seed(SEED)
        got = lm(**inputs).logits
    assert torch.equal(got, want)
    assert all("forward" not in vars(e) and FUSED_CHILD not in e._modules for e in experts)
    with pytest.raises(RuntimeError, match="restored"), hf_fused_combine_mode(lm):
        raise RuntimeError("restored even on error")
    assert all("forward" not in vars(e) and FUSED_CHILD not in e._modules for e in experts)


def test_unmatched_experts_are_left_as_they_are():
    model, _, _ = build("qwen2_moe")
    assert all(why_not_fusable(e) is None for e in _experts(model))
    for impl in ("eager", "batched_mm"):
        model.model.set_experts_implementation(impl)
        experts = _experts(model)
        assert all(f"experts_implementation={impl!r}" in why_not_fusable(e) for e in experts)
        with hf_fused_combine_mode(model):
            assert all("forward" not in vars(e) and FUSED_CHILD not in e._modules for e in experts)


def test_grouped_combine_dgrad_against_autograd():
    """float64, uneven expert rows and an expert with none: the op's three gradients are autograd's
    through ``y = a @ w2[e]^T, out_s = p_s * y_s``, and its FLOPs are both GEMMs and the row dots."""
    gen = torch.Generator().manual_seed(0)
    counts, hidden, width = [3, 0, 5, 2], 4, 6
    rows = sum(counts)
    w2 = torch.randn(len(counts), hidden, width, generator=gen, dtype=torch.float64, requires_grad=True)
    act = torch.randn(rows, width, generator=gen, dtype=torch.float64, requires_grad=True)
    p = torch.rand(rows, 1, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    offsets = torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)
    y = torch.einsum("sf,shf->sh", act, w2[expert])
    torch.autograd.backward(p * y, grad)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as flops:
        grad_act, dp, grad_w2 = grouped_combine_dgrad(grad, w2.detach(), act.detach(), p.detach(), offsets,
                                                      True)
    torch.testing.assert_close(grad_act, act.grad)
    torch.testing.assert_close(dp, p.grad)
    torch.testing.assert_close(grad_w2, w2.grad)
    assert flops.get_total_flops() == 2 * 2 * rows * hidden * width + 2 * rows * width
    no_w2 = grouped_combine_dgrad(grad, w2.detach(), act.detach(), p.detach(), offsets, False)
    torch.testing.assert_close(no_w2[0], act.grad)
    assert no_w2[2].numel() == 0
