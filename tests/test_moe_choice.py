"""Each MoE segment's combine (autograd or fused, issue 16 part 2): set per segment, recorded by the
plan, explained, and reproduced when a saved plan is applied.

Workload: ``moe_peak_worker``'s two-layer stack (float64, H=16, F=32, top-2, 4 experts, 32 tokens)
with its loss inside, on one process.
"""
from __future__ import annotations

import pytest
import torch

import moe_peak_worker as worker
import remat_compiler
from moe_uneven_worker import run_step
from remat_compiler.api import analyze
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.moe.layer import combine_modes, combine_modes_of, fused_combine_mode
from remat_compiler.plan import Plan, moe_combine_of
from remat_compiler.solvers.combine_choice import align_combines

TOL = dict(rtol=1e-10, atol=1e-12)  # float64
SHAPE = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, top_k=2)
SEGMENTS = ("inner.layers.0", "inner.layers.1")
Y_BYTES = 4 * 32 * 16 * 8  # GEMM2's output: [E_local=4, C=32, H=16] float64


def mixed_model():
    """Layer 0 with the fused combine, layer 1 with the autograd one."""
    model = worker.make_model(SHAPE)
    model.inner.layers[0].combine_mode = "fused"
    return model


def assert_same(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{label} {k}: {m}")


def measured_peaks(module, x, steps: int = 3) -> list[int]:
    peaks = []
    for _ in range(steps):
        for p in module.parameters():
            p.grad = None
        xx = x.detach().clone().requires_grad_(True)
        with LiveStorageTracker() as mem:
            module(xx).backward()
        peaks.append(mem.peak_bytes)
    return peaks


def assert_exact(module, x, label: str) -> None:
    """The median measured step peak is the plan's predicted one, within its budget."""
    peaks = sorted(measured_peaks(module, x))
    assert peaks[len(peaks) // 2] == module.plan.peak_bytes, (label, peaks, module.plan.peak_bytes)
    if module.plan.budget_bytes is not None:
        assert module.plan.peak_bytes <= module.plan.budget_bytes, label


@pytest.fixture(scope="module")
def x():
    return worker.make_tokens(SHAPE)


def test_combine_modes_sets_per_segment_and_restores():
    model = worker.make_model(SHAPE)
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}
    with combine_modes(model, {"inner.layers.0": "fused"}):
        assert combine_modes_of(model) == {"inner.layers.0": "fused", "inner.layers.1": "autograd"}
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}
    with pytest.raises(RuntimeError), combine_modes(model, "fused"):
        assert combine_modes_of(model) == {s: "fused" for s in SEGMENTS}
        raise RuntimeError("restored on the way out")
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}
    with fused_combine_mode(model):
        assert set(combine_modes_of(model).values()) == {"fused"}
    with pytest.raises(ValueError, match="not an MoELayer of the model; its MoELayers: 'inner.layers.0'"):
        with combine_modes(model, {"inner.layers.2": "fused"}):
            pass
    with pytest.raises(ValueError, match="must be one of"):
        with combine_modes(model, {"inner.layers.0": "custom"}):
            pass
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}


def test_graph_and_plan_record_each_segment_combine(x):
    _, cg = analyze(mixed_model(), (x,))
    want = {"inner.layers.0": {"mode": "fused", "y_bytes": Y_BYTES},
            "inner.layers.1": {"mode": "autograd", "y_bytes": Y_BYTES}}
    assert moe_combine_of(cg) == want
    plan = remat_compiler.plan_model(mixed_model(), (x,), solver="save_all").plan
    assert plan.extras["moe_combine"] == want
    text = plan.explain()
    assert "inner.layers.0: fused: y never stored (16.00 KiB)" in text
    assert "inner.layers.1: autograd: y (16.00 KiB) kept or recomputed for d(probs)" in text
    assert Plan.from_json(plan.to_json()).extras["moe_combine"] == want


def test_mixed_combines_compile_exactly(x):
    """A CP-SAT plan of a model whose layers use different combines: gradients of the model in its
    own modes, measured peak = predicted <= budget."""
    eager = run_step(mixed_model(), x)
    budget = int(0.8 * remat_compiler.plan_model(mixed_model(), (x,), solver="save_all").plan.peak_bytes)
    module = remat_compiler.compile(mixed_model(), budget, time_limit_s=10)
    assert_same(run_step(module, x), eager, "mixed")
    assert module.plan.extras["moe_combine"]["inner.layers.0"]["mode"] == "fused"
    assert module.plan.extras["moe_combine"]["inner.layers.1"]["mode"] == "autograd"
    assert_exact(module, x, "mixed")


@pytest.mark.parametrize("made_on", ["moe_custom", "mixed"])
def test_saved_plan_traces_the_combine_it_was_made_for(x, tmp_path, made_on):
    """``compile(model, plan=Plan.load(p))`` with the default solver traces every segment with the
    combine the plan records (a moe_custom plan: fused; a mixed model's plan: its modes), on a model
    built with the default autograd combine, and leaves the model's own modes as they were."""
    if made_on == "moe_custom":
        first = remat_compiler.compile(worker.make_model(SHAPE), solver="moe_custom")
        eager = run_step(worker.make_model(SHAPE), x)  # the autograd combine: equal up to rounding
    else:
        first = remat_compiler.compile(mixed_model(), time_limit_s=5)
        eager = run_step(mixed_model(), x)
    run_step(first, x)
    first.plan.save(tmp_path / "plan.json")
    model = worker.make_model(SHAPE)
    again = remat_compiler.compile(model, plan=Plan.load(tmp_path / "plan.json"))
    assert_same(run_step(again, x), eager, made_on)
    assert again.planned.source == "given"
    assert again.plan.extras["moe_combine"] == first.plan.extras["moe_combine"]
    assert again.plan.fingerprint == first.plan.fingerprint
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}
    assert_exact(again, x, made_on)


# ---------------------------------------------------------------- the two combines aligned


def _signature(cg, n):
    tag = cg.attr(n, "moe") or {}
    return cg.attr(n, "op"), cg.attr(n, "shape"), tag.get("segment"), tag.get("role")


@pytest.fixture(scope="module")
def union(x):
    model = worker.make_model(SHAPE)
    _, cg_a = analyze(model, (x,))
    _, cg_f = analyze(model, (x,), solver="moe_cpsat")
    return align_combines(cg_a, cg_f)


def test_the_combines_differ_in_one_backward_piece_per_segment(union):
    """Same forward; per segment one contiguous backward piece; only the autograd piece reads the
    gathered y (the unpermute's index_select), and both hand the rest of the backward dL/da,
    dL/dp and dL/dW2."""
    assert list(union.pieces) == ["inner.layers.1", "inner.layers.0"]  # backward runs layer 1 first
    for seg, both in union.pieces.items():
        auto, fused = both["autograd"], both["fused"]
        y = [v for v in auto.fw_reads if union.graphs["autograd"].attr(v, "op") == "aten.index_select.default"]
        assert len(y) == 1 and union.graphs["autograd"].attr(y[0], "shape") == (32 * 2, 16), seg
        assert y[0] not in fused.fw_reads, seg
        act = [v for v in fused.fw_reads if (union.graphs["fused"].attr(v, "moe") or {}).get("role") == "act"]
        assert act and set(act) <= set(auto.fw_reads), seg  # both read the SwiGLU output
        assert sorted(auto.outputs.values()) == sorted(fused.outputs.values()) and len(auto.outputs) == 3
        assert auto.bw_inputs == fused.bw_inputs  # G, produced by the shared backward
        assert any(n == "remat.combine_dgrad.default" for n in (union.graphs["fused"].attr(m, "op") for m in fused.nodes))


@pytest.mark.parametrize("modes", [{"inner.layers.0": "fused", "inner.layers.1": "autograd"},
                                   {"inner.layers.0": "autograd", "inner.layers.1": "fused"},
                                   {"inner.layers.0": "fused", "inner.layers.1": "fused"}])
def test_materialised_backward_is_the_traced_one(union, x, modes):
    """Splicing the chosen pieces between the shared nodes gives, op for op, the backward of the step
    traced with those combines, whose forward is the same."""
    model = worker.make_model(SHAPE)
    with combine_modes(model, modes):
        _, cg = analyze(model, (x,))
    assert cg.fw_order == union.graphs["autograd"].fw_order
    got = [_signature(union.graphs["autograd" if mode == "shared" else mode], n)
           for mode, n in union.materialise(modes)]
    assert got == [_signature(cg, n) for n in cg.bw_order]


def test_alignment_refuses_what_it_cannot_pair(union, x):
    with pytest.raises(ValueError, match="needs a combine mode"):
        union.materialise({"inner.layers.0": "fused"})
    with pytest.raises(ValueError, match="no MoELayer segment"):
        union.materialise({"inner.layers.0": "fused", "inner.layers.1": "fused", "inner.layers.7": "fused"})
    cg_a = union.graphs["autograd"]
    with pytest.raises(ValueError, match="was not traced with every MoELayer in combine='fused'"):
        align_combines(cg_a, cg_a)
    other = dict(SHAPE, hidden_size=24)
    _, cg_other = analyze(worker.make_model(other), (worker.make_tokens(other),), solver="moe_cpsat")
    with pytest.raises(ValueError, match="differs between the two combines' graphs"):
        align_combines(cg_a, cg_other)
