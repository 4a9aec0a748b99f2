"""The seed documents' numbers, reproduced exactly by every plan at every budget."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.examples.models import build_lecture
from remat_compiler.plan import make_plan
from remat_compiler.schedule import build_schedule, simulate

LECTURE = {
    "loss": 0.5,
    "hidden.weight": [[-2.0, -4.0], [1.0, 2.0]],
    "hidden.bias": [-2.0, 1.0],
    "out.weight": [[-0.5, -1.5]],
    "out.bias": [-1.0],
    "x": [[-1.5, 3.0]],
}


class ReverseMode(nn.Module):
    """L = (a·b + c)·d with a, b, c, d as parameters (the seed's reverse-mode note)."""

    def __init__(self):
        super().__init__()
        for name, value in zip("abcd", (2.0, 3.0, 4.0, 5.0)):
            setattr(self, name, nn.Parameter(torch.tensor(value)))

    def forward(self, scale):
        return (self.a * self.b + self.c) * self.d * scale


def _fixed(saved):
    """A solver that returns the plan saving exactly ``saved`` (to run every plan through codegen)."""
    def solve_fixed(cg, budget_bytes, **_):
        return make_plan(cg, [s for s in saved if s in cg.candidates], budget_bytes=budget_bytes,
                         solver="fixed")
    return solve_fixed


def _all_saved_sets(cg):
    seen = {}
    for k in range(len(cg.candidates) + 1):
        for subset in itertools.combinations(cg.candidates, k):
            try:
                schedule = build_schedule(cg, subset)
                peak = simulate(cg, schedule).peak_bytes
            except rc.PlanCheckError:
                continue  # saves a value it would have to recompute but must not
            seen.setdefault(tuple(schedule.saved), peak)
    return seen


def _lecture_step(compiled, model, x, y):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    loss = compiled(x, y)
    loss.backward()
    return loss


def _assert_lecture(model, x, loss):
    assert loss.item() == LECTURE["loss"]
    for name, p in model.named_parameters():
        assert p.grad.tolist() == LECTURE[name], name
    assert x.grad.tolist() == LECTURE["x"]


def test_eager_lecture_matches_seed():
    model, (x, y), _ = build_lecture()
    loss = model(x, y)
    loss.backward()
    _assert_lecture(model, x, loss)


def test_lecture_every_budget_from_smallest_to_unlimited():
    model, (x, y), _ = build_lecture()
    gm, cg = rc.analyze(model, (x, y))
    peaks = sorted(set(_all_saved_sets(cg).values()))
    # parameter gradients dominate this tiny network's peak: every plan peaks at the same bytes
    assert peaks == [60]
    budgets = [None] + peaks[::-1]
    seen_plans = set()
    for budget in budgets:
        compiled = rc.compile(model, memory_budget=budget, time_limit_s=10)
        loss = _lecture_step(compiled, model, x, y)
        _assert_lecture(model, x, loss)
        assert budget is None or compiled.plan.peak_bytes <= budget
        seen_plans.add(tuple(compiled.plan.saved))
    with pytest.raises(rc.InfeasibleBudgetError) as err:
        rc.compile(model, memory_budget=peaks[0] - 1)(x, y)
    assert err.value.min_feasible_bytes == peaks[0]
    assert str(peaks[0]) in str(err.value)


def test_lecture_every_plan_exact():
    """Not just the plans CP-SAT picks: every saved set the simulator accepts gives the seed numbers."""
    model, (x, y), _ = build_lecture()
    gm, cg = rc.analyze(model, (x, y))
    sets = _all_saved_sets(cg)
    assert len(sets) >= 4
    for saved in sets:
        compiled = rc.compile(model, solver=_fixed(saved))
        loss = _lecture_step(compiled, model, x, y)
        _assert_lecture(model, x, loss)
        assert set(compiled.plan.saved) == set(saved)


def test_reverse_mode_every_budget():
    model = ReverseMode()
    scale = torch.tensor(1.0)
    eager = model(scale)
    assert eager.item() == 50.0
    gm, cg = rc.analyze(model, (scale,))
    for saved in _all_saved_sets(cg):
        for p in model.parameters():
            p.grad = None
        compiled = rc.compile(model, solver=_fixed(saved))
        loss = compiled(scale)
        loss.backward()
        assert loss.item() == 50.0
        assert [model.a.grad.item(), model.b.grad.item(), model.c.grad.item(), model.d.grad.item()] \
            == [15.0, 10.0, 5.0, 10.0]
