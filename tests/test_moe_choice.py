"""Each MoE segment's combine (autograd or fused, issue 16 part 2): set per segment, recorded by the
plan, explained, and reproduced when a saved plan is applied.

Workload: ``moe_peak_worker``'s two-layer stack (float64, H=16, F=32, top-2, 4 experts, 32 tokens)
with its loss inside, on one process.
"""
from __future__ import annotations

import pytest

import moe_peak_worker as worker
import remat_compiler
from helpers import assert_same, median, token_peaks, token_step
from remat_compiler.api import analyze
from remat_compiler.moe.layer import combine_modes, combine_modes_of, fused_combine_mode
from remat_compiler.plan import Plan, moe_combine_of
from remat_compiler.schedule import peak_of
from remat_compiler.trace import trace
from remat_compiler.solvers.combine_choice import align_combines
from remat_compiler.solvers.cpsat.choice import build_choice_model, solve_choice, union_steps

TOL = dict(rtol=1e-10, atol=1e-12, none_ok=True)  # float64 (a None gradient where eager's is None)
SHAPE = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, top_k=2)
SEGMENTS = ("inner.layers.0", "inner.layers.1")
Y_BYTES = 4 * 32 * 16 * 8  # GEMM2's output: [E_local=4, C=32, H=16] float64


def mixed_model():
    """Layer 0 with the fused combine, layer 1 with the autograd one."""
    model = worker.make_model(SHAPE)
    model.inner.layers[0].combine_mode = "fused"
    return model


def assert_exact(module, x, label: str) -> None:
    """The median measured step peak of three is the plan's predicted one, within its budget."""
    peaks = sorted(token_peaks(module, x, steps=3))
    assert median(peaks) == module.plan.peak_bytes, (label, peaks, module.plan.peak_bytes)
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
    eager = token_step(mixed_model(), x)
    budget = int(0.8 * remat_compiler.plan_model(mixed_model(), (x,), solver="save_all").plan.peak_bytes)
    module = remat_compiler.compile(mixed_model(), budget, time_limit_s=10)
    assert_same(token_step(module, x), eager, "mixed", **TOL)
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
        eager = token_step(worker.make_model(SHAPE), x)  # the autograd combine: equal up to rounding
    else:
        first = remat_compiler.compile(mixed_model(), time_limit_s=5)
        eager = token_step(mixed_model(), x)
    token_step(first, x)
    first.plan.save(tmp_path / "plan.json")
    model = worker.make_model(SHAPE)
    again = remat_compiler.compile(model, plan=Plan.load(tmp_path / "plan.json"))
    assert_same(token_step(again, x), eager, made_on, **TOL)
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
    with pytest.raises(ValueError, match="no MoE segment"):
        union.materialise({"inner.layers.0": "fused", "inner.layers.1": "fused", "inner.layers.7": "fused"})
    cg_a = union.graphs["autograd"]
    with pytest.raises(ValueError, match="was not traced with every MoELayer in combine='fused'"):
        align_combines(cg_a, cg_a)
    other = dict(SHAPE, hidden_size=24)
    _, cg_other = analyze(worker.make_model(other), (worker.make_tokens(other),), solver="moe_cpsat")
    with pytest.raises(ValueError, match="differs between the two combines' graphs"):
        align_combines(cg_a, cg_other)


# ---------------------------------------------------------------- the default solve chooses


def _modes(plan) -> dict:
    return {seg: c["mode"] for seg, c in plan.extras["moe_combine"].items()}


def _plan(shape, budget, solver="cpsat"):
    """The plan ``compile`` makes on its first call (the graph it runs, which is what plans are
    compared on), searched to the proof."""
    options = {} if solver in ("moe_custom", "moe_fast") else {"time_limit_s": 10, "tolerance": 0}
    module = remat_compiler.compile(worker.make_model(shape), budget, solver=solver, **options)
    token_step(module, worker.make_tokens(shape))
    return module.plan


def _compile_and_check(shape, budget):
    """The default compile at ``budget``, searched to the proof (``tolerance=0``: the tests compare
    its cost with other solvers' optima): gradients of eager's model, measured peak = predicted."""
    x = worker.make_tokens(shape)
    module = remat_compiler.compile(worker.make_model(shape), budget, time_limit_s=10, tolerance=0)
    assert_same(token_step(module, x), token_step(worker.make_model(shape), x), f"cpsat at {budget}", **TOL)
    assert_exact(module, x, f"cpsat at {budget}")
    return module


def test_default_solve_picks_the_fused_combine_where_it_is_cheaper():
    """Two layers, H=24, F=8, top-1 at moe_custom's peak: one solve picks the fused combine for both
    segments, at moe_cpsat's cost and below the autograd graph's."""
    shape = worker.SHAPES[3]
    budget = _plan(shape, None, "moe_custom").peak_bytes
    module = _compile_and_check(shape, budget)
    plan = module.plan
    assert plan.solver == "cpsat" and _modes(plan) == {s: "fused" for s in SEGMENTS}
    fused = _plan(shape, budget, "moe_cpsat")
    assert plan.status == fused.status == "optimal"
    assert plan.recompute_s == pytest.approx(fused.recompute_s, rel=1e-9)
    autograd = _plan(shape, budget, remat_compiler.solvers.solve_cpsat)  # the graph as the model is
    assert plan.recompute_s < autograd.recompute_s


def test_default_solve_mixes_combines_where_that_is_cheaper_than_either():
    """Two layers, H=16, F=32, top-2 at moe_fast's peak: layer 0 fused, layer 1 autograd, with no GEMM
    recomputed, where a solve over either combine alone recomputes one and costs more."""
    shape = worker.SHAPES[4]
    budget = _plan(shape, None, "moe_fast").peak_bytes
    plan = _compile_and_check(shape, budget).plan
    assert _modes(plan) == {"inner.layers.0": "fused", "inner.layers.1": "autograd"}
    assert plan.recompute_flops == 0
    for solver in ("moe_cpsat", remat_compiler.solvers.solve_cpsat):
        alone = _plan(shape, budget, solver)
        assert alone.recompute_flops > 0 and plan.recompute_s < alone.recompute_s, solver


def test_default_solve_keeps_the_autograd_combine_where_it_is_cheaper():
    """One layer, H=16, F=24, top-2, below moe_custom's peak: the autograd combine's backward holds
    less, so the solve keeps it, at the autograd graph's own cost and below moe_cpsat's."""
    shape = worker.SHAPES[0]
    budget = int(0.95 * _plan(shape, None, "moe_custom").peak_bytes)
    plan = _compile_and_check(shape, budget).plan
    assert _modes(plan) == {"inner.layers.0": "autograd"}
    autograd = _plan(shape, budget, remat_compiler.solvers.solve_cpsat)
    assert plan.recompute_s == pytest.approx(autograd.recompute_s, rel=1e-9)
    assert plan.recompute_s < _plan(shape, budget, "moe_cpsat").recompute_s


def test_loose_budget_choice_is_exact_explained_and_reapplied(tmp_path):
    """No budget: the choice is still exact and recorded; explain() names each segment's combine and
    why; the saved plan, applied to a fresh model, traces the same combines and is exact again."""
    x = worker.make_tokens(SHAPE)
    module = _compile_and_check(SHAPE, None)
    plan = module.plan
    assert set(_modes(plan)) == set(SEGMENTS)
    text = plan.explain()
    for seg, mode in _modes(plan).items():
        line = next(ln for ln in text.splitlines() if f"{seg}: {mode}:" in ln)
        other = "autograd" if mode == "fused" else "fused"
        assert "chosen in the one CP-SAT solve with the saved set" in line
        assert f"with the {other} combine here and the same saved set" in line
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.extras["moe_combine"] == plan.extras["moe_combine"]
    model = worker.make_model(SHAPE)
    again = remat_compiler.compile(model, plan=loaded)
    assert_same(token_step(again, x), token_step(worker.make_model(SHAPE), x), "reapplied", **TOL)
    assert again.planned.source == "given" and again.plan.fingerprint == plan.fingerprint
    assert combine_modes_of(model) == {s: "autograd" for s in SEGMENTS}
    assert_exact(again, x, "reapplied")


def test_a_chosen_plan_applies_again_under_the_same_fraction(x, tmp_path):
    """A fraction budget is of the model's no-recompute peak (every combine autograd) both when the
    combines are chosen and when the saved plan is applied: the round trip at 0.85 keeps the choice
    (it was refused, the fraction resolved on the chosen graph's smaller peak). The first choice runs
    on CP-SAT's deterministic time: at 0.85 fused and autograd are close here (0.025 ms against 0.026
    ms of recompute), and a wall-clock solve on a loaded machine once chose autograd for both."""
    first = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), memory_budget=0.85, time_limit_s=1,
                                      deterministic=True).plan
    assert "fused" in _modes(first).values()  # a fused segment lowers the chosen graph's own peak
    first.save(tmp_path / "plan.json")
    again = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), memory_budget=0.85,
                                      plan=Plan.load(tmp_path / "plan.json"))
    assert again.source == "given" and again.plan.digest() == first.digest()
    assert again.plan.budget_bytes == first.budget_bytes


def test_other_solvers_and_a_fused_model_plan_as_before(x):
    """The choice is the default solver's on models left at combine='autograd': moe_cpsat plans
    the fused combine everywhere, and a model whose user chose the fused combine keeps it."""
    assert set(_modes(_plan(SHAPE, None, "moe_cpsat")).values()) == {"fused"}
    model = worker.make_model(SHAPE)
    with fused_combine_mode(model):
        plan = remat_compiler.plan_model(model, (x,), time_limit_s=5).plan
    assert set(_modes(plan).values()) == {"fused"}
    assert "chosen in the one CP-SAT solve" not in plan.explain()
    # ... and says why, per segment
    for seg, c in plan.extras["moe_combine"].items():
        assert c["why"] == "no choice: its combine='fused' is the user's", (seg, c)
        line = next(ln for ln in plan.explain().splitlines() if f"{seg}: fused:" in ln)
        assert line.endswith("; no choice: its combine='fused' is the user's"), line


def test_a_users_fused_layer_is_kept_and_the_others_chosen(x):
    """Layer 0 built fused by its user, layer 1 left at the default: the default compile keeps layer
    0's combine (no choice, saying why) and still chooses layer 1's in its one solve; the step
    equals the same model run eagerly and measures the predicted peak."""
    module = remat_compiler.compile(mixed_model(), time_limit_s=10)
    assert_same(token_step(module, x), token_step(mixed_model(), x), "user-fused layer 0", **TOL)
    assert_exact(module, x, "user-fused layer 0")
    combine = module.plan.extras["moe_combine"]
    assert combine["inner.layers.0"]["mode"] == "fused"
    assert combine["inner.layers.0"]["why"] == "no choice: its combine='fused' is the user's"
    assert "chosen in the one CP-SAT solve" in combine["inner.layers.1"]["why"]
    assert moe_combine_of(module.planned.cg) == {s: {k: c[k] for k in ("mode", "y_bytes")} for s, c in combine.items()}
    lines = module.plan.explain().splitlines()
    for seg, c in combine.items():
        line = next(ln for ln in lines if f"{seg}: {c['mode']}:" in ln)
        assert line.endswith(f"; {c['why']}"), line


def test_a_budget_no_choice_meets_falls_back_to_the_model_as_it_is(x):
    """Below every plan's peak the one solve finds nothing, and the model is planned as it is
    (combine='autograd'), whose lowest-peak search names the smallest feasible budget."""
    with pytest.raises(remat_compiler.InfeasibleBudgetError, match="smallest feasible budget"):
        remat_compiler.plan_model(worker.make_model(SHAPE), (x,), memory_budget=10_000, time_limit_s=3)


def test_the_fallback_solve_runs_on_the_choice_clock(x, monkeypatch):
    """The union solve and the fallback to the model as it is share one time_limit_s: the fallback's
    solve_cpsat runs on the clock the choice started (its solve time counts the choice's), instead
    of a fresh time_limit_s after it."""
    import time

    import remat_compiler.combines as combines

    clocks = []

    def finds_none(union, budget_bytes, **options):
        clocks.append(options["deadline"])
        time.sleep(1.0)  # the choice's search, spent
        raise remat_compiler.InfeasibleBudgetError(budget_bytes or 0, budget_bytes or 0, proven=False)
    monkeypatch.setattr(combines, "solve_choice", finds_none)
    plan = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), time_limit_s=5).plan
    assert len(clocks) == 1  # the model as it is, by solve_cpsat, which says why in explain()
    modes = {seg: c["mode"] for seg, c in plan.extras["moe_combine"].items()}
    assert modes == dict.fromkeys(SEGMENTS, "autograd")
    assert all(c["why"].startswith("not chosen: the one CP-SAT solve over both combines found no plan")
               for c in plan.extras["moe_combine"].values()), plan.extras
    assert f"{SEGMENTS[1]}: autograd: " in plan.explain() and "found no plan under the budget" in plan.explain()
    assert plan.solve_time_s >= 1.0 and clocks[0].elapsed() >= plan.solve_time_s


def test_a_progress_callback_does_not_turn_the_choice_off(cached_choice):
    """The CLI passes progress= whenever it shows progress (a terminal, --progress): the plan must
    not depend on that. The choice still runs (its solve is silent; the plan is
    :func:`cached_choice`'s, made with a progress callback)."""
    from remat_compiler.api import PlanSpec, chooses_combines

    assert chooses_combines(PlanSpec.make(None, "cpsat", {"progress": print}), worker.make_model(SHAPE))
    plan, _, _ = cached_choice
    assert all("chosen in the one CP-SAT solve" in c["why"] for c in plan.extras["moe_combine"].values()), plan.extras


def test_explains_comparisons_stop_at_their_share_of_the_time_limit(x, monkeypatch):
    """Each comparison explain() makes traces the step again after the solve: with no time set aside
    for them none is made (no third trace), and each segment says it was not compared."""
    import remat_compiler.api as api
    import remat_compiler.combines as combines

    traces = []
    real = api.trace_for_planning
    monkeypatch.setattr(api, "trace_for_planning", lambda *a, **k: traces.append(1) or real(*a, **k))
    monkeypatch.setattr(combines, "COMPARE_SHARE", 0.0)
    monkeypatch.setattr(combines, "COMPARE_MIN_S", 0.0)
    plan = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), time_limit_s=5).plan
    assert len(traces) == 3  # autograd, fused, then the chosen combines: no flipped one
    for c in plan.extras["moe_combine"].values():
        assert c["why"].startswith("chosen in the one CP-SAT solve") and "not compared with the" in c["why"], c


def test_a_deterministic_choice_repeats_itself(x):
    """deterministic=True: the choice runs on CP-SAT's deterministic time (its warm start to the end),
    so two plannings give the same combines and saved set, whatever the machine's load."""
    plans = [remat_compiler.plan_model(worker.make_model(SHAPE), (x,), memory_budget=300_000, time_limit_s=1,
                                       deterministic=True).plan for _ in range(2)]
    assert all("chosen in the one CP-SAT solve" in c["why"] for c in plans[0].extras["moe_combine"].values())
    assert _modes(plans[0]) == _modes(plans[1]) and plans[0].saved == plans[1].saved
    assert plans[0].peak_bytes <= 300_000


def test_a_search_that_finds_nothing_in_time_returns_its_warm_start(union, monkeypatch):
    """The warm start is a whole plan under the budget (the fill solve completes it): when the
    search finds no plan in its time, the choice is that plan, feasible with its gap, and not a
    fallback to the model as it is."""
    from ortools.sat.python import cp_model

    import remat_compiler.solvers.cpsat.choice as choice_module

    calls, real = [], choice_module.run_solver

    def search_finds_none(solver, model, **kwargs):
        calls.append(solver.parameters.fix_variables_to_their_hinted_value)
        status = real(solver, model, **kwargs)
        return status if len(calls) == 1 else cp_model.UNKNOWN  # as a search stopped before a solution
    monkeypatch.setattr(choice_module, "run_solver", search_finds_none)
    choice = solve_choice(union, 300_000, time_limit_s=5)
    assert calls[:2] == [True, False]  # the fill, then the search
    assert choice.status == "feasible" and 0.0 <= choice.gap <= 1.0
    assert choice.model_peak_bytes <= 300_000
    cg = union.graphs[next(iter(set(choice.modes.values())))]
    assert len(set(choice.modes.values())) == 1 and peak_of(cg, choice.saved) <= 300_000
    # not even the fill finished: the warm start's own plan, its peak simulated on its graph
    monkeypatch.setattr(choice_module, "run_solver", lambda *a, **k: real(*a, **k) and cp_model.UNKNOWN)
    warm = solve_choice(union, 300_000, time_limit_s=1)
    (mode,) = set(warm.modes.values())
    assert warm.status == "feasible" and sorted(warm.modes) == list(SEGMENTS)
    assert warm.model_peak_bytes == peak_of(union.graphs[mode], warm.saved) <= 300_000
    with pytest.raises(remat_compiler.InfeasibleBudgetError):  # no warm start fits: none found
        solve_choice(union, 10_000, time_limit_s=1)


@pytest.mark.parametrize("budget", [None, 300_000, 250_000])
def test_the_one_model_peak_is_the_chosen_graph_simulated(union, x, budget):
    """The union model's peak is the simulated peak of the saved set on the graph traced with the
    chosen combines: exact, not a bound (the union runs both pieces of each segment)."""
    assert len(union_steps(union)) == sum(len(union.graphs[m].bw_order) for m in ("autograd", "fused")) \
        - len(union.shared)
    choice = solve_choice(union, budget, time_limit_s=10)
    assert choice.status == "optimal"
    model = worker.make_model(SHAPE)
    with combine_modes(model, choice.modes):
        _, cg = analyze(model, (x,))
    assert peak_of(cg, choice.saved) == choice.model_peak_bytes
    assert budget is None or choice.model_peak_bytes <= budget


def test_costs_that_would_overflow_a_lexicographic_objective_still_choose(x, monkeypatch):
    """At real sizes ``cost * (peak_hi + 1) + peak`` overflows int64 (MODEL_INVALID, which was taken
    for an infeasible budget and the choice silently dropped): here a device 1e10 times slower than
    the default gives the small stack such costs. The model validates and the two-stage solve
    chooses, at the least peak of the least cost."""
    from remat_compiler.passes import CostModel

    slow = CostModel(compute_flops_per_s=10.0, memory_bytes_per_s=2.0)
    model = worker.make_model(SHAPE)
    big = align_combines(analyze(model, (x,), cost_model=slow)[1],
                         analyze(model, (x,), solver="moe_cpsat", cost_model=slow)[1])
    assert build_choice_model(big, None).model.validate() == ""
    choice = solve_choice(big, 300_000, time_limit_s=10)
    assert choice.status == "optimal" and choice.gap == 0.0 and set(choice.modes) == set(SEGMENTS)
    assert choice.model_peak_bytes <= 300_000
    from ortools.sat.python import cp_model

    import remat_compiler.solvers.cpsat.choice as choice_module

    monkeypatch.setattr(choice_module, "run_solver", lambda *a, **k: cp_model.MODEL_INVALID)
    with pytest.raises(RuntimeError, match="combine-choice CP-SAT model is invalid"):  # never "infeasible"
        solve_choice(big, 300_000, time_limit_s=1)


def test_a_feasible_choice_reports_its_gap_and_the_simulated_peak(x, monkeypatch):
    """A solve stopped before it proved its peak: its peak variable is only a bound. The plan keeps
    the solve's status and gap (it reported gap 0.0), and explain() compares the simulated peak of
    the chosen graph, not the bound, with the other combine's."""
    import dataclasses

    import remat_compiler.combines as combines
    from remat_compiler.budget import human_bytes

    def loose(*args, **kwargs):
        choice = solve_choice(*args, **kwargs)
        return dataclasses.replace(choice, model_peak_bytes=choice.model_peak_bytes + 50_000,
                                   status="feasible", gap=0.25)
    monkeypatch.setattr(combines, "solve_choice", loose)
    plan = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), memory_budget=300_000, time_limit_s=5).plan
    assert plan.status == "feasible" and plan.gap == 0.25
    assert plan.model_peak_bytes == plan.peak_bytes + 50_000
    for c in plan.extras["moe_combine"].values():
        assert f"step peak {human_bytes(plan.peak_bytes)}, against" in c["why"], c["why"]


def test_a_plan_cache_keeps_the_chosen_combines(x, tmp_path):
    """With plan_cache=, the chosen plan is stored once and a fresh model's compile applies it: the
    same combines and saved set, exact again."""
    first = remat_compiler.compile(worker.make_model(SHAPE), 300_000, time_limit_s=10, plan_cache=tmp_path)
    token_step(first, x)
    files = list(tmp_path.glob("*.plan.json"))
    assert len(files) == 1
    again = remat_compiler.compile(worker.make_model(SHAPE), 300_000, time_limit_s=10, plan_cache=tmp_path)
    assert_same(token_step(again, x), token_step(worker.make_model(SHAPE), x), "cached", **TOL)
    assert again.plan.digest() == first.plan.digest() and list(tmp_path.glob("*.plan.json")) == files
    assert "chosen in the one CP-SAT solve" in again.plan.explain()
    assert_exact(again, x, "cached")


def test_a_cache_hit_traces_only_the_model_and_the_recorded_combines(x, tmp_path, cached_choice, monkeypatch):
    """A hit needs the graph as the model is (the key) and the graph of the recorded combines (to
    verify the plan on), then the pipeline's own trace: not the all-fused graph nor the union."""
    import remat_compiler.api as api

    first, name, text = cached_choice
    (tmp_path / name).write_text(text)
    traced = []
    monkeypatch.setattr(api, "trace", lambda *a, **k: traced.append(1) or trace(*a, **k))
    again = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), time_limit_s=5, plan_cache=tmp_path)
    assert again.plan.digest() == first.digest()
    assert len(traced) == (2 if set(_modes(first).values()) == {"autograd"} else 3)


def _tamper(path, mode, *, fix_digest: bool) -> None:
    """Set the first segment's recorded combine mode in a cache file to ``mode``; with
    ``fix_digest`` the plan's digest is recomputed, so only the mode itself is wrong."""
    import json

    from remat_compiler.plan import _document_digest

    doc = json.loads(path.read_text())
    plan = json.loads(doc["plan"])
    plan["extras"]["moe_combine"][next(iter(plan["extras"]["moe_combine"]))]["mode"] = mode
    if fix_digest:
        plan.pop("digest")
        version = plan.pop("schema_version")
        plan = {**plan, "schema_version": version, "digest": _document_digest(plan)}
    doc["plan"] = json.dumps(plan)
    path.write_text(json.dumps(doc))


@pytest.fixture(scope="module")
def cached_choice(x, tmp_path_factory):
    """A plan cache holding the chosen plan of SHAPE with no budget, planned with a progress
    callback as the CLI passes one: (the plan, its file's name, its text)."""
    d = tmp_path_factory.mktemp("cache")
    plan = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), time_limit_s=5, plan_cache=d,
                                     progress=lambda *_: None).plan
    (path,) = d.glob("*.plan.json")
    return plan, path.name, path.read_text()


@pytest.mark.parametrize("mode, fix_digest", [(["fused"], False), ("custom", True)])
def test_a_corrupt_recorded_combine_is_reported_and_replanned(x, tmp_path, cached_choice, mode, fix_digest):
    """A cache file whose recorded combine is not a mode (a list, an unknown name), with or without
    a digest that matches, is reported with a PlanCacheWarning and re-planned; the new plan replaces
    it. (A list crashed the compile with TypeError.)"""
    from remat_compiler.plan_cache import PlanCache, PlanCacheWarning

    first, name, text = cached_choice
    path = tmp_path / name
    path.write_text(text)
    _tamper(path, mode, fix_digest=fix_digest)
    with pytest.warns(PlanCacheWarning, match="not a valid plan for this step"):
        again = remat_compiler.plan_model(worker.make_model(SHAPE), (x,), time_limit_s=5, plan_cache=tmp_path)
    # solved again, a choice for every segment (which one may differ from the first's: a 5 s solve on a
    # loaded machine can stop at a tie-break the first one finished)
    assert again.source == "solved" and sorted(_modes(again.plan)) == sorted(_modes(first)) == list(SEGMENTS)
    assert PlanCache(tmp_path).recorded_combines(name.split(".")[0], SEGMENTS) == _modes(again.plan)
