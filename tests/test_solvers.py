"""The solver registry: declared fields, one way to refuse an option, and strategies that do not
apply saying so with their own error; the one clock every CP-SAT phase takes its time from."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import remat_compiler as rc
from remat_compiler.clock import MIN_SLICE_S, Deadline
from remat_compiler.errors import StrategyNotApplicableError
from remat_compiler.graph import block_boundary_set, block_stack
from remat_compiler.moe.layer import fused_combine_mode
from remat_compiler.schedule import peak_of
from remat_compiler.solvers import SOLVERS, Strategy, get_solver


def _mlp_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    return rc.analyze(model, (torch.randn(8, 32),))[1]


def test_the_table_declares_what_each_solver_takes():
    assert all(isinstance(s, Strategy) and s.name == name for name, s in SOLVERS.items())
    assert {n for n, s in SOLVERS.items() if s.searching} == {"cpsat", "greedy", "moe_cpsat"}
    assert {n for n, s in SOLVERS.items() if s.accepts_policy} == {"cpsat", "moe_cpsat"}
    assert {n for n, s in SOLVERS.items() if s.prepare is not None} == {"moe_custom", "moe_cpsat"}
    assert SOLVERS["moe_custom"].prepare is fused_combine_mode
    with pytest.raises(TypeError):
        SOLVERS["mine"] = SOLVERS["cpsat"]  # the table is fixed: pass your own solver as solver=


@pytest.mark.parametrize("name", ["save_all", "checkpoint_blocks", "greedy", "cpsat", "moe_fast"])
def test_every_solver_refuses_an_option_it_does_not_take_the_same_way(name):
    cg = _mlp_graph()
    with pytest.raises(ValueError, match=f"solver {name!r} takes no option bogus_option"):
        rc.solve(cg, None, name, bogus_option=1)
    with pytest.raises(ValueError, match="takes no option"):
        rc.compile(nn.Linear(2, 2), solver=name, bogus_option=1)


def test_hand_picked_strategies_take_no_time_limit_and_a_comparison_passes_only_what_each_takes():
    with pytest.raises(ValueError, match="'save_all' takes no option time_limit_s .its options: none"):
        rc.compile(nn.Linear(2, 2), solver="save_all", time_limit_s=5)
    line = {"time_limit_s": 5.0, "progress": None, "objective": "flops"}
    assert get_solver("save_all").options_in(line) == {}
    assert get_solver("greedy").options_in(line) == {"time_limit_s": 5.0}
    assert get_solver("cpsat").options_in(line) == {"time_limit_s": 5.0, "objective": "flops"}


def test_a_callable_is_a_solver_that_takes_what_it_accepts():
    cg = _mlp_graph()
    seen = {}

    def mine(cg, budget_bytes, *, flavour):
        seen["flavour"] = flavour
        return rc.solve(cg, budget_bytes, "save_all")
    assert rc.solve(cg, None, mine, flavour="x").solver == "save_all" and seen == {"flavour": "x"}
    assert get_solver(mine).name == "mine" and get_solver(mine).options is None


class _Flat(nn.Module):
    """Two layers as plain attributes: no ModuleList or Sequential, so no repeated blocks."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).square().mean()


def test_a_strategy_that_does_not_apply_says_so_and_what_to_use():
    torch.manual_seed(0)
    cg = rc.analyze(_Flat(), (torch.randn(8, 32),))[1]
    assert block_boundary_set(cg) is None and block_stack(cg) is None
    with pytest.raises(StrategyNotApplicableError, match="use solver='cpsat'"):
        rc.solve(cg, None, "checkpoint_blocks")
    with pytest.raises(StrategyNotApplicableError, match="needs an MoE block"):
        rc.solve(cg, None, "moe_origin")
    with pytest.raises(ValueError, match="policy constrains CP-SAT"):
        rc.compile(nn.Linear(2, 2), solver="greedy", policy=rc.policies.save_matmuls)


def test_greedy_is_bounded_by_its_time_limit():
    from remat_compiler.examples.models import MLPChain
    from remat_compiler.schedule import peak_of

    torch.manual_seed(0)
    cg = rc.analyze(MLPChain(64, 8), (torch.randn(64, 64),))[1]
    budget = peak_of(cg, block_boundary_set(cg))  # per-block checkpointing fits it: greedy starts there
    t0 = time.perf_counter()
    plan = rc.solve(cg, budget, "greedy", time_limit_s=0.5)
    assert time.perf_counter() - t0 < 5 and plan.peak_bytes <= budget and plan.status == "feasible"


def test_a_deadline_hands_out_slices_of_what_is_left():
    clock = Deadline(10.0)
    assert 9.0 < clock.left() <= 10.0 and not clock.expired()
    assert clock.slice(0.5) == pytest.approx(clock.left() * 0.5, rel=1e-3)
    assert clock.slice(cap=2.0) == 2.0
    part = clock.part(3.0)
    assert part.left() <= 3.0 and part.seconds == 3.0
    assert clock.part(100.0).seconds <= 10.0  # a phase ends no later than the whole
    spent = Deadline(0.0)
    assert spent.expired() and spent.slice() == MIN_SLICE_S and spent.part(5.0).seconds == MIN_SLICE_S


def test_plan_models_time_limit_bounds_the_whole_call_tracing_included(monkeypatch):
    """plan_model(..., time_limit_s=T) (the CLI's plan --time-limit): the trace is taken from T and
    the solve runs on what is left; without a limit, or deterministic (CP-SAT's own time), the solver
    makes its own clock of its limit after the trace."""
    import remat_compiler.api as api
    from remat_compiler.examples.models import MLPChain
    from remat_compiler.solvers.cpsat import OPTIONS, solve_cpsat

    clocks = []

    def spy(cg, budget_bytes, **options):
        clocks.append(options.get("deadline"))
        return solve_cpsat(cg, budget_bytes, **options)
    traced = api.trace_for_planning
    monkeypatch.setattr(api, "trace_for_planning", lambda *a, **k: time.sleep(1.5) or traced(*a, **k))
    strategy = Strategy("cpsat", spy, OPTIONS, searching=True)
    model, x = MLPChain(32, 4), torch.randn(8, 32)
    t0 = time.perf_counter()
    plan = rc.plan_model(model, (x,), memory_budget=None, solver=strategy, time_limit_s=4).plan
    assert clocks[-1] is not None and clocks[-1].seconds <= 4 - 1.5  # what the trace left
    assert plan.solve_time_s <= clocks[-1].wall_elapsed() and time.perf_counter() - t0 >= 1.5
    rc.plan_model(model, (x,), memory_budget=None, solver=strategy)
    rc.plan_model(model, (x,), memory_budget=None, solver=strategy, time_limit_s=4, deterministic=True)
    assert clocks[1:] == [None, None]


def test_the_warm_start_ends_by_its_share_and_the_search_gets_the_model_it_built(monkeypatch):
    """Past ``SHARES["end"]`` of the time limit the composition and the tied blocks are not started
    (the search keeps its time); before it they get their shares, bounded by that end. The tied
    blocks search a copy of the job's model, which the search then uses unhinted (built once). A
    FLOP-free heuristic plan under ``objective="flops"`` skips them."""
    from remat_compiler.solvers.cpsat import warmstart
    from remat_compiler.solvers.cpsat.run import Job
    from helpers import stack_graph

    cg = stack_graph()
    budget = (rc.solve(cg, None, "checkpoint_blocks").peak_bytes + rc.solve(cg, None, "save_all").peak_bytes) // 2
    real_tied = warmstart.tied_blocks
    calls = []
    monkeypatch.setattr(warmstart, "decomposition", lambda job, s: warmstart.Seed())
    monkeypatch.setattr(warmstart, "composition", lambda job, s: calls.append(("composition", s)))
    monkeypatch.setattr(warmstart, "tied_blocks", lambda job, s, start: calls.append(("tied", s)))
    late = Job(cg, budget, "runtime", Deadline(1.0))
    time.sleep(0.7)
    warmstart.seed(late, heuristics=True, block_reuse=True, block_reuse_share=0.4)
    assert calls == []
    warmstart.seed(Job(cg, budget, "runtime", Deadline(100.0)), heuristics=True, block_reuse=True,
                   block_reuse_share=0.4)
    assert [name for name, _ in calls] == ["composition", "tied"]
    assert calls[0][1] <= warmstart.COMPOSITION_CAP_S and calls[1][1] <= 40.0
    # under objective="flops" a heuristic plan recomputing no counted FLOPs is FLOP-optimal: no block phase
    calls.clear()
    monkeypatch.setattr(warmstart, "flop_gap", lambda *_: 0.0)
    free = warmstart.seed(Job(cg, budget, "flops", Deadline(100.0)), heuristics=True, block_reuse=True,
                          block_reuse_share=0.4)
    assert calls == [] and free.saved is not None and peak_of(cg, free.saved) <= budget
    job = Job(cg, budget, "runtime", Deadline(10.0))
    tied = real_tied(job, 2.0)
    assert tied is not None and peak_of(cg, tied) <= budget
    rm = job.cost_model()
    assert job.models["cost"] is rm and len(rm.model.proto.solution_hint.vars) == 0


def test_a_deterministic_deadline_spends_only_what_searches_are_charged():
    clock = Deadline(4.0, deterministic=True)
    time.sleep(0.05)
    assert clock.left() == 4.0  # wall time does not count
    part = clock.part(2.0)
    part.charge(1.5)
    assert part.left() == 0.5 and clock.left() == 2.5  # a phase's charge is the whole's too
    assert clock.wall_elapsed() >= 0.05


def test_default_worker_count_comes_from_the_environment(monkeypatch):
    """A solve given no ``num_workers`` runs $REMAT_COMPILER_CPSAT_WORKERS workers (8 unset); a value
    that is not a whole number of workers is refused with the variable named."""
    from remat_compiler.solvers.cpsat.run import WORKERS_ENV, make_solver

    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert make_solver(1.0, None, False).parameters.num_workers == 8
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert make_solver(1.0, None, False).parameters.num_workers == 3
    assert make_solver(1.0, 5, False).parameters.num_workers == 5  # the caller's count wins
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=WORKERS_ENV):
            make_solver(1.0, None, False)


def test_compile_stops_within_its_default_tolerance_and_plan_model_searches_to_the_proof():
    """``compile`` gives CP-SAT ``tolerance=COMPILE_TOLERANCE`` unless told otherwise (a first call
    does not wait out the time limit for the last fraction of a percent); ``plan_model`` and
    ``compile(..., tolerance=0)`` search to the proof. A solver that takes no tolerance gets none."""
    from remat_compiler.pipeline import COMPILE_TOLERANCE

    torch.manual_seed(0)

    class LossOfChain(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                     nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

        def forward(self, x):
            return self.net(x).square().mean()

    model = LossOfChain()
    x = torch.randn(2048, 32)
    compiled = rc.compile(model, memory_budget=0.9, time_limit_s=5, num_workers=2)
    compiled(x).backward()
    assert COMPILE_TOLERANCE == 0.01 and compiled.plan.extras["tolerance"] == COMPILE_TOLERANCE
    head = compiled.plan.explain().splitlines()[0]
    assert ("within 1% of the step" in head) == (compiled.plan.status == "feasible"), head
    proving = rc.compile(model, memory_budget=0.9, time_limit_s=5, num_workers=2, tolerance=0)
    proving(x).backward()
    assert "tolerance" not in proving.plan.extras
    assert "tolerance" not in rc.plan_model(model, (x,), memory_budget=0.9, time_limit_s=5, num_workers=2
                                            ).plan.extras
    from remat_compiler.pipeline import PlanSpec

    assert "tolerance" not in PlanSpec.make(0.9, "greedy", {}, defaults={"tolerance": COMPILE_TOLERANCE}).options
