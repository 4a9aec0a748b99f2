"""Recomputation Inductor fuses away (:mod:`remat_compiler.fusion`): which saved values move, what they
may add, the budget, and the gradients of the plan that results."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

import remat_compiler as rc
from helpers import run_step
from remat_compiler.fusion import fusible_recompute, is_pointwise
from remat_compiler.plan import make_plan
from remat_compiler.schedule import build_schedule, simulate


class GeluNewMLP(nn.Module):
    """GPT-2's MLP: ``gelu_new`` written out as transformers writes it (a chain of pointwise ops whose
    intermediates autograd saves), between two matmuls."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h).pow(2).mean()


def _graph():
    torch.manual_seed(0)
    model, x = GeluNewMLP(), torch.randn(64, 32)
    return model, x, rc.analyze(model, (x,))[1]


def test_pointwise_values_read_only_by_pointwise_ops_move_and_nothing_else_is_added():
    model, x, cg = _graph()
    saved = list(rc.solve(cg, None, "save_all").saved)
    kept = fusible_recompute(cg, saved, None)
    moved = [v for v in saved if v not in kept]
    assert moved, "gelu_new's chain has pointwise intermediates with pointwise readers only"
    for v in moved:
        assert is_pointwise(cg, v) and all(is_pointwise(cg, u) for u in cg.g.successors(v)), v
    before, after = build_schedule(cg, saved), build_schedule(cg, kept)
    added = set(after.recomputed) - set(before.recomputed)
    assert added and all(is_pointwise(cg, n) for n in added)  # no matmul, no reduction recomputed
    assert not any("mm" in str(cg.attr(n, "op")) for n in added)
    assert simulate(cg, after).peak_bytes <= simulate(cg, before).peak_bytes  # no budget: within its own peak
    # the matmuls' inputs stay saved: each read by a matmul in backward, which Inductor does not fuse
    read_by_matmuls = [v for v in saved if any("mm" in str(cg.attr(u, "op")) for u in cg.g.successors(v))]
    assert read_by_matmuls and set(read_by_matmuls) <= set(kept)


def test_a_move_that_would_exceed_the_budget_is_not_made():
    model, x, cg = _graph()
    saved = list(rc.solve(cg, None, "save_all").saved)
    peak = simulate(cg, build_schedule(cg, saved)).peak_bytes
    kept = fusible_recompute(cg, saved, None)
    lowest = simulate(cg, build_schedule(cg, kept)).peak_bytes
    assert fusible_recompute(cg, saved, peak) == kept  # the same moves fit the plan's own peak
    assert fusible_recompute(cg, saved, lowest - 1) != kept or lowest == peak  # a tighter limit moves less
    for limit in (peak, lowest):
        assert simulate(cg, build_schedule(cg, fusible_recompute(cg, saved, limit))).peak_bytes <= limit


def test_the_refined_plan_trains_like_eager():
    model, x, cg = _graph()
    saved = fusible_recompute(cg, rc.solve(cg, None, "save_all").saved, None)
    plan = make_plan(cg, saved, budget_bytes=None, solver="refined")
    ref = GeluNewMLP()
    ref.load_state_dict(model.state_dict())
    ref(x).backward()
    m = rc.compile(model, plan=plan)
    m(x).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7), name
    assert set(m.plan.saved) == set(plan.saved)


def test_the_inductor_backend_recomputes_them_and_its_code_holds_the_plan():
    """End to end on the Inductor backend, no budget: the plan lists what it moved, saves none of it,
    the compiled backward takes exactly the saved values, and the measured step is the walk's peak,
    within the no-recompute plan's, with eager's gradients."""
    torch.manual_seed(0)
    model, x = GeluNewMLP(), torch.randn(64, 32)
    ref = GeluNewMLP()
    ref.load_state_dict(model.state_dict())
    ref(x).backward()
    m = rc.compile(model, backend="inductor", time_limit_s=2)
    m(x).backward()
    moved = m.plan.extras["inductor_fused_recompute"]
    assert m.planned.backend == "inductor" and moved and not set(moved) & set(m.plan.saved)
    assert set(moved) <= set(m.plan.recomputed)
    bw_inputs = {p.name for p in m.planned.bw.graph.find_nodes(op="placeholder")}
    assert {n for n in bw_inputs if not n.startswith(("primals", "tangents"))} == set(m.plan.saved)
    measured = run_step(model, lambda: m(x), inductor=m).peak  # with Inductor's buffers
    assert measured <= m.planned.compiled.peak_bytes <= m.plan.baseline_peak_bytes
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    assert "pointwise values recomputed, not saved" in m.plan.explain()
