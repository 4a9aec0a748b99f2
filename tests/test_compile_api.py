"""remat_compiler.compile as a user meets it: the module, plans per signature, plans on disk, errors."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.examples.models import MLPChain
from helpers import grads_of, planned_step


class WithLoss(nn.Module):
    """An MLP chain that computes its own loss, so the whole step is inside the compiled module."""

    def __init__(self, width=128, depth=6):
        super().__init__()
        self.net = MLPChain(width, depth)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def _data(batch=512, width=128):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)


def test_shares_parameters_state_dict_and_optimizer():
    torch.manual_seed(0)
    model = WithLoss()
    m = rc.compile(model, memory_budget=0.7)
    assert [id(p) for p in m.parameters()] == [id(p) for p in model.parameters()]
    assert list(m.state_dict()) == list(model.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = model.net.head.weight.detach().clone()
    x, y = _data()
    m(x, y).backward()
    opt.step()
    assert not torch.equal(before, model.net.head.weight)


def test_plan_per_signature_and_reuse():
    torch.manual_seed(0)
    model = WithLoss()
    m = rc.compile(model, memory_budget=0.6)
    x, y = _data(512)
    m(x, y).backward()
    plan_512 = m.plan
    m(*_data(256)).backward()
    assert m.plan is not plan_512 and m.plan.fingerprint != plan_512.fingerprint
    m(x, y).backward()
    assert m.plan is plan_512
    assert len(m._entries) == 2


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def test_later_calls_use_the_parameters_the_model_holds_now_under_their_names():
    """A later call (the same graph) reads each parameter by its name: one swapped for a new tensor,
    or listed in another order because its module was registered again (``named_parameters()`` then
    lists ``b`` first, with the same shapes), still lands its gradient on the right tensor."""
    torch.manual_seed(0)
    model, x = _TwoLayers(), torch.randn(8, 16)
    m = rc.compile(model)
    m(x).backward()
    model.a.weight = nn.Parameter(torch.randn(16, 16))
    a = model.a
    del model.a
    model.a = a
    assert [n for n, _ in model.named_parameters()] == ["b.weight", "b.bias", "a.weight", "a.bias"]
    model.zero_grad(set_to_none=True)
    m(x).backward()
    assert len(m._entries) == 1
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-6, atol=1e-7), name


def test_eval_and_no_grad_run_the_model_as_is():
    torch.manual_seed(0)
    model = WithLoss()
    m = rc.compile(model, memory_budget=0.5)
    x, y = _data()
    with torch.no_grad():
        assert torch.equal(m(x, y), model(x, y))
    m.eval()
    assert torch.equal(m(x, y), model(x, y))
    assert m.plan is None and not m._entries


def test_mlp_measured_peak_matches_prediction_and_budget():
    torch.manual_seed(0)
    model = WithLoss(width=128, depth=6)
    x, y = _data(1024)
    model(x, y).backward()
    eager = grads_of(model)
    for budget in (0.9, 0.6, 0.5):
        m = rc.compile(model, memory_budget=budget, time_limit_s=10)
        peak = planned_step(model, lambda: m(x, y)).peak  # the first step traces and plans
        plan = m.plan
        assert peak <= plan.budget_bytes
        assert peak == plan.peak_bytes
        for n, g in grads_of(model).items():
            assert torch.allclose(g, eager[n], rtol=1e-5, atol=1e-7), (budget, n)
    assert plan.recomputed and plan.peak_bytes <= 0.5 * plan.baseline_peak_bytes
    # CPU mse_loss keeps its scalar in a buffer the size of its input: calibrated, not the fake 4 bytes
    cg = m.planned.cg
    loss = [n for n in cg.fw_order if cg.attr(n, "op") == "aten.mse_loss.default"]
    assert [cg.attr(n, "bytes") for n in loss] == [x.shape[0] * 4]


def test_plan_json_round_trip_and_reapply(tmp_path):
    torch.manual_seed(0)
    model = WithLoss()
    x, y = _data()
    planned = rc.plan_model(model, (x, y), memory_budget=0.6, time_limit_s=10)
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    loaded = rc.Plan.load(path)
    assert loaded.to_json() == planned.plan.to_json()
    assert loaded.digest() == planned.plan.digest()
    m = rc.compile(model, plan=loaded)
    m(x, y).backward()
    assert m.plan.saved == planned.plan.saved
    with pytest.raises(rc.PlanMismatchError, match="re-plan"):
        rc.compile(WithLoss(width=64), plan=loaded)(*_data(width=64))


def test_corrupt_plan_is_detected(tmp_path):
    torch.manual_seed(0)
    model = WithLoss()
    planned = rc.plan_model(model, _data(), memory_budget=0.6, time_limit_s=10)
    doc = json.loads(planned.plan.to_json())
    doc["saved"] = doc["saved"][:-1]
    doc["schedule"]["saved"] = doc["schedule"]["saved"][:-1]
    with pytest.raises(ValueError, match="corrupt"):
        rc.Plan.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match="invalid JSON"):
        rc.Plan.from_json(planned.plan.to_json()[:-20])


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # data-dependent control flow
            h = h * 2
        return h.sum()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_untraceable_model_names_the_op_and_line(backend):
    # where Dynamo would break the graph, the step (traced whole, without Dynamo) is refused
    with pytest.raises(rc.UntraceableModelError) as err:
        rc.compile(DataDependent(), memory_budget=0.5, backend=backend)(torch.randn(3, 4))
    msg = str(err.value)
    assert "_local_scalar_dense" in msg or "data-dependent" in msg
    assert "test_compile_api.py" in msg and "h.sum() > 0" in msg


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected a positive int"):
        rc.compile(WithLoss(), memory_budget="lots")
    with pytest.raises(ValueError, match="unknown solver"):
        rc.compile(WithLoss(), solver="magic")


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 1)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x)))).sum()


def test_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    model = Dropout()
    x = torch.randn(256, 64)
    _, cg = rc.analyze(model, (x,))
    memo = rc.SolveMemo()
    smallest, *_ = rc.solvers.cpsat.min_feasible_peak(cg, time_limit_s=10, memo=memo)
    m = rc.compile(model, memory_budget=smallest, time_limit_s=10, memo=memo)
    torch.manual_seed(5)
    m(x).backward()
    assert m.plan.recomputed and m.plan.peak_bytes < m.plan.baseline_peak_bytes
    cg = m.planned.cg
    random_nodes = [n for n in cg.fw_order if cg.attr(n, "never_recompute")]
    assert random_nodes and not set(random_nodes) & set(m.plan.recomputed)
    got = grads_of(model)
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(5)
    model(x).backward()
    for n, g in grads_of(model).items():
        assert torch.allclose(g, got[n], rtol=1e-6, atol=1e-7), n


def test_attention_without_dropout_is_recomputed_and_with_dropout_is_not():
    """sdpa's CPU kernel is tagged random for its dropout alone: at dropout_p=0 (transformers' default,
    attention_dropout=0.0) it may be recomputed, and a plan that recomputes it trains like eager."""
    from remat_compiler.passes.costs import _never_recompute

    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    for p, random in ((0.1, True), (0.0, False)):  # (the CPU kernel refuses dropout > 0 when it runs)
        graph = torch.fx.Graph()
        q = graph.placeholder("q")
        node = graph.call_function(kernel, (q, q, q, p))
        reason = _never_recompute(node)
        assert (reason is not None and reason.startswith("random op")) if random else reason is None, (p, reason)
    pytest.importorskip("transformers")
    import copy

    from remat_compiler.examples.zoo import build

    model, inputs, _ = build("llama")  # LlamaConfig's defaults: sdpa attention, attention_dropout 0.0
    reference = copy.deepcopy(model)
    expected = reference(**inputs)
    expected.backward()
    cg = rc.analyze(model, (), inputs)[1]
    sdpa = [n for n in cg.fw_order if "scaled_dot_product" in cg.attr(n, "op")]
    assert len(sdpa) == 2 and not any(cg.attr(n, "never_recompute") for n in sdpa)
    memo = rc.SolveMemo()
    smallest, *_ = rc.solvers.cpsat.min_feasible_peak(cg, time_limit_s=1, memo=memo)
    m = rc.compile(model, memory_budget=smallest, time_limit_s=1, memo=memo)
    loss = m(**inputs)
    loss.backward()
    assert set(sdpa) & set(m.plan.recomputed), m.plan.recomputed  # the least peak recomputes attention
    assert torch.allclose(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), n
