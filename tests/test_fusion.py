"""What Inductor fuses away (:mod:`remat_compiler.fusion`): the graph as its code allocates it, which saved
values move, what they may add, the budget, and the gradients of the plans that result."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from helpers import run_step
from remat_compiler.budget import parse_budget
from remat_compiler.errors import PlanMismatchError
from remat_compiler.fusion import fusible_recompute, inductor_view, inlined, is_pointwise
from remat_compiler.plan import make_plan
from remat_compiler.schedule import build_schedule, no_recompute, simulate
from remat_compiler.solvers import resolve_budget


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


def test_inductor_view_charges_nothing_for_what_inductors_kernels_never_write():
    """The graph as Inductor's code allocates it: gelu_new's pointwise chain, forward and backward, is
    inlined (no bytes, no candidate) and each reader of an inlined value reads what it was computed
    from; what a matmul reads is written; a fraction budget is of the step run op by op; a plan made
    on the view is refused on the graph as traced, saying which backend it is for."""
    model, x, cg = _graph()
    found = inlined(cg)
    view = inductor_view(cg)
    assert found and set(found) <= set(cg.candidates) | set(cg.bw_order)
    assert {cg.attr(n, "phase") for n in found} == {"fw", "bw"}
    for n, reads in found.items():
        assert is_pointwise(cg, n) and all(is_pointwise(cg, r) for r in cg.g.successors(n)), n
        assert view.attr(n, "bytes") == 0 and n not in view.candidates
        assert reads and not reads & set(found)  # the written values the inlined expression reads
        for r in cg.g.successors(n):
            assert reads - {r} <= set(view.preds(r)), (n, r)
    read_by_matmuls = [v for v in cg.candidates if any("mm" in str(cg.attr(u, "op")) for u in cg.g.successors(v))]
    assert read_by_matmuls and not set(read_by_matmuls) & set(found)
    assert no_recompute(view).peak_bytes < no_recompute(cg).peak_bytes
    assert resolve_budget(view, parse_budget(0.5)) == resolve_budget(cg, parse_budget(0.5))
    plan = rc.solve(view, None, "cpsat", time_limit_s=2)
    assert plan.extras["memory_model"] == "inductor" and not set(plan.saved) & set(found)
    with pytest.raises(PlanMismatchError, match="backend='inductor'"):
        plan.check_applies_to(cg)


def test_the_inductor_backend_plans_on_its_view_and_its_code_holds_the_plan():
    """End to end on the Inductor backend, no budget: the plan is made on Inductor's view (it says so),
    saves none of what the view inlines, the compiled backward takes exactly the saved values, and
    the measured step is the walk's peak, within the view's (which charges less than the step run op
    by op), with eager's gradients."""
    torch.manual_seed(0)
    model, x = GeluNewMLP(), torch.randn(64, 32)
    ref = GeluNewMLP()
    ref.load_state_dict(model.state_dict())
    ref(x).backward()
    m = rc.compile(model, backend="inductor", time_limit_s=2)
    m(x).backward()
    found = inlined(_graph()[2])
    assert m.planned.backend == "inductor" and m.plan.extras["memory_model"] == "inductor"
    assert not set(found) & set(m.plan.saved) and set(found) & set(m.plan.recomputed)
    bw_inputs = {p.name for p in m.planned.bw.graph.find_nodes(op="placeholder")}
    assert {n for n in bw_inputs if not n.startswith(("primals", "tangents"))} == set(m.plan.saved)
    measured = run_step(model, lambda: m(x), inductor=m).peak  # with Inductor's buffers
    assert measured == m.planned.compiled.peak_bytes <= m.plan.peak_bytes < m.plan.extras["fraction_base_bytes"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    assert "planned on the memory of Inductor's code" in m.plan.explain()
