"""The compiler's pipeline: what to plan for (:class:`PlanSpec`) and the steps from a traced joint graph
to the emitted forward and backward, one named step a line (:func:`plan_joint`)::

    gm, cg = annotate(joint, num_fwd_outputs, cost_model)   # passes; networkx graph with bytes / FLOPs / runtime
    cg = inductor_view(cg)                                  # backend="inductor": fused values cost no bytes
    plan, _ = decide(cg, spec)                              # CP-SAT, a hand-picked strategy, a given or cached plan
    sim = check_plan(cg, plan)                              # the plan's claims against its graph
    fw, bw = emit(gm, plan)                                 # forward / backward GraphModules
    check_emitted(fw, bw, plan, cg)                         # the emitted code's own peak, walked
                                                            # (of the traced graph's simulation, under Inductor)

The step's trace is before it: :func:`remat_compiler.compile` runs it inside AOTAutograd's partitioner
(once per input signature, :mod:`remat_compiler.module`), :func:`remat_compiler.plan_model` and the CLI
after :func:`remat_compiler.trace.trace`. Decisions made before the plan travel in the spec as records
that :func:`decide` applies by name: the MoE combine choice (``spec.combines``, a
:class:`~remat_compiler.solvers.chosen.CombineChoice` made by :mod:`remat_compiler.combines`) and the
Inductor backend's fused recompute (``spec.fused_recompute``).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

import torch
import torch.fx as fx

from remat_compiler.budget import Budget, parse_budget
from remat_compiler.check import check_emitted, check_plan
from remat_compiler.clock import MIN_SLICE_S, Deadline, check_time_limit
from remat_compiler.codegen import emit
from remat_compiler.eager_paths import warn_fraction_of_uncheckpointed
from remat_compiler.emitted import EmittedPeak
from remat_compiler.errors import PlanMismatchError
from remat_compiler.fusion import fusible_recompute, inductor_view
from remat_compiler.graph import CostGraph
from remat_compiler.moe.segments import segment_combines
from remat_compiler.passes import CostModel, run_passes
from remat_compiler.plan import Plan, make_plan
from remat_compiler.plan_cache import PlanCache, key_fields, key_of
from remat_compiler.policies import Policy, apply_policy
from remat_compiler.runtime import distributed, plan_on_rank0
from remat_compiler.schedule import SimResult, simulate
from remat_compiler.solvers import Strategy, get_solver, resolve_budget
from remat_compiler.solvers.chosen import CombineChoice
from remat_compiler.solvers.cpsat import SolveMemo

__all__ = ["PlanSpec", "PlannedGraph", "plan_joint", "annotate", "decide", "fuse_recompute", "timed",
           "COMPILE_TOLERANCE"]

#: The ``tolerance`` :func:`remat_compiler.compile` gives a searching solver that takes one, unless the
#: caller gives one: its first call stops searching once the plan is proven within 1% of the step's
#: estimated cost of the best plan (:func:`remat_compiler.solvers.cpsat.solve_cpsat`), rather than
#: spend the time limit proving the last fraction of a percent. ``plan_model``, ``solve`` and the CLI
#: search to the proof; ``compile(..., tolerance=0)`` does too.
COMPILE_TOLERANCE = 0.01


@dataclass(frozen=True)
class PlanSpec:
    """What to plan for, decided once by :func:`remat_compiler.compile` or :func:`remat_compiler.plan_model`.

    Attributes
    ----------
    budget : Budget
    strategy : Strategy
        The solver (:data:`remat_compiler.solvers.SOLVERS`).
    options : mapping
        The solver's options (checked against what it takes).
    policy : callable, optional
        Hard decisions for a solver that accepts a policy.
    cost_model : remat_compiler.passes.CostModel, optional
    plan : Plan, optional
        Apply this plan instead of solving; without a ``cost_model``, the graph is costed with the
        one the plan was made with (``plan.extras["cost_model"]``).
    plan_cache : PlanCache, optional
        Look the plan up here before solving, and store what is solved
        (:mod:`remat_compiler.plan_cache`).
    started_s : float, optional
        When the call that plans began (``time.perf_counter()``), where its ``time_limit_s`` bounds
        the whole call, tracing included (:func:`remat_compiler.plan_model`): each solve then runs on
        the time left (:meth:`clock`).
    combines : CombineChoice, optional
        What the MoE combine choice decided (:mod:`remat_compiler.combines`): the combines to trace
        with, the chosen saved set, or why the model is planned as it traces.
    fused_recompute : bool
        The Inductor backend's: a searching solver's plan recomputes the pointwise values Inductor
        fuses into their readers instead of saving them (:func:`fuse_recompute`).
    inductor_memory : bool
        The Inductor backend's, for one shape: the plan is made on the graph as Inductor's code
        allocates it (:func:`remat_compiler.fusion.inductor_view`: the values it inlines into their
        readers cost no bytes).
    """

    budget: Budget
    strategy: Strategy
    options: Mapping = field(default_factory=dict)
    policy: Policy | None = None
    cost_model: CostModel | None = None
    plan: Plan | None = None
    plan_cache: PlanCache | None = None
    started_s: float | None = None
    combines: CombineChoice | None = None
    fused_recompute: bool = False
    inductor_memory: bool = False

    @classmethod
    def make(cls, memory_budget, solver, options: Mapping, *, policy: Policy | None = None,
             cost_model: CostModel | None = None, plan: Plan | str | bytes | None = None,
             plan_cache: PlanCache | str | os.PathLike | None = None, defaults: Mapping = MappingProxyType({})
             ) -> "PlanSpec":
        """Parse and check everything a plan needs before any tracing. ``defaults``: options the
        solver gets where it takes them and ``options`` does not give them.

        Raises
        ------
        ValueError
            For a budget that is not one of the accepted forms, an unknown solver, an option it does
            not take, a time limit that is not positive, a policy for a solver that takes none, a
            ``plan`` that is not a plan, or both ``plan`` and ``plan_cache``.
        """
        strategy = get_solver(solver)
        strategy.check_options(options)
        if strategy.options is not None:
            options = {**{k: v for k, v in defaults.items() if k in strategy.options}, **options}
        check_time_limit(options.get("time_limit_s"))
        if policy is not None and not strategy.accepts_policy:
            raise ValueError(f"a policy constrains CP-SAT; solver {strategy.name!r} takes no forced saves "
                             f"(use solver='cpsat')")
        if isinstance(plan, (str, bytes)):
            plan = Plan.from_json(plan)
        elif plan is not None and not isinstance(plan, Plan):
            raise ValueError(f"plan= takes a Plan or the JSON text Plan.to_json writes, got "
                             f"{type(plan).__name__}")
        if plan is not None and cost_model is None and isinstance(plan.extras.get("cost_model"), dict):
            cost_model = CostModel(**plan.extras["cost_model"])  # re-cost with the rates it was made with
        if plan is not None and plan_cache is not None:
            raise ValueError("plan= applies a given plan and plan_cache= looks plans up: pass one of them")
        if plan_cache is not None and not isinstance(plan_cache, PlanCache):
            plan_cache = PlanCache(plan_cache)
        return cls(parse_budget(memory_budget), strategy, dict(options), policy, cost_model, plan, plan_cache)

    def clock(self) -> Deadline | None:
        """A solve's clock where the time limit bounds the whole call (``started_s`` set): what is
        left of ``time_limit_s`` since ``started_s`` (:data:`~remat_compiler.clock.MIN_SLICE_S` at
        least, as every phase gets); None (the solver makes its own of ``time_limit_s``) without a
        start or a limit, for a solver that runs on no given clock (takes no ``deadline``) and with
        ``deterministic`` (whose clock is CP-SAT's own time)."""
        limit = self.options.get("time_limit_s")
        if self.started_s is None or limit is None or self.options.get("deterministic") \
                or "deadline" not in (self.strategy.options or ()):
            return None
        return Deadline(max(MIN_SLICE_S, limit - (time.perf_counter() - self.started_s)))

    def prepared(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The model as it is traced for this spec: with a given plan that records how its MoE
        segments were traced (``plan.extras["moe_combine"]``, :func:`remat_compiler.plan.moe_combine_of`),
        every MoE segment (an :class:`~remat_compiler.moe.MoELayer` or a transformers MoE block) with
        the combine the plan was made for (:func:`~remat_compiler.moe.segments.segment_combines`);
        with combines chosen, with those (:meth:`CombineChoice.prepared`); else as the strategy
        traces it (:meth:`Strategy.prepared`)."""
        combine = self.plan.extras.get("moe_combine") if self.plan is not None else None
        if combine:
            return segment_combines(model, {seg: c["mode"] for seg, c in combine.items()})
        if self.combines is not None and self.combines.chosen:
            return self.combines.prepared(model)
        return self.strategy.prepared(model)


@dataclass
class PlannedGraph:
    """Every intermediate of the pipeline, for inspection and dumps, and how long each step took."""

    gm: fx.GraphModule
    cg: CostGraph
    plan: Plan
    sim: SimResult
    fw: fx.GraphModule | None = None
    bw: fx.GraphModule | None = None
    timings: dict[str, float] = field(default_factory=dict)
    source: str = "solved"  # "solved", "given" (plan=), "cache" (plan_cache=) or "rank 0"
    backend: str = "eager"  # what runs fw and bw: "eager" (op by op) or "inductor"
    compiled: EmittedPeak | None = None  # Inductor's code walked (remat_compiler.inductor.compiled_peak)
    inductor: tuple = ()  # the forward and backward Inductor compiled (remat_compiler.inductor.InductorGraph)
    first_step_bytes: int | None = None  # Inductor's code: the measured peak of its first step


def plan_joint(joint: fx.GraphModule, num_fwd_outputs: int, spec: PlanSpec, *,
               memo: SolveMemo | None = None) -> PlannedGraph:
    """The compiler: plan a traced joint graph (``joint``, its first ``num_fwd_outputs`` outputs the
    forward's) under ``spec`` and emit its forward and backward.

    Raises
    ------
    InfeasibleBudgetError, PlanMismatchError, PlanCheckError
    """
    spent: dict[str, float] = {}
    with timed(spent, "annotate"):
        gm, traced = annotate(joint, num_fwd_outputs, spec.cost_model)
        cg = inductor_view(traced) if spec.inductor_memory else traced
    with timed(spent, "solve"):
        plan, source = decide(cg, spec, memo=memo)
    warn_fraction_of_uncheckpointed(spec.budget.fraction, cg.g.graph.get("trace_notes"), plan.baseline_peak_bytes)
    with timed(spent, "check"):
        sim = check_plan(cg, plan)
    with timed(spent, "emit"):
        fw, bw = emit(gm, plan)
    with timed(spent, "check emitted"):  # run op by op, the code writes what Inductor's fuses away
        unfused = None if cg is traced else simulate(traced, plan.schedule).peak_bytes
        check_emitted(fw, bw, plan, traced, peak_bytes=unfused)
    return PlannedGraph(gm, cg, plan, sim, fw, bw, spent, source)


def annotate(joint: fx.GraphModule, num_fwd_outputs: int, cost_model: CostModel | None = None
             ) -> tuple[fx.GraphModule, CostGraph]:
    """The passes over a traced joint graph, and its cost graph."""
    gm = run_passes(joint, num_fwd_outputs=num_fwd_outputs, cost_model=cost_model)
    return gm, CostGraph.from_graph_module(gm)


def decide(cg: CostGraph, spec: PlanSpec, *, memo: SolveMemo | None = None) -> tuple[Plan, str]:
    """The plan for ``cg`` and where it came from: the given one (``"given"``, if it is for this
    graph and fits the budget), a cached one (``"cache"``: ``spec.plan_cache``, verified), else the
    strategy's (``"solved"``, :func:`_solved`), made on rank 0 alone under torch.distributed
    (``"rank 0"`` on the other ranks).

    A fraction budget is of ``cg``'s no-recompute peak, except for a given plan whose combines were
    chosen in its solve: of the peak it records (``extras["fraction_base_bytes"]``, the model's as it
    is, which the choice resolved the fraction on), so the same fraction accepts it again."""
    if spec.plan is not None:
        return _given(cg, spec), "given"
    options = dict(spec.options)
    clock = None if "deadline" in options else spec.clock()
    if clock is not None:  # time_limit_s bounds the whole call: the solve gets what is left
        options["deadline"] = clock
    if spec.policy is not None:
        options["forced_saved"], options["forbidden_saved"] = apply_policy(cg, spec.policy)
    if memo is not None and spec.strategy.options is not None and "memo" in spec.strategy.options \
            and not options.get("deterministic"):
        options.setdefault("memo", memo)
    if distributed():
        return plan_on_rank0(lambda: _looked_up_or_solved(cg, spec, options))
    return _looked_up_or_solved(cg, spec, options)


def _given(cg: CostGraph, spec: PlanSpec) -> Plan:
    """``spec.plan``, checked to be for ``cg`` and to fit the budget."""
    spec.plan.check_applies_to(cg)
    base = spec.plan.extras.get("fraction_base_bytes")  # a chosen plan's: the graph as the model is
    if spec.budget.fraction is not None and type(base) is int and base > 0:
        budget_bytes = spec.budget.resolve(base)
    else:
        budget_bytes = resolve_budget(cg, spec.budget)
    if budget_bytes is not None and spec.plan.peak_bytes > budget_bytes:
        raise PlanMismatchError(
            f"the plan given peaks at {spec.plan.peak_bytes} bytes, above memory_budget "
            f"{budget_bytes} bytes: pass a larger budget, or leave plan= out to re-plan under this one")
    return spec.plan


def _looked_up_or_solved(cg: CostGraph, spec: PlanSpec, options: dict) -> tuple[Plan, str]:
    """The plan ``spec.plan_cache`` holds for ``cg`` (``"cache"``), else the one :func:`_solved`
    makes (``"solved"``), stored in the cache, and where the combine choice says so, in its."""
    budget_bytes = resolve_budget(cg, spec.budget)
    if spec.plan_cache is None:
        plan = _solved(cg, spec, budget_bytes, options)
    else:
        fields = key_fields(cg, budget_bytes, spec.cost_model or CostModel(), spec.strategy, options)
        if spec.fused_recompute:  # another plan than the eager backend's for the same graph and solver
            fields["fused_recompute"] = True
        key = key_of(fields)
        cached = spec.plan_cache.load(key, cg, budget_bytes, options)
        if cached is not None:
            return cached, "cache"
        plan = _solved(cg, spec, budget_bytes, options)
        spec.plan_cache.store(key, plan, fields)
    if spec.combines is not None and spec.combines.store is not None:
        cache, key, fields = spec.combines.store
        cache.store(key, plan, fields)
    return plan, "solved"


def _solved(cg: CostGraph, spec: PlanSpec, budget_bytes: int | None, options: dict) -> Plan:
    """The strategy's plan, with the decisions made before it applied by name: the chosen combines'
    saved set instead of a search (``spec.combines``), why no combine was chosen, and the Inductor
    backend's fused recompute (``spec.fused_recompute``)."""
    choice = spec.combines
    if choice is not None and choice.chosen:
        plan = choice.plan(cg, budget_bytes)
    else:
        plan = spec.strategy.solve(cg, budget_bytes, **options)
    if choice is not None:
        plan = choice.explained(plan)
    if spec.fused_recompute:
        plan = fuse_recompute(cg, plan, budget_bytes)
    return plan


def fuse_recompute(cg: CostGraph, plan: Plan, budget_bytes: int | None) -> Plan:
    """``plan`` for the Inductor backend: the pointwise values Inductor fuses into their readers
    recomputed instead of saved (:func:`remat_compiler.fusion.fusible_recompute`; the plan lists them
    in ``extras["inductor_fused_recompute"]``). A plan with reruns, and one where nothing moves, is
    returned as it is."""
    saved = plan.saved if plan.rerun else fusible_recompute(cg, plan.saved, budget_bytes)
    if len(saved) == len(plan.saved):
        return plan
    kept = set(saved)
    moved = [v for v in plan.saved if v not in kept]
    return make_plan(cg, saved, budget_bytes=budget_bytes, solver=plan.solver, status=plan.status,
                     gap=plan.gap, solve_time_s=plan.solve_time_s, min_feasible_bytes=plan.min_feasible_bytes,
                     baseline_peak_bytes=plan.baseline_peak_bytes,
                     extras={**plan.extras, "inductor_fused_recompute": moved})


@contextlib.contextmanager
def timed(spent: dict[str, float], step: str) -> Iterator[None]:
    """Record the wall seconds a step takes in ``spent[step]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spent[step] = time.perf_counter() - t0
