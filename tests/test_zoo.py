"""The model zoo: HuggingFace families at their default configs (only sizes shrunk, see
:mod:`examples.zoo`), as a new user builds them: ``use_cache=True``, default dropout, training-mode
BatchNorm. For each, at the smallest feasible budget and at one between it and no recompute:
gradients allclose to eager's (None where eager's are None), the measured peak under the budget and
equal to the prediction, buffers (BatchNorm statistics) equal to eager's."""
from __future__ import annotations

import copy

import pytest
import torch

import remat_compiler as rc
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.solvers import solve
from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak

pytest.importorskip("transformers")
from examples.zoo import FAMILIES, build  # noqa: E402

TIME_LIMIT_S = 1
SEED = 1234  # the same dropout masks in eager and compiled steps


def _step(model, call, inputs):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(SEED)
    loss = call(**inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _eager(model, inputs):
    ref = copy.deepcopy(model)
    _step(ref, ref, inputs)
    loss, grads = _step(ref, ref, inputs)
    return loss, grads, {n: b.clone() for n, b in ref.named_buffers()}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_at_default_config(family):
    model, inputs, _ = build(family)
    eager_loss, eager_grads, eager_buffers = _eager(model, inputs)
    _, cg = rc.analyze(model, (), inputs)
    # the plans the smallest-budget search finds (with reruns, searched locally) reach the compiles
    # through the memo, as a budget sweep's do: a solve without it may not meet that budget again
    memo = SolveMemo()
    smallest, *_ = min_feasible_peak(cg, time_limit_s=TIME_LIMIT_S, memo=memo)
    no_recompute = solve(cg, None, "save_all").peak_bytes
    assert smallest <= no_recompute
    for budget in (smallest, (smallest + no_recompute) // 2):
        net = copy.deepcopy(model)
        m = rc.compile(net, memory_budget=budget, time_limit_s=TIME_LIMIT_S, memo=memo)
        _step(net, m, inputs)                                   # traces and plans
        with LiveStorageTracker() as mem:
            loss, grads = _step(net, m, inputs)
        assert torch.allclose(loss, eager_loss, rtol=1e-5, atol=1e-6), (family, budget)
        for name, g in eager_grads.items():
            assert (grads[name] is None) == (g is None), (family, budget, name)
            if g is not None:
                assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-5), (family, budget, name)
        assert mem.peak_bytes <= budget, (family, budget, mem.peak_bytes)
        assert mem.peak_bytes == m.plan.peak_bytes, (family, budget, mem.peak_bytes, m.plan.peak_bytes)
        for name, b in net.named_buffers():
            assert torch.equal(b, eager_buffers[name]), (family, budget, name)
