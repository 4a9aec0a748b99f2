"""CP-SAT against brute force on random small graphs, and every solver through one validator."""
from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.check import check_plan
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.schedule import build_schedule, simulate
from remat_compiler.solvers.cpsat import cost_units, plan_cost_units, solve_cpsat
from remat_compiler.solvers.cpsat.run import new_solver


class RandomDAG(nn.Module):
    """A random DAG of matmuls and pointwise ops over tensors of a few different widths."""

    OPS = ("matmul", "tanh", "sigmoid", "mul", "add", "relu")

    def __init__(self, seed: int, n_ops: int):
        super().__init__()
        rng = random.Random(seed)
        self.widths = [rng.choice([4, 8, 16])]
        self.spec = []
        self.mats = nn.ParameterList()
        for i in range(n_ops):
            op = rng.choice(self.OPS)
            a = rng.randrange(len(self.widths))
            if op == "matmul":
                w_out = rng.choice([4, 8, 16, 32])
                self.mats.append(nn.Parameter(torch.randn(self.widths[a], w_out) * 0.3))
                self.spec.append((op, a, len(self.mats) - 1))
                self.widths.append(w_out)
            elif op in ("mul", "add"):
                same = [j for j, w in enumerate(self.widths) if w == self.widths[a]]
                self.spec.append((op, a, rng.choice(same)))
                self.widths.append(self.widths[a])
            else:
                self.spec.append((op, a, None))
                self.widths.append(self.widths[a])

    def forward(self, x):
        vals = [x]
        for op, a, b in self.spec:
            if op == "matmul":
                vals.append(vals[a] @ self.mats[b])
            elif op == "mul":
                vals.append(vals[a] * vals[b])
            elif op == "add":
                vals.append(vals[a] + vals[b])
            else:
                vals.append(getattr(torch, op)(vals[a]))
        return sum(v.sum() for v in vals[-2:])


@functools.lru_cache(maxsize=None)
def _every_plan(cg):
    """Every saved set's simulated (node-level) peak and what its schedule recomputes: the brute
    force's 2^len(candidates) schedules, built and simulated once per graph instead of once per
    budget, objective and test (no test changes a graph; :func:`_graph` returns the same one)."""
    plans = []
    for k in range(len(cg.candidates) + 1):
        for subset in itertools.combinations(cg.candidates, k):
            schedule = build_schedule(cg, subset)
            plans.append((simulate(cg, schedule).peak_bytes, tuple(schedule.recomputed)))
    return tuple(plans)


@functools.lru_cache(maxsize=None)
def _plan_costs(cg, objective):
    """Each of :func:`_every_plan`'s plans as (peak, summed ``cost_units`` of what it recomputes)."""
    return tuple((peak, sum(cost_units(cg, n, objective) for n in recomputed))
                 for peak, recomputed in _every_plan(cg))


def _peaks(cg):
    """The distinct simulated peaks of every saved set, ascending: the budgets a plan can reach."""
    return sorted({peak for peak, _ in _every_plan(cg)})


def brute_force(cg, budget, objective="runtime"):
    """Cheapest plan whose simulated (node-level) peak fits: what CP-SAT must find."""
    fitting = [cost for peak, cost in _plan_costs(cg, objective) if peak <= budget]
    return min(fitting) if fitting else None


@functools.lru_cache(maxsize=None)
def _graph(seed):
    """A random DAG's model, input and cost graph, traced once per seed for every test here that
    takes it (none changes the graph: the solvers, the simulator and the checks only read it)."""
    torch.manual_seed(seed)
    model = RandomDAG(seed, n_ops=random.Random(seed).randint(7, 10))
    x = torch.randn(128, model.widths[0], requires_grad=True)
    gm, cg = rc.analyze(model, (x,))
    return model, x, cg


@pytest.mark.parametrize("seed", range(8))
def test_cpsat_matches_brute_force(seed):
    model, x, cg = _graph(seed)
    assert 1 <= len(cg.candidates) <= 12
    peaks = _peaks(cg)
    for budget in sorted(set([peaks[0], peaks[len(peaks) // 3], peaks[len(peaks) // 2], peaks[-1]])):
        plan = solve_cpsat(cg, budget, time_limit_s=20, num_workers=2)
        check_plan(cg, plan)
        assert plan.status == "optimal"
        assert plan.peak_bytes <= budget
        assert plan_cost_units(cg, plan) == brute_force(cg, budget), (seed, budget)
    with pytest.raises(InfeasibleBudgetError) as err:
        solve_cpsat(cg, peaks[0] - 1, time_limit_s=20, num_workers=2, reruns=False)
    assert err.value.min_feasible_bytes == peaks[0]
    # recomputing a value twice may go below every single-recomputation plan
    try:
        plan = solve_cpsat(cg, peaks[0] - 1, time_limit_s=20, num_workers=2)
    except InfeasibleBudgetError as exc:
        assert exc.min_feasible_bytes == peaks[0]
    else:
        check_plan(cg, plan)
        assert plan.rerun and plan.peak_bytes <= peaks[0] - 1


@pytest.mark.parametrize("seed", range(3))
def test_a_tolerance_stops_within_that_share_of_the_step_and_says_it_is_not_a_proof(seed):
    """With ``tolerance``, the plan's cost is at most the brute-force optimum plus that fraction of
    the whole step's estimated cost; its status says "optimal" only where it is the optimum."""
    from remat_compiler.solvers.cpsat.costs import step_cost_units

    model, x, cg = _graph(seed)
    peaks = _peaks(cg)
    budget = peaks[len(peaks) // 3]
    best = brute_force(cg, budget)
    step = step_cost_units(cg)
    assert best > 0 and step > best
    plan = solve_cpsat(cg, budget, time_limit_s=20, num_workers=2, tolerance=0.5)
    check_plan(cg, plan)
    cost = plan_cost_units(cg, plan)
    assert plan.peak_bytes <= budget and best <= cost <= best + 0.5 * step
    assert plan.extras["tolerance"] == 0.5
    assert (plan.status == "optimal") == (plan.extras["cost_bound_units"] >= cost)
    if plan.status == "optimal":
        assert cost == best
    else:  # explain() says the search stopped within the tolerance, not at a proof
        assert "stopped within 50% of the step's estimated cost" in plan.explain().splitlines()[0]


def test_a_tolerance_outside_zero_to_one_is_refused_by_name():
    model, x, cg = _graph(0)
    for bad in (-0.1, 1.0, "1%", True):
        with pytest.raises(ValueError, match="tolerance="):
            solve_cpsat(cg, None, tolerance=bad)


_MOE_GRAPHS = {}


def _traced_as(strategy, model, x):
    """The cost graph of ``model`` on ``x`` as ``strategy`` traces it, traced once per ``prepare``:
    rc.analyze depends on the solver only through its ``prepare`` (the model as it is traced), so the
    six registered solvers without one trace the same graph, and the two with fused_combine_mode
    another. Each test builds the same model from the same seed; rc.compile(plan=...) checks that
    the plan's graph is its model's (the fingerprint), so a graph that were not would fail there."""
    if strategy.prepare not in _MOE_GRAPHS:
        _MOE_GRAPHS[strategy.prepare] = rc.analyze(model, (x,), solver=strategy.name)[1]
    return _MOE_GRAPHS[strategy.prepare]


@pytest.mark.parametrize("solver", sorted(rc.SOLVERS))
def test_every_solver_passes_the_shared_validator_and_keeps_gradients(solver):
    """Every registered solver, on a model it applies to (a stack of MoE layers: repeated blocks and
    MoE segments), at a budget below the no-recompute peak for those that search: the plan passes
    check_plan and the compiled step's gradients are eager's."""
    from remat_compiler.moe import MoEStack

    torch.manual_seed(3)
    model = MoEStack(3, 16, 24, num_experts=4, top_k=2).double()
    x = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    strategy = rc.SOLVERS[solver]
    cg = _traced_as(strategy, model, x)
    budget = int(0.9 * simulate(cg, build_schedule(cg, cg.candidates)).peak_bytes) if strategy.searching else None
    options = strategy.options_in({"time_limit_s": 5.0, "num_workers": 2})
    plan = rc.solve(cg, budget, solver, **options)
    assert plan.solver == solver and (budget is None or plan.peak_bytes <= budget)
    check_plan(cg, plan)
    compiled = rc.compile(model, solver=solver, plan=plan)
    for p in model.parameters():
        p.grad = None
    x.grad = None
    compiled(x).square().sum().backward()
    got = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_check_plan_rejects_a_tampered_plan():
    model, x, cg = _graph(1)
    plan = solve_cpsat(cg, None, time_limit_s=5)
    plan.peak_bytes -= 1
    with pytest.raises(rc.PlanCheckError, match="simulated peak"):
        check_plan(cg, plan)


def test_random_graphs_have_real_trade_offs():
    """Guard against a vacuous optimality test: most graphs must need recomputation at their minimum."""
    nontrivial = 0
    for seed in range(8):
        model, x, cg = _graph(seed)
        peaks = _peaks(cg)
        nontrivial += len(peaks) > 1 and brute_force(cg, peaks[0]) > 0
    assert nontrivial >= 6


@pytest.mark.parametrize("seed", range(4))
def test_model_peak_is_the_simulated_peak_for_every_saved_set(seed):
    """With the decisions fixed, CP-SAT's least peak is the simulator's node-level peak, to the unit.

    Under-counting would let CP-SAT accept plans that do not fit; over-counting would lose plans."""
    from ortools.sat.python import cp_model

    from remat_compiler.solvers.cpsat import build_model

    model, x, cg = _graph(seed)
    rng = random.Random(seed)
    subsets = [tuple(c for c in cg.candidates if rng.random() < 0.5) for _ in range(6)]
    subsets += [(), tuple(cg.candidates)]
    for subset in subsets:
        subset = build_schedule(cg, subset).saved  # what backward reads of it
        rm = build_model(cg, None, minimize="peak", forced_saved=subset,
                         forbidden_saved=[c for c in cg.candidates if c not in subset])
        solver = new_solver()  # as the library's: SIGINT is left to Python
        solver.parameters.num_workers = 2
        assert solver.solve(rm.model) == cp_model.OPTIMAL
        expected = simulate(cg, build_schedule(cg, subset)).peak_bytes
        assert solver.value(rm.peak) * rm.unit_bytes == expected, (seed, subset)


def test_model_peak_is_exact_on_multi_output_ops_and_dropped_outputs():
    """The same exactness on a tiny HuggingFace Mixtral, whose graph has multi-output ops (topk, sort,
    split, nll_loss_forward, the experts' grouped-matmul backward), with its logits not held."""
    from ortools.sat.python import cp_model
    from tiny_models import tiny_mixtral

    from remat_compiler.solvers.cpsat import build_model

    model = tiny_mixtral(num_local_experts=4)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _, cg = rc.analyze(model, (), {"input_ids": ids, "labels": ids}, hold_outputs=False)
    assert sum(cg.attr(n, "is_tuple") for n in cg.fw_order) >= 4
    rng = random.Random(0)
    for _ in range(4):
        subset = build_schedule(cg, [c for c in cg.candidates if rng.random() < 0.5]).saved
        rm = build_model(cg, None, minimize="peak", forced_saved=subset,
                         forbidden_saved=[c for c in cg.candidates if c not in subset])
        solver = new_solver()  # as the library's: SIGINT is left to Python
        solver.parameters.num_workers = 2
        assert solver.solve(rm.model) == cp_model.OPTIMAL
        assert solver.value(rm.peak) * rm.unit_bytes == simulate(cg, build_schedule(cg, subset)).peak_bytes


@pytest.mark.parametrize("seed", range(3))
def test_cpsat_matches_brute_force_on_counted_flops(seed):
    """objective="flops": FLOPs decide (memory-bound ops count one unit each), still optimal."""
    model, x, cg = _graph(seed)
    peaks = _peaks(cg)
    for budget in sorted({peaks[0], peaks[len(peaks) // 3]}):
        plan = solve_cpsat(cg, budget, time_limit_s=20, num_workers=2, objective="flops")
        check_plan(cg, plan)
        assert plan.status == "optimal" and plan.extras["objective"] == "flops"
        assert plan_cost_units(cg, plan, "flops") == brute_force(cg, budget, "flops"), (seed, budget)
        # the FLOP-only gap is a valid bound: no fitting plan has fewer kFLOPs than it allows
        kflops = sum(cg.attr(n, "flops") // 1000 for n in set(plan.recomputed) if cg.attr(n, "runtime_s") > 0)
        least = min(sum(cg.attr(n, "flops") // 1000 for n in set(recomputed) if cg.attr(n, "runtime_s") > 0)
                    for peak, recomputed in _every_plan(cg) if peak <= budget)
        gap = plan.extras["flop_gap"]
        assert 0.0 <= gap <= 1.0 and kflops * (1 - gap) <= least + 1e-9, (seed, budget, kflops, gap, least)
        assert kflops > 0 or gap == 0.0
        assert plan.gap == 0.0 and "tiebreak_gap" in plan.extras
    with pytest.raises(ValueError, match="objective"):
        solve_cpsat(cg, peaks[-1], objective="bytes")


def test_flops_status_is_that_of_counted_flops():
    """Under objective="flops" the per-op unit only breaks ties: a plan recomputing no counted FLOPs is
    optimal whatever CP-SAT proved about the tie-break, and otherwise the gap is the FLOP gap."""
    from remat_compiler.solvers.cpsat.costs import flop_gap, flops_status

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    _, cg = rc.analyze(model, (torch.randn(64, 64, requires_grad=True),))
    kinds = {}
    for k in range(len(cg.candidates) + 1):
        for S in itertools.combinations(cg.candidates, k):
            rec = set(build_schedule(cg, S).recomputed)
            kflops = sum(cg.attr(n, "flops") // 1000 for n in rec if cg.attr(n, "runtime_s") > 0)
            kinds.setdefault("matmul" if kflops else "pointwise" if rec else "none", S)
    assert {"matmul", "pointwise"} <= set(kinds)
    for kind, S in kinds.items():
        recomputed = build_schedule(cg, S).recomputed
        status, gap, extras = flops_status(cg, recomputed, "feasible", 0.5, 1.0)
        assert extras["tiebreak_gap"] == 0.5
        if kind != "matmul":  # no counted FLOPs recomputed: no plan can do better
            assert status == "optimal" and gap == 0.0
        else:
            assert status == "feasible" and gap == flop_gap(cg, recomputed, 1.0) > 0


@pytest.mark.parametrize("seed", range(4))
def test_lp_bound_is_below_every_fitting_plan(seed):
    """The LP relaxation's value bounds the cost of every plan that fits, at every budget, and it
    is not vacuous: where every fitting plan recomputes something costly, it is positive."""
    from remat_compiler.solvers.cpsat import build_model
    from remat_compiler.solvers.cpsat.lp import lp_bound

    _model, _x, cg = _graph(seed)
    peaks = _peaks(cg)
    positive = 0
    for budget in sorted(set(peaks[:: max(1, len(peaks) // 6)])):
        rm = build_model(cg, budget, objective="runtime")
        bound = lp_bound(rm)
        best = brute_force(cg, budget, "runtime")
        assert bound is not None and bound * rm.cost_gcd <= best, (seed, budget, bound, best)
        positive += bound > 0
    assert positive >= 1


def test_step_bounds_keep_only_those_no_other_implies(monkeypatch):
    """Forward bounds gain terms over time and backward bounds lose them, so a forward bound with a
    later one at least as large, or a backward bound with an earlier one, is implied; dropping the
    implied ones leaves the LP relaxation's value unchanged."""
    import remat_compiler.solvers.cpsat.model as cpsat_model
    from remat_compiler.solvers.cpsat import build_model
    from remat_compiler.solvers.cpsat.lp import lp_bound
    from remat_compiler.solvers.cpsat.model import _undominated

    assert _undominated([1, 5, 3, 2, 4, 7, 6, 8, 2], F=5) == [1, 4, 5, 7]
    _model, _x, cg = _graph(2)
    budget = _peaks(cg)[0]
    pruned = lp_bound(build_model(cg, budget))
    monkeypatch.setattr(cpsat_model, "_undominated", lambda const, F: list(range(len(const))))
    every = lp_bound(build_model(cg, budget))
    assert pruned is not None and abs(pruned - every) <= 1e-6 * max(1, abs(every)) + 1
