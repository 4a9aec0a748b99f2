"""The default solver's per-segment combine choice on transformers MoE blocks (issue 16 item 2).

Mixtral and Qwen3-MoE built by :mod:`examples.zoo` (default configs, sizes shrunk, random weights):
each block is a segment named by its module path; :func:`segment_combines` fuses exactly the named
ones; the two combines' graphs align (same forward, one backward piece per block) and the union's
materialised backward is, op for op, the one traced with a mixed choice; ``compile(model, budget)``
chooses per block in its one solve, with gradients allclose to eager's, measured peak = predicted <=
budget, and the choice recorded and explained.
"""
from __future__ import annotations

import copy

import pytest
import torch

import remat_compiler as rc
from helpers import SEED, assert_same, eager_step, planned_step, run_step
from remat_compiler.api import PlanSpec, chooses_combines
from remat_compiler.solvers import solve
from remat_compiler.solvers.combine_choice import align_combines

pytest.importorskip("transformers")
from remat_compiler.examples.zoo import build  # noqa: E402
from remat_compiler.moe.hf import FUSED_CHILD  # noqa: E402
from remat_compiler.moe.segments import segment_combines, why_not_choosable  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)  # float32
SEGMENTS = ("model.model.layers.0.mlp", "model.model.layers.1.mlp")
OPTIONS = dict(time_limit_s=1, num_workers=2)


def _swapped(model) -> dict[str, bool]:
    return {seg: FUSED_CHILD in model.get_submodule(seg).experts._modules
            and "forward" in vars(model.get_submodule(seg).experts) for seg in SEGMENTS}


def test_segment_combines_fuses_exactly_the_named_blocks_and_restores():
    model, _, _ = build("mixtral")
    assert why_not_choosable(model) == {s: None for s in SEGMENTS}
    with segment_combines(model, {SEGMENTS[0]: "fused", SEGMENTS[1]: "autograd"}):
        assert _swapped(model) == {SEGMENTS[0]: True, SEGMENTS[1]: False}
    assert _swapped(model) == {s: False for s in SEGMENTS}
    with pytest.raises(RuntimeError, match="restored"), segment_combines(model, {SEGMENTS[1]: "fused"}):
        raise RuntimeError("restored even on error")
    assert _swapped(model) == {s: False for s in SEGMENTS}
    with pytest.raises(ValueError, match="'model.layers.0.mlp' is not an MoE segment of the model; its "
                                         "segments: 'model.model.layers.0.mlp', 'model.model.layers.1.mlp'"):
        with segment_combines(model, {"model.layers.0.mlp": "fused"}):
            pass
    model.model.set_experts_implementation("batched_mm")
    assert all("experts_implementation='batched_mm'" in why for why in why_not_choosable(model).values())
    with pytest.raises(ValueError, match="cannot run the fused combine: it runs experts_implementation='batched_mm'"):
        with segment_combines(model, {SEGMENTS[0]: "fused"}):
            pass
    assert _swapped(model) == {s: False for s in SEGMENTS}


def test_chooses_combines_where_an_hf_block_can_fuse():
    model, _, _ = build("mixtral")
    assert chooses_combines(PlanSpec.make(None, "cpsat", dict(OPTIONS)), model)
    assert chooses_combines(PlanSpec.make(None, "cpsat", {"deterministic": True, "progress": print}), model)
    for spec in (PlanSpec.make(None, "moe_cpsat", {}), PlanSpec.make(None, "cpsat", {"minimize_peak": False}),
                 PlanSpec.make(None, "cpsat", {}, policy=rc.policies.save_matmuls)):
        assert not chooses_combines(spec, model), spec
    model.model.set_experts_implementation("batched_mm")  # no block can fuse: planned as it is
    assert not chooses_combines(PlanSpec.make(None, "cpsat", {}), model)


@pytest.fixture(scope="module")
def mixtral():
    """Mixtral (2 MoE layers, top-2 of 4 experts), its step traced with every block autograd and
    every block fused, and the two aligned."""
    model, inputs, _ = build("mixtral")
    _, cg_a = rc.analyze(model, (), inputs)
    with segment_combines(model, {s: "fused" for s in SEGMENTS}):
        _, cg_f = rc.analyze(model, (), inputs)
    return model, inputs, align_combines(cg_a, cg_f)


def _signature(cg, n):
    tag = cg.attr(n, "moe") or {}
    return cg.attr(n, "op"), cg.attr(n, "shape"), tag.get("segment"), tag.get("role"), tag.get("grad_of")


def test_hf_blocks_differ_in_one_backward_piece_each(mixtral):
    """Same forward (the fused forward runs transformers' ops in its order); per block one
    contiguous backward piece: the autograd one reads y (GEMM2's grouped output), the fused one
    does not and runs remat::grouped_combine_dgrad; both hand on dL/da, dL/dp and dL/dW2."""
    _, inputs, union = mixtral
    rows = inputs["input_ids"].numel() * 2  # top-2
    cg_a, cg_f = union.graphs["autograd"], union.graphs["fused"]
    assert list(union.pieces) == list(reversed(SEGMENTS))  # backward runs layer 1 first
    for seg, both in union.pieces.items():
        auto, fused = both["autograd"], both["fused"]
        y = [v for v in auto.fw_reads if "grouped_mm" in cg_a.attr(v, "op")
             and cg_a.attr(v, "moe")["role"] == "gemm2"]
        assert len(y) == 1 and cg_a.attr(y[0], "shape") == (rows, 32), (seg, y)
        assert y[0] not in fused.fw_reads, seg
        assert [cg_f.attr(n, "op") for n in fused.nodes].count("remat.grouped_combine_dgrad.default") == 1
        assert all(cg_f.attr(n, "moe")["fused"] for n in fused.nodes), seg
        assert sorted(auto.outputs.values()) == sorted(fused.outputs.values()) and len(auto.outputs) == 3
        assert auto.bw_inputs == fused.bw_inputs, seg  # G, from the shared backward


@pytest.mark.parametrize("modes", [{SEGMENTS[0]: "fused", SEGMENTS[1]: "autograd"},
                                   {SEGMENTS[0]: "autograd", SEGMENTS[1]: "fused"}])
def test_materialised_hf_backward_is_the_traced_one(mixtral, modes):
    model, inputs, union = mixtral
    with segment_combines(model, modes):
        _, cg = rc.analyze(model, (), inputs)
    assert cg.fw_order == union.graphs["autograd"].fw_order
    got = [_signature(union.graphs["autograd" if mode == "shared" else mode], n)
           for mode, n in union.materialise(modes)]
    assert got == [_signature(cg, n) for n in cg.bw_order]


def _compiled(model, inputs, budget):
    """The default compile at ``budget``, stepped once (traces and plans) then measured (seeded)."""
    net = copy.deepcopy(model)
    m = rc.compile(net, memory_budget=budget, **OPTIONS)
    got = planned_step(net, lambda: m(**inputs), seed=SEED)
    return m, got, got.peak


def _eager(model, inputs):
    """Eager's step (seeded) on a copy of the model."""
    return eager_step(model, lambda ref: ref(**inputs), steps=1, seed=SEED)[1]


def _pure_and_eager(family, model, inputs, graphs=None):
    """Each combine's no-recompute plan (every segment autograd / fused) and eager's step."""
    if graphs is None:
        with segment_combines(model, {s: "fused" for s in SEGMENTS}):
            graphs = {"fused": rc.analyze(model, (), inputs)[1]}
        graphs["autograd"] = rc.analyze(model, (), inputs)[1]
    return {mode: solve(cg, None, "save_all") for mode, cg in graphs.items()}, _eager(model, inputs)


def _assert_chosen(family, model, inputs, pure, eager, at):
    """The default compile at ``at``: eager's gradients, measured peak = predicted <= budget, an
    optimal cost no more than either combine's no-recompute plan's, every segment's combine
    recorded and explained; returns the modes."""
    m, got, measured = _compiled(model, inputs, at)
    plan = m.plan
    assert_same(got, eager, (family, at), **TOL, none_ok=True)
    assert measured == plan.peak_bytes and (at is None or measured <= at), (family, at, measured)
    # optimal where the 1 s search proves it; under load the warm start it returns is a feasible plan,
    # whose cost the next line still bounds
    assert plan.solver == "cpsat" and plan.status in ("optimal", "feasible"), (family, at, plan.status)
    assert plan.recompute_s <= min(p.recompute_s for p in pure.values()) * (1 + 1e-9), (family, at)
    modes = {seg: c["mode"] for seg, c in plan.extras["moe_combine"].items()}
    assert sorted(modes) == list(SEGMENTS), (family, at, modes)
    text = plan.explain()
    for seg, mode in modes.items():
        line = next(ln for ln in text.splitlines() if f"{seg}: {mode}:" in ln)
        other = "autograd" if mode == "fused" else "fused"
        assert "chosen in the one CP-SAT solve with the saved set" in line, line
        assert f"with the {other} combine here and the same saved set" in line, line
    return modes


def _assert_fused_wins(family, model, inputs, pure, eager):
    """At the fused graph's no-recompute peak, below the model's own: the solve proves it
    recomputes no more than that plan, which the autograd combines alone cannot do within it (their
    least recompute is their no-recompute plan, above the budget): a fused segment is chosen."""
    budget = pure["fused"].peak_bytes
    assert pure["autograd"].peak_bytes > budget, family
    assert "fused" in _assert_chosen(family, model, inputs, pure, eager, budget).values(), family


def test_default_compile_chooses_each_mixtral_block_combine(mixtral):
    """Where a fused block wins (above), and with no budget, where the choice may keep autograd
    combines but recomputes no more than either combine's no-recompute plan."""
    model, inputs, union = mixtral
    pure, eager = _pure_and_eager("mixtral", model, inputs, union.graphs)
    _assert_fused_wins("mixtral", model, inputs, pure, eager)
    _assert_chosen("mixtral", model, inputs, pure, eager, None)


def test_default_compile_chooses_a_fused_qwen3_moe_block():
    model, inputs, _ = build("qwen3_moe")
    _assert_fused_wins("qwen3_moe", model, inputs, *_pure_and_eager("qwen3_moe", model, inputs))


def test_a_block_that_cannot_fuse_is_no_choice_and_keeps_autograd():
    """Layer 1's experts run transformers' ``batched_mm`` (a config of their own): layer 0 is still
    chosen for, layer 1 keeps the autograd combine and explain() says why it was no choice."""
    model, inputs, _ = build("mixtral")
    experts = model.get_submodule(SEGMENTS[1]).experts
    experts.config = copy.copy(experts.config)
    experts.config._experts_implementation = "batched_mm"
    why = why_not_choosable(model)
    assert why[SEGMENTS[0]] is None and "experts_implementation='batched_mm'" in why[SEGMENTS[1]]
    assert chooses_combines(PlanSpec.make(None, "cpsat", dict(OPTIONS)), model)
    eager = _eager(model, inputs)
    m, got, measured = _compiled(model, inputs, None)
    assert_same(got, eager, "one block unfusable", **TOL, none_ok=True)
    assert measured == m.plan.peak_bytes
    combine = m.plan.extras["moe_combine"]
    assert combine[SEGMENTS[1]]["mode"] == "autograd", combine
    assert combine[SEGMENTS[1]]["why"].startswith("no choice: its experts cannot run the fused combine: it runs "
                                                  "experts_implementation='batched_mm'"), combine
    assert "chosen in the one CP-SAT solve" in combine[SEGMENTS[0]]["why"], combine
    assert f"{SEGMENTS[1]}: autograd:" in m.plan.explain()


def test_under_cpu_autocast_the_choice_trains_like_autocast_eager():
    """Under CPU autocast to bfloat16 (the user's context around the step), the default compile still
    chooses per block (the experts get float32 rows there, so the fused combine traces), records
    each block's choice, and gives autocast eager's loss and gradients."""
    model, inputs, _ = build("mixtral")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _eager(model, inputs)
        net = copy.deepcopy(model)
        m = rc.compile(net, **OPTIONS)
        got = run_step(net, lambda: m(**inputs), seed=SEED)
    combines = m.plan.extras["moe_combine"]
    assert sorted(combines) == list(SEGMENTS)
    assert all(c["why"].startswith("chosen in the one CP-SAT solve") for c in combines.values()), combines
    assert_same(got, want, "under autocast", rtol=1e-5, atol=1e-6)
