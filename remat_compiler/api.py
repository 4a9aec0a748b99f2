"""The compiler, and the module users train with.

The compiler is :func:`plan_joint`, one step per line, run on the joint forward+backward graph that
tracing captured: by :func:`compile` inside AOTAutograd's partitioner (once per input signature),
and by :func:`plan_model` / the CLI after :func:`remat_compiler.trace.trace`::

    gm, cg = annotate(joint, num_fwd_outputs, cost_model)   # passes; networkx graph with bytes / FLOPs / runtime
    plan, _ = decide(cg, spec)                              # CP-SAT, a hand-picked strategy, a given or cached plan
    sim = check_plan(cg, plan)                              # the plan's claims against its graph
    fw, bw = emit(gm, plan)                                 # forward / backward GraphModules
    check_emitted(fw, bw, plan, cg)                         # the emitted code's own peak, walked
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from passes import CostModel, run_passes
from remat_compiler.budget import Budget, parse_budget
from remat_compiler.clock import MIN_SLICE_S, Deadline
from remat_compiler.check import check_emitted, check_plan
from remat_compiler.emitted import EmittedPeak
from remat_compiler.codegen import emit
from remat_compiler.errors import InfeasibleBudgetError, PlanMismatchError
from remat_compiler.fusion import fusible_recompute
from remat_compiler.graph import CostGraph
from remat_compiler.moe.segments import segment_combines, why_not_choosable
from remat_compiler.plan import Plan, make_plan, moe_combine_of
from remat_compiler.plan_cache import PlanCache, key_fields, key_of
from remat_compiler.policies import Policy, apply_policy
from remat_compiler.runtime import (ForwardWithSignature, GradGate, GradRecord, distributed, grad_deps,
                                    on_rank0, plan_on_rank0)
from remat_compiler.schedule import SimResult, build_schedule, no_recompute, simulate
from remat_compiler.solvers import SOLVERS, Strategy, chosen_combines, get_solver, resolve_budget
from remat_compiler.solvers.combine_choice import MODES as COMBINE_MODES, align_combines
from remat_compiler.solvers.cpsat.choice import solve_choice
from remat_compiler.solvers.cpsat import SolveMemo
from remat_compiler.stamp import trace_stamped
from remat_compiler.eager_paths import warn_fraction_of_uncheckpointed
from remat_compiler.dynamic import DynamicShapeError, ShapeBounds, entry_key, is_range_key, trace_and_run_range
from remat_compiler.errors import UntraceableModelError
from remat_compiler.trace import (INPLACE_AFTER_SAVE, StepFunction, TracedStep, annotate_joint, aot_step,
                                  flatten_step, is_inplace_after_save, run_traced, signature_of_leaves, trace,
                                  trace_step, without_data)

__all__ = ["compile", "CompiledModule", "plan_model", "plan_joint", "annotate", "analyze", "PlanSpec",
           "PlannedGraph", "chooses_combines", "choose_combines", "explain_unchosen", "CHOICE_OPTIONS"]


@dataclass(frozen=True)
class PlanSpec:
    """What to plan for, decided once by :func:`compile` or :func:`plan_model`.

    Attributes
    ----------
    budget : Budget
    strategy : Strategy
        The solver (:data:`remat_compiler.solvers.SOLVERS`).
    options : mapping
        The solver's options (checked against what it takes).
    policy : callable, optional
        Hard decisions for a solver that accepts a policy.
    cost_model : passes.CostModel, optional
    plan : Plan, optional
        Apply this plan instead of solving; without a ``cost_model``, the graph is costed with the
        one the plan was made with (``plan.extras["cost_model"]``).
    plan_cache : PlanCache, optional
        Look the plan up here before solving, and store what is solved
        (:mod:`remat_compiler.plan_cache`).
    started_s : float, optional
        When the call that plans began (``time.perf_counter()``), where its ``time_limit_s`` bounds
        the whole call, tracing included (:func:`plan_model`): each solve then runs on the time
        left (:meth:`clock`).
    """

    budget: Budget
    strategy: Strategy
    options: Mapping = field(default_factory=dict)
    policy: Policy | None = None
    cost_model: CostModel | None = None
    plan: Plan | None = None
    plan_cache: PlanCache | None = None
    started_s: float | None = None

    @classmethod
    def make(cls, memory_budget, solver, options: Mapping, *, policy: Policy | None = None,
             cost_model: CostModel | None = None, plan: Plan | str | bytes | None = None,
             plan_cache: PlanCache | str | os.PathLike | None = None) -> "PlanSpec":
        """Parse and check everything a plan needs before any tracing.

        Raises
        ------
        ValueError
            For a budget that is not one of the accepted forms, an unknown solver, an option it does
            not take, a time limit that is not positive, a policy for a solver that takes none, a
            ``plan`` that is not a plan, or both ``plan`` and ``plan_cache``.
        """
        strategy = get_solver(solver)
        strategy.check_options(options)
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
        the combine the plan was made for (:func:`~remat_compiler.moe.segments.segment_combines`), else as
        the strategy traces it (:meth:`Strategy.prepared`)."""
        combine = self.plan.extras.get("moe_combine") if self.plan is not None else None
        if combine:
            return segment_combines(model, {seg: c["mode"] for seg, c in combine.items()})
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
    with _timed(spent, "annotate"):
        gm, cg = annotate(joint, num_fwd_outputs, spec.cost_model)
    with _timed(spent, "solve"):
        plan, source = decide(cg, spec, memo=memo)
    warn_fraction_of_uncheckpointed(spec.budget.fraction, cg.g.graph.get("trace_notes"), plan.baseline_peak_bytes)
    with _timed(spent, "check"):
        sim = check_plan(cg, plan)
    with _timed(spent, "emit"):
        fw, bw = emit(gm, plan)
    with _timed(spent, "check emitted"):
        check_emitted(fw, bw, plan, cg)
    return PlannedGraph(gm, cg, plan, sim, fw, bw, spent, source)


def annotate(joint: fx.GraphModule, num_fwd_outputs: int, cost_model: CostModel | None = None
             ) -> tuple[fx.GraphModule, CostGraph]:
    """The passes over a traced joint graph, and its cost graph."""
    gm = run_passes(joint, num_fwd_outputs=num_fwd_outputs, cost_model=cost_model)
    return gm, CostGraph.from_graph_module(gm)


def decide(cg: CostGraph, spec: PlanSpec, *, memo: SolveMemo | None = None) -> tuple[Plan, str]:
    """The plan for ``cg`` and where it came from: the given one (``"given"``, if it is for this
    graph and fits the budget), a cached one (``"cache"``: ``spec.plan_cache``, verified), else the
    strategy's (``"solved"``), made on rank 0 alone under torch.distributed (``"rank 0"`` on the
    other ranks).

    A fraction budget is of ``cg``'s no-recompute peak, except for a given plan whose combines were
    chosen in its solve: of the peak it records (``extras["fraction_base_bytes"]``, the model's as it
    is, which the choice resolved the fraction on), so the same fraction accepts it again."""
    if spec.plan is not None:
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
        return spec.plan, "given"
    options = dict(spec.options)
    clock = None if "deadline" in options else spec.clock()
    if clock is not None:  # time_limit_s bounds the whole call: the solve gets what is left
        options["deadline"] = clock
    if spec.policy is not None:
        options["forced_saved"], options["forbidden_saved"] = apply_policy(cg, spec.policy)
    if memo is not None and spec.strategy.options is not None and "memo" in spec.strategy.options \
            and not options.get("deterministic"):
        options.setdefault("memo", memo)
    source = ["solved"]

    def solve() -> Plan:
        budget_bytes = resolve_budget(cg, spec.budget)
        if spec.plan_cache is None:
            return spec.strategy.solve(cg, budget_bytes, **options)
        fields = key_fields(cg, budget_bytes, spec.cost_model or CostModel(), spec.strategy, options)
        key = key_of(fields)
        plan = spec.plan_cache.load(key, cg, budget_bytes)
        if plan is not None:
            source[0] = "cache"
            return plan
        plan = spec.strategy.solve(cg, budget_bytes, **options)
        spec.plan_cache.store(key, plan, fields)
        return plan
    if distributed():
        plan = plan_on_rank0(solve)
        return plan, source[0] if torch.distributed.get_rank() == 0 else "rank 0"
    return solve(), source[0]


#: The options of the default solver under which it chooses each MoE segment's combine (``progress``
#: too: it reports the solve that follows when the choice finds no plan; the choice's own is silent).
CHOICE_OPTIONS = frozenset({"time_limit_s", "num_workers", "objective", "deterministic"})


def chooses_combines(spec: PlanSpec, model: torch.nn.Module) -> bool:
    """Whether planning ``model`` under ``spec`` chooses MoE segments' combines in its solve.

    It does for the default ``solver="cpsat"`` (options among :data:`CHOICE_OPTIONS`, no policy, no
    given plan), on one process or several (rank 0 chooses, :func:`choose_combines`), when the
    model has a segment whose combine can be chosen
    (:func:`~remat_compiler.moe.segments.why_not_choosable`): an
    :class:`~remat_compiler.moe.MoELayer` with the default ``combine="autograd"``, expert-parallel
    or not, with equal or uneven splits; a transformers MoE block (Mixtral's, OLMoE's, Qwen2-MoE's,
    Qwen3-MoE's, DeepSeek-V3's) whose experts can run the fused combine
    (:func:`~remat_compiler.moe.hf.why_not_fusable`). The other segments are no choice: each keeps
    its combine (a user's ``combine="fused"`` MoELayer stays fused, a block whose experts cannot
    run it autograd) and the plan says why, while the others are still chosen for. Another solver
    (``moe_cpsat`` plans the fused combine everywhere), a policy, a given plan or another option
    plans the graph as the model traces it, as before (:func:`explain_unchosen` says why where
    the default solver meets a model none of whose segments is a choice).
    """
    return _choice_applies(spec) and any(w is None for w in why_not_choosable(model).values())


def _choice_applies(spec: PlanSpec) -> bool:
    """Whether ``spec`` is one under which the combines are chosen in the solve (the model aside)."""
    return spec.strategy is SOLVERS["cpsat"] and spec.plan is None and spec.policy is None \
        and not set(spec.options) - CHOICE_OPTIONS - {"progress"}


def explain_unchosen(spec: PlanSpec, model: torch.nn.Module) -> PlanSpec:
    """``spec``, whose plans record per MoE segment why its combine was no choice
    (``extras["moe_combine"][seg]["why"]``, which explain() prints), where the default solver would
    choose combines but no segment of ``model`` is a choice (every MoELayer built with
    ``combine="fused"``, say); else ``spec`` itself.

    Parameters
    ----------
    spec : PlanSpec
    model : torch.nn.Module

    Returns
    -------
    PlanSpec
    """
    why = why_not_choosable(model)
    if not _choice_applies(spec) or not why or any(w is None for w in why.values()):
        return spec
    return _as_is(spec, {seg: f"no choice: {w}" for seg, w in why.items()})


# why a segment that could be chosen for was not: its fused combine did not run when traced
_UNFUSED = ("its experts ran transformers' forward unfused when traced (the hidden states' dtype is not "
            "the experts' weights', as under autocast)")
# explain()'s comparison of each chosen combine with the other traces the step once per segment, after
# the solve: it gets this share of time_limit_s (at least COMPARE_MIN_S) and the segments past it are
# not compared (a 32-layer HF MoE model would otherwise trace itself 32 more times)
COMPARE_SHARE, COMPARE_MIN_S = 0.25, 10.0
# why every segment kept the autograd combine: the one solve over both found no plan
_NONE_FOUND = ("not chosen: the one CP-SAT solve over both combines found no plan under the budget in its "
               "time, so the model was planned as it is (reruns and the lowest-peak search apply there); "
               "solver='moe_cpsat' plans the fused combine alone")


def choose_combines(spec: PlanSpec, model: torch.nn.Module, trace_once: Callable[[], TracedStep]) -> PlanSpec:
    """Trace the step with every segment that is a choice in each combine, choose per segment and the
    saved set in one CP-SAT solve over both
    (:func:`~remat_compiler.solvers.cpsat.choice.solve_choice`), and return the spec that traces the
    chosen combines and applies that choice (:func:`chosen_combines`).

    The choices are the segments :func:`~remat_compiler.moe.segments.why_not_choosable` accepts
    (MoELayers and transformers MoE blocks alike, by module path); the others keep the autograd
    combine, and the plan records them with why they were no choice.

    With a plan cache, the plan is looked up under the key of the graph as the model is (marked as a
    choice) and verified on the graph traced with the combines it records (a hit traces neither the
    fused combine nor builds the union); a solved plan is stored there.

    Where no segment's fused combine ran when traced (HF experts under autocast run transformers'
    forward unfused), ``spec`` is returned as it is: the model is planned as it traces.

    When the one solve finds no plan under the budget (it does not rerun values), the spec is
    returned with only the solve's clock added (``deadline``: the choice and the fallback share one
    ``time_limit_s``): the model is planned as it is (every combine autograd) by
    :func:`~remat_compiler.solvers.cpsat.solve_cpsat`, whose reruns may go lower and whose
    lowest-peak search names the smallest feasible budget.

    Under torch.distributed rank 0 alone traces both combines and solves; it broadcasts what it
    chose (the combines, or a cached plan, or that the model is planned as it is), so every rank
    traces the same combines and then runs rank 0's plan (:func:`decide`). An error on rank 0 is
    raised on every rank.

    Raises
    ------
    ValueError
        If the two combines' graphs do not align (:func:`align_combines`).
    """
    if not distributed():
        return _choose(spec, model, trace_once)[0]
    chosen: list[PlanSpec] = []

    def choose() -> tuple:
        spec_chosen, shared = _choose(spec, model, trace_once)
        chosen.append(spec_chosen)
        return shared

    kind, *rest = on_rank0(choose, "choose the MoE combines")
    if chosen:
        return chosen[0]
    if kind == "as is":
        return spec
    budget = spec.budget if rest[0] is None else parse_budget(rest[0])
    if kind == "plan":  # rank 0's cache hit: every rank applies it
        return dataclasses.replace(spec, budget=budget, plan=Plan.from_json(rest[1]), plan_cache=None)
    modes = rest[1]
    strategy = Strategy("cpsat", _planned_on_rank0, prepare=lambda m: segment_combines(m, modes), searching=True)
    return dataclasses.replace(spec, budget=budget, strategy=strategy, options={}, plan_cache=None)


def _as_is(spec: PlanSpec, why: str | Mapping[str, str]) -> PlanSpec:
    """``spec``, planning the model as it is (every segment's combine as the model traces it),
    whose plans record why each segment was not chosen for (``extras["moe_combine"][seg]["why"]``,
    which explain() prints): one reason for all, or one per segment."""
    inner = spec.strategy

    def solve(cg: CostGraph, budget_bytes: int | None, **options) -> Plan:
        plan = inner.solve(cg, budget_bytes, **options)
        for seg, c in plan.extras.get("moe_combine", {}).items():
            reason = why if isinstance(why, str) else why.get(seg)
            if reason is not None:
                c.setdefault("why", reason)
        return plan
    return dataclasses.replace(spec, strategy=dataclasses.replace(inner, solve=solve))


def _fusing(spec: PlanSpec) -> PlanSpec:
    """``spec`` for the Inductor backend: a searching solver's plans then recompute the pointwise values
    Inductor fuses into their readers instead of saving them
    (:func:`remat_compiler.fusion.fusible_recompute`; the plan lists them in
    ``extras["inductor_fused_recompute"]``). A given plan and a hand-picked strategy (whose saved set
    is its definition) are left as they are, and so are plans with reruns."""
    if spec.plan is not None or not spec.strategy.searching:
        return spec
    inner = spec.strategy

    def solve(cg: CostGraph, budget_bytes: int | None, **options) -> Plan:
        plan = inner.solve(cg, budget_bytes, **options)
        saved = plan.saved if plan.rerun else fusible_recompute(cg, plan.saved, budget_bytes)
        if len(saved) == len(plan.saved):
            return plan
        kept = set(saved)
        moved = [v for v in plan.saved if v not in kept]
        return make_plan(cg, saved, budget_bytes=budget_bytes, solver=plan.solver, status=plan.status,
                         gap=plan.gap, solve_time_s=plan.solve_time_s, min_feasible_bytes=plan.min_feasible_bytes,
                         baseline_peak_bytes=plan.baseline_peak_bytes,
                         extras={**plan.extras, "inductor_fused_recompute": moved})
    return dataclasses.replace(spec, strategy=dataclasses.replace(inner, solve=solve))


def _planned_on_rank0(cg: CostGraph, budget_bytes: int | None) -> Plan:
    """The strategy of a rank other than 0 after the combine choice: :func:`decide` broadcasts rank
    0's plan to it, so it never solves."""
    raise RuntimeError("under torch.distributed only rank 0 plans the chosen combines")


def _choose(spec: PlanSpec, model: torch.nn.Module, trace_once: Callable[[], TracedStep]
            ) -> tuple[PlanSpec, tuple]:
    """:func:`choose_combines` on one process: the spec, and what other ranks need to follow it
    (``("as is",)``, ``("plan", budget_bytes, plan JSON)`` or ``("chosen", budget_bytes, modes)``)."""
    why_not = why_not_choosable(model)
    choices = [path for path, why in why_not.items() if why is None]
    traced_graphs: dict[tuple, CostGraph] = {}

    def traced_with(modes: dict[str, str]) -> CostGraph:
        """The cost graph of the step with these combines (of the choices; the rest autograd),
        traced once per distinct choice (a one-segment model's flipped choice is the other
        combine's graph, traced already)."""
        key = tuple(modes.get(p, "autograd") for p in choices)
        if key not in traced_graphs:
            with segment_combines(model, dict(zip(choices, key))):
                traced = trace_once()
            traced_graphs[key] = annotate(traced.joint, traced.num_fwd_outputs, spec.cost_model)[1]
        return traced_graphs[key]

    graphs = {"autograd": traced_with({})}
    budget_bytes = resolve_budget(graphs["autograd"], spec.budget)
    budget = spec.budget if budget_bytes is None else parse_budget(budget_bytes)
    segments = moe_combine_of(graphs["autograd"])
    store = None
    if spec.plan_cache is not None:  # keyed by the graph as the model is, and verified on the chosen one
        fields = {**key_fields(graphs["autograd"], budget_bytes, spec.cost_model or CostModel(), spec.strategy,
                               spec.options), "moe_combine": "chosen in the solve"}
        key = key_of(fields)
        modes = spec.plan_cache.recorded_combines(key, segments)  # None: absent, or reported bad
        cached = None
        if modes is not None:  # a hit needs neither the fused trace nor the union
            cg = graphs["autograd"] if set(modes.values()) == {"autograd"} else traced_with(modes)
            cached = spec.plan_cache.load(key, cg, budget_bytes)  # None: reported and re-planned
        if cached is not None:
            return (dataclasses.replace(spec, budget=budget, plan=cached, plan_cache=None),
                    ("plan", budget_bytes, cached.to_json()))
        store = lambda plan: spec.plan_cache.store(key, plan, fields)  # noqa: E731
    graphs["fused"] = traced_with({p: "fused" for p in choices})
    fused_as_traced = moe_combine_of(graphs["fused"])
    if all(fused_as_traced.get(p, {}).get("mode") != "fused" for p in choices):
        return _as_is(spec, {seg: f"no choice: {why_not.get(seg) or _UNFUSED}" for seg in segments}), ("as is",)
    union = align_combines(graphs["autograd"], graphs["fused"])
    # the choice's clock, then any fallback's (what is left of the call's, where time_limit_s bounds it)
    deadline = spec.clock() or Deadline(spec.options.get("time_limit_s", 30.0),
                                        deterministic=bool(spec.options.get("deterministic")))
    try:
        choice = solve_choice(union, budget_bytes, **{k: v for k, v in spec.options.items() if k in CHOICE_OPTIONS},
                              deadline=deadline)
    except InfeasibleBudgetError:  # none found without reruns: plan the model as it is, in the time left
        why = {seg: f"no choice: {why_not[seg]}" if why_not.get(seg) else _NONE_FOUND for seg in segments}
        return _as_is(dataclasses.replace(spec, options={**spec.options, "deadline": deadline}), why), ("as is",)
    flipped, flipped_s = {}, {}
    compare = Deadline(max(COMPARE_MIN_S, COMPARE_SHARE * spec.options.get("time_limit_s", 30.0)))
    for seg, mode in choice.modes.items():  # for explain(): the same saved set, this segment switched
        if compare.expired():  # one trace each, after the solve: the rest say they were not compared
            break
        cg = traced_with({**choice.modes, seg: COMBINE_MODES[1 - COMBINE_MODES.index(mode)]})
        sim = simulate(cg, build_schedule(cg, choice.saved))
        flipped[seg], flipped_s[seg] = sim.peak_bytes, sim.recompute_s
    # every segment the graph has: the no-choice ones keep their combine as the model traces it
    modes = {seg: choice.modes.get(seg, segments[seg]["mode"]) for seg in segments}
    strategy = chosen_combines(modes, choice.saved, status=choice.status, gap=choice.gap,
                               solve_time_s=choice.solve_time_s, model_peak_bytes=choice.model_peak_bytes,
                               flipped_peak_bytes=flipped, flipped_recompute_s=flipped_s, on_plan=store,
                               not_chosen={seg: why_not.get(seg) or _UNFUSED for seg in segments
                                           if seg not in choice.modes},
                               fraction_base_bytes=no_recompute(graphs["autograd"]).peak_bytes)
    return (dataclasses.replace(spec, budget=budget, strategy=strategy, options={}, plan_cache=None),
            ("chosen", budget_bytes, modes))


def analyze(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            cost_model: CostModel | None = None, solver="cpsat",
            hold_outputs: bool = True, device=None, stamp_layers: bool = True) -> tuple[fx.GraphModule, CostGraph]:
    """Trace a model's step as ``solver`` traces it and annotate it (``hold_outputs``, ``device``,
    ``stamp_layers``: see :func:`plan_model`): the graph and cost graph a plan is made for."""
    with get_solver(solver).prepared(model):
        traced = trace_for_planning(model, args, kwargs, hold_outputs=hold_outputs,
                                    device=_plans_for(device, cost_model), stamp_layers=stamp_layers)
    return annotate(traced.joint, traced.num_fwd_outputs, cost_model)


def trace_for_planning(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                       hold_outputs: bool = True, device=None, stamp_layers: bool = True) -> TracedStep:
    """:func:`~remat_compiler.trace.trace`, or with ``stamp_layers`` and a model of many identical
    layers, the same graph built from traces of 3 and 4 of them
    (:func:`remat_compiler.stamp.trace_stamped`; a full trace where that does not apply)."""
    traced = None
    if stamp_layers:
        traced = trace_stamped(model, args, kwargs, hold_outputs=hold_outputs, device=device)
    return traced or trace(model, args, kwargs, hold_outputs=hold_outputs, device=device)


def plan_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, memory_budget=None, *,
               solver: str | Callable[..., Plan] | Strategy = "cpsat", cost_model: CostModel | None = None,
               hold_outputs: bool = True, policy: Policy | None = None, plan: Plan | str | None = None,
               plan_cache: PlanCache | str | os.PathLike | None = None, device=None,
               stamp_layers: bool = True, fsdp: int | None = None, **solver_options) -> PlannedGraph:
    """Plan recomputation for one call of a model without running it (the CLI's ``plan``).

    Parameters
    ----------
    model, args, kwargs :
        The model and an example call (only shapes and dtypes matter: parameters, buffers and
        inputs may be on the meta device, and the plan is the one real CPU tensors give).
    memory_budget, solver, cost_model, hold_outputs, policy, plan, plan_cache, **solver_options :
        As :func:`compile` takes them, except ``time_limit_s``: here it bounds the call from the
        model to the plan. The tracing and costing (for a combine choice, of each combine) are
        taken from it and the solve gets the time left (at least
        :data:`~remat_compiler.clock.MIN_SLICE_S`), so a search solver returns its best plan by
        then; the plan's check and the code emitted for it follow (3.5 s of 61 s on a 7B-shaped
        model), and so do, after a combine choice, the traces with each segment's combine flipped
        that explain() compares (one each, for at most a quarter of the limit, at least 10 s: the
        segments past it say they were not compared). A plan's ``solve_time_s`` is the solve's own. Without
        ``time_limit_s``, with ``deterministic=True`` (whose clock is CP-SAT's own time) and for a
        solver that runs on no given clock (``greedy``, a callable), the solver's limit starts
        after the trace.
    device : str or torch.device, optional
        The device a model on the meta device is planned for (default: ``cost_model.device``, the
        CPU without a cost model; ``CostModel.preset("h100")`` plans for ``"cuda"``). On CUDA the
        bytes are those ``torch.cuda.max_memory_allocated()`` counts (:mod:`passes.allocator`).
        On a build of PyTorch without CUDA the step is traced on the CPU and planned for CUDA:
        ``plan.save(path)`` here, then ``compile(model.cuda(), plan=Plan.load(path))`` on the GPU
        accepts it wherever the graph does not depend on the device
        (:func:`remat_compiler.trace.trace_device` says where it does).
    stamp_layers : bool
        Where the model has many identical layers (12 or more decoder layers, say), trace 3 and 4
        of them and build the full joint graph from those (:mod:`remat_compiler.stamp`): the same
        graph, fingerprint and plan as a full trace, in a fraction of its time. False traces in
        full.
    fsdp : int, optional
        Plan rank 0 of an ``fsdp``-way FSDP2 step in this process: a copy of the model sharded as
        torchtitan shards it (every block of its repeated layers, then the root) over torch's fake
        process group, its whole step planned with each unit's keep-or-re-gather choice
        (:func:`remat_compiler.fsdp.planning.plan_sharded`; traced in full).

    Returns
    -------
    PlannedGraph

    Raises
    ------
    ValueError, InfeasibleBudgetError, UntraceableModelError, PlanMismatchError
    """
    if fsdp is not None:  # one rank of an N-way FSDP2 step, over a fake process group
        from remat_compiler.fsdp.planning import plan_sharded
        return plan_sharded(model, args, kwargs, memory_budget, fsdp=fsdp, solver=solver, cost_model=cost_model,
                            hold_outputs=hold_outputs, policy=policy, plan=plan, plan_cache=plan_cache,
                            device=device, **solver_options)
    started_s = time.perf_counter()
    spec = dataclasses.replace(PlanSpec.make(memory_budget, solver, solver_options, policy=policy,
                                             cost_model=cost_model, plan=plan, plan_cache=plan_cache),
                               started_s=started_s)
    spent: dict[str, float] = {}
    if chooses_combines(spec, model):
        with _timed(spent, "choose combines"):
            spec = choose_combines(spec, model, lambda: trace_for_planning(
                model, args, kwargs, hold_outputs=hold_outputs, device=_plans_for(device, cost_model),
                stamp_layers=stamp_layers))
    else:
        spec = explain_unchosen(spec, model)
    with _timed(spent, "trace"), spec.prepared(model):
        traced = trace_for_planning(model, args, kwargs, hold_outputs=hold_outputs,
                                    device=_plans_for(device, cost_model), stamp_layers=stamp_layers)
    planned = plan_joint(traced.joint, traced.num_fwd_outputs, spec)
    planned.timings = {**spent, **planned.timings}
    return planned


def _plans_for(device, cost_model: CostModel | None):
    """The device a data-less model is planned for: ``device``, else the cost model's, else None."""
    if device is not None:
        return device
    return cost_model.device if cost_model is not None else None


@contextlib.contextmanager
def _timed(spent: dict[str, float], step: str):
    """Record the wall seconds a step takes in ``spent[step]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        spent[step] = time.perf_counter() - t0


@dataclass
class _Entry:
    step: StepFunction
    fn: Callable
    planned: PlannedGraph | None = None
    calls: int = 0
    grad_deps: list | None = None     # per flat input: the tangents its gradient reads (see GradGate)
    gate: bool = True                 # whether calls need the gate (decided once the graph is known)
    example: list | None = None       # the first call's state tensors and inputs (to trace it again)
    over: tuple | None = None         # Inductor's first step measured above the budget: the next
    #                                   trace's (planning budget, walk margin, overshot plan peak)
    replan: tuple | None = None       # this trace's, from the entry it replaces (its ``over``)
    measured_replans: int = 0         # re-plans made after a first step measured above the budget
    shapes: object = None             # a range of shapes (remat_compiler.dynamic): its ShapeBounds
    #                                   until traced, then the ShapeRange each call is checked against


#: How many times the Inductor backend re-plans under a lower budget when Inductor's code for a plan
#: peaks above the budget, before it runs the eager backend's plan instead.
INDUCTOR_REPLANS = 3
#: How many times it re-plans after a first step measured above the budget (the walk missed
#: something) before the next call runs the eager backend's plan instead.
MEASURED_REPLANS = 1

BACKENDS = ("eager", "inductor")


def _inductor_facts(planned: PlannedGraph, budget: Budget, margin_bytes: int = 0):
    """What :class:`remat_compiler.inductor.InductorCompilers` reads of the plan just made, and the
    budget the walk of its code must keep, in bytes: less ``margin_bytes``, what a walk was found to
    miss on this step."""
    from remat_compiler.inductor import StepFacts

    cg = planned.cg
    limit = resolve_budget(cg, budget)
    return StepFacts(planned.bw, len(cg.fw_outputs), tuple(cg.g.graph.get("input_updates", ())),
                     cg.hold_outputs, planned.plan.peak_bytes,
                     None if limit is None else limit - margin_bytes, cg.allocator)


# One trace at a time in this process: a trace swaps the model's parameters for the trace's tensors
# (functional_call) and sets torch.compiler's process-wide "compiling" flag; two at once corrupt both.
_TRACE_LOCK = threading.RLock()


class CompiledModule(torch.nn.Module):
    """A model that trains with a recomputation plan. Built by :func:`compile`.

    It shares the original's parameters and buffers: ``parameters()``, ``state_dict()`` (same keys as
    the original) and optimizers built on either keep working. Each new input signature (shapes,
    dtypes, devices, requires_grad, non-tensor arguments) is traced and planned on its first call;
    ``plan`` is the plan of the last call. In ``eval()`` or without grad, the model runs as is.

    First calls are traced one at a time in a process (a lock), and the trace swaps the model's
    parameters and buffers for its own tensors while the forward is traced: another thread that reads
    them from the model during that window (``model.parameters()``, ``model.weight``) gets the trace's
    tensors. Take the references before (as an optimizer does) or after the first call returns.
    """

    def __init__(self, model: torch.nn.Module, spec: PlanSpec, hold_outputs: bool = True,
                 backend: str = "eager", shapes: ShapeBounds | None = None):
        super().__init__()
        self._shapes = shapes  # the bounds of the shapes one plan serves (remat_compiler.dynamic)
        self._shapes_off: str | None = None  # why the range was given up (then: per shape)
        self._orig_mod = model
        self._spec = spec
        self._hold_outputs = hold_outputs
        self._backend = backend
        self._memo = SolveMemo()  # plans met on this module's graphs, for its later solves
        self._entries: dict[tuple, _Entry] = {}
        self._failures: dict[tuple, InfeasibleBudgetError] = {}
        self.plan: Plan | None = None
        self.planned: PlannedGraph | None = None

    # the original's state, under the original's keys
    def state_dict(self, *args, **kwargs):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._orig_mod.load_state_dict(*args, **kwargs)

    @property
    def original(self) -> torch.nn.Module:
        return self._orig_mod

    def _key(self, leaves: list, spec, state: tuple) -> tuple:
        """Everything that changes the traced graph: the call's signature (its flattened ``leaves``
        and ``spec``), each parameter's and buffer's shape, dtype, device and requires_grad (of
        ``state``: :meth:`_state`), training mode and autocast."""
        params, buffers = state
        shapes = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad)
                       for _, t in (*params, *buffers))
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)) + \
            ((torch.is_autocast_cache_enabled(),) if torch.is_autocast_enabled("cpu")
             or torch.is_autocast_enabled("cuda") else ())
        return (signature_of_leaves(leaves, spec), shapes, self._orig_mod.training, autocast)

    def _state(self) -> tuple:
        """The model's ``(named parameters, named buffers)`` now: one walk of its modules a call."""
        return tuple(self._orig_mod.named_parameters()), tuple(self._orig_mod.named_buffers())

    def __getstate__(self):
        # the per-signature entries hold AOTAutograd's compiled functions, which do not pickle: a
        # loaded module traces and plans again on its first call (a fixed plan= is kept)
        state = self.__dict__.copy()
        state["_entries"], state["_failures"], state["_memo"] = {}, {}, SolveMemo()
        state.pop("_forward_with_signature", None)
        state["plan"] = state["planned"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def _partition(self, entry: _Entry, spec: PlanSpec):
        def partition(joint, _joint_inputs, *, num_fwd_outputs, **_kw):
            planned = plan_joint(annotate_joint(joint, entry.step), num_fwd_outputs, spec, memo=self._memo)
            entry.planned = planned
            entry.grad_deps = grad_deps(planned.cg)
            return planned.fw, planned.bw
        return partition

    forward = ForwardWithSignature()

    @torch._dynamo.disable  # torch.compile around this module runs the plan as emitted (no graph)
    def _step(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not self._orig_mod.training:
            return self._orig_mod(*args, **kwargs)
        # every call pays for what follows before its step runs: one flatten of the arguments and
        # one walk of the model's modules serve the key, the first call and the step's inputs
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        state = self._state()
        key = self._key(leaves, spec, state)
        if self._shapes is not None:  # the range's entry where it serves this call
            key = entry_key(self._shapes, self._shapes_off, key, leaves, self._entries)
        if key in self._failures:  # an infeasible budget for this signature: the same answer, at once
            raise self._failures[key]
        entry = self._entries.get(key)
        if entry is None or entry.over is not None:
            step, flat = flatten_step(self._orig_mod, args, kwargs, hold_outputs=self._hold_outputs)
            with _TRACE_LOCK:
                entry = self._entries.get(key)
                if entry is None:
                    return self._first_call(key, step, flat)
                if entry.over is not None:  # its first step measured above the budget: plan again
                    del self._entries[key]
                    return self._first_call(key, step, flat, after=entry)
        flat = [x for x in leaves if isinstance(x, torch.Tensor)]
        return self._call(entry, entry.step.state_from(*state) + flat, entry.gate)

    def _first_call(self, key, step: StepFunction, flat: list[torch.Tensor], after: _Entry | None = None):
        self._check_order()
        if any(without_data(t) for t in step.state_tensors() + flat):
            raise ValueError(
                "a model or inputs on the meta device (or FakeTensors) hold no data, so the compiled "
                "module cannot run a training step with them. Plan without weights with "
                "remat_compiler.plan_model(model, args, kwargs, memory_budget) (or the CLI's plan), "
                "then train the real model with remat_compiler.compile(real_model, plan=planned.plan)")
        entry = _Entry(step=step, fn=None, example=step.state_tensors() + flat)
        if is_range_key(key):
            entry.shapes = self._shapes
        if after is not None:  # the step's plan again, after Inductor's code measured above the budget
            entry.replan, entry.measured_replans = after.over, after.measured_replans + 1
        record = GradRecord(entry)
        inputs, positions = self._gated(record, step.state_tensors() + flat)
        try:
            try:
                out = self._trace_and_run(entry, inputs)
            except RuntimeError as exc:
                # backward through an extra output reads a value the forward then mutated in place:
                # eager only fails if the caller backpropagates through it, so plan the loss alone
                if not is_inplace_after_save(exc) or step.loss_only_reason is not None:
                    raise
                step.loss_only_reason = INPLACE_AFTER_SAVE
                out = self._trace_and_run(entry, inputs)
        except InfeasibleBudgetError as exc:
            self._failures[key] = exc
            raise
        finally:
            entry.example = None  # traced: the first call's tensors are not held
        self._entries[key] = entry
        if entry.planned is None:  # AOTAutograd found no backward: the step has nothing to plan
            warnings.warn("no parameter or input of this call requires grad, so there is no backward "
                          "to plan: the model runs without recomputation", RuntimeWarning, stacklevel=3)
            entry.gate = False
        else:
            deps = entry.grad_deps
            n_grad_out = sum(isinstance(o, torch.Tensor) and o.requires_grad for o in out)
            every = frozenset(range(len(entry.planned.cg.tangents)))
            mapped = deps is not None and n_grad_out == len(every) and \
                not (entry.step.mutated_positions & set(positions))
            entry.gate = mapped and any(d is not None and d != every for d in deps)
            if not mapped:
                entry.grad_deps = None  # the gate passes every gradient through
        return self._finish(entry, self._watch(record, out))

    def _check_order(self) -> None:
        """Refuse a compiled module that FSDP2 sharded afterwards (``fully_shard(compile(m))``)."""
        from remat_compiler.fsdp.units import refuse_sharded_after
        refuse_sharded_after(self)

    def _trace_and_run(self, entry: _Entry, inputs: list[torch.Tensor]):
        """Trace, plan and compile the step on its first call, and run its forward."""
        if entry.shapes is not None:  # one plan for a range of shapes, else per shape from now on
            try:
                return trace_and_run_range(self, entry, inputs)
            except (DynamicShapeError, UntraceableModelError) as exc:
                self._shapes_off, entry.shapes, entry.planned = str(exc), None, None
                warnings.warn(f"max_seq_len: this step cannot be planned once for every length ({exc}); "
                              f"each new shape is traced and planned on its own", RuntimeWarning, stacklevel=4)
        if self._backend == "eager":
            return self._trace_and_run_eager(entry, inputs)
        return self._trace_and_run_inductor(entry, inputs)

    def _trace_and_run_eager(self, entry: _Entry, inputs: list[torch.Tensor]):
        spec = self._spec
        if chooses_combines(spec, self._orig_mod):
            spec = choose_combines(spec, self._orig_mod,
                                   lambda: trace_step(entry.step, self._orig_mod, entry.example))
        else:
            spec = explain_unchosen(spec, self._orig_mod)
        entry.fn = aot_step(entry.step, self._partition(entry, spec))
        with spec.prepared(self._orig_mod):
            return run_traced(entry.fn, self._orig_mod, inputs, entry.step)

    def _trace_and_run_inductor(self, entry: _Entry, inputs: list[torch.Tensor]):
        """The Inductor backend's first call: plan, compile, and re-plan under a lower budget while
        Inductor's code peaks above the budget (:mod:`remat_compiler.inductor`); after
        :data:`INDUCTOR_REPLANS` re-plans, or when its code cannot be read, run the eager backend's
        plan instead, with a warning.

        Each re-plan lowers the planning budget by what Inductor's code overshot. Where that lower
        budget has no plan, the next try plans at the smallest peak the solve found instead (between
        the infeasible budget and the last one whose code overshot): Inductor's code for the leanest
        plan can still fit the budget even though the overshoot rule asked for less.

        The code accepted is measured on its first step (:meth:`_first_step_report`). Where that
        measured above the budget, this call is the next one (``entry.replan``): it plans under the
        budget lowered by the overshoot, holding the walk of the new code below the budget by what
        the old walk missed; after :data:`MEASURED_REPLANS` such re-plans it runs the eager backend's
        plan, with a warning."""
        from remat_compiler.inductor import (DECOMPOSITIONS, CompiledOverBudget, InductorCompilers,
                                             UnreadableCodeError)

        spec, why = _fusing(self._spec), None
        over_at = None  # the lowest planning budget whose Inductor code peaked above the budget
        margin = 0  # bytes a walk of this step's code was found to miss (its first step measured)
        tries = INDUCTOR_REPLANS + 1
        if entry.replan is not None:
            lower, margin, over_at = entry.replan
            spec = dataclasses.replace(spec, budget=parse_budget(max(int(lower), 1)), plan=None, plan_cache=None)
            if entry.measured_replans > MEASURED_REPLANS:
                why, tries = "the first step of its re-planned code measured above the budget again", 0
        for _ in range(tries):
            compilers = InductorCompilers(lambda: _inductor_facts(entry.planned, self._spec.budget, margin),
                                          self._first_step_report(entry, margin))
            entry.fn = aot_step(entry.step, self._partition(entry, spec), fw_compiler=compilers.forward,
                                bw_compiler=compilers.backward, decompositions=DECOMPOSITIONS)
            try:
                with self._spec.prepared(self._orig_mod):
                    out = run_traced(entry.fn, self._orig_mod, inputs, entry.step)
            except CompiledOverBudget as over:
                why = str(over)
                over_at = min(over.limit_bytes, over.plan_peak_bytes)
                lower = over_at - (over.peak.peak_bytes - over.limit_bytes)
                spec = dataclasses.replace(spec, budget=parse_budget(max(int(lower), 1)), plan=None,
                                           plan_cache=None)
                continue
            except UnreadableCodeError as exc:
                why = f"its generated code could not be read ({exc})"
                break
            except InfeasibleBudgetError as exc:
                if over_at is None:  # the user's own budget: no plan at all
                    raise
                why = f"a plan under the lower budget it needs does not exist ({exc})"
                if exc.min_feasible_bytes >= over_at:
                    break  # the leanest plan found peaks where a plan's code already overshot
                spec = dataclasses.replace(spec, budget=parse_budget(exc.min_feasible_bytes), plan=None,
                                           plan_cache=None)
                continue
            entry.planned.backend = "inductor"
            entry.planned.compiled = compilers.peak
            entry.planned.inductor = (compilers.fw, compilers.bw)
            return out
        warnings.warn(f"backend='inductor' cannot keep this step under its budget: {why}. It runs the "
                      f"eager backend's plan instead (exact, slower)", RuntimeWarning, stacklevel=5)
        return self._trace_and_run_eager(entry, inputs)

    def _first_step_report(self, entry: _Entry, margin: int) -> Callable[[int, int], None]:
        """What to do with the measured peak of the first step of this entry's Inductor code
        (:class:`remat_compiler.inductor.FirstStepCheck`): record it and, above the budget, warn
        and have the next call plan again under a budget lowered by the overshoot, with the walk of
        the new code held below the budget by what this walk missed. Under torch.distributed it
        only warns: the ranks measure apart, and a re-plan on one rank alone would part their plans.
        Where the caller held outputs through the backward that ``hold_outputs=False`` planned as
        freed (``held`` bytes), the warning says so and what to do."""
        def report(measured: int, held: int) -> None:
            planned = entry.planned
            planned.first_step_bytes = measured
            limit = resolve_budget(planned.cg, self._spec.budget)
            if limit is None or measured <= limit:
                return
            walked = planned.compiled
            missed = max(measured - walked.peak_bytes, 0)
            said = (f"backend='inductor': the first step of Inductor's code for this plan measured "
                    f"{measured} bytes, above the budget of {limit} bytes; the walk of its code had "
                    f"predicted {walked.peak_bytes} bytes (at {walked.peak_node}), so it missed {missed} bytes")
            if held:
                said += (f". The caller still held {held} bytes of the step's outputs through its backward, "
                         f"which hold_outputs=False plans as freed when the forward returns"
                         f"{' (that is all the walk missed)' if missed <= held else ''}: keep only the loss "
                         f"(loss = m(x, labels=y).loss; loss.backward()), or compile with hold_outputs=True so "
                         f"that the plan counts them")
            if distributed():
                warnings.warn(f"{said}. Under torch.distributed it is not re-planned on one rank: pass a "
                              f"memory_budget lower by {measured - limit} bytes", RuntimeWarning, stacklevel=2)
                return
            over_at = min(limit, planned.plan.peak_bytes)
            entry.over = (over_at - (measured - limit), margin + missed, over_at)
            warnings.warn(f"{said}. The next call plans this step again under a budget lower by "
                          f"{measured - limit} bytes", RuntimeWarning, stacklevel=2)
        return report

    def _gated(self, record: GradRecord, inputs: list[torch.Tensor]):
        positions = tuple(i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad)
        if not positions:
            return inputs, positions
        gated = GradGate.apply(record, positions, *(inputs[i] for i in positions))
        inputs = list(inputs)
        for i, t in zip(positions, gated):
            inputs[i] = t
        return inputs, positions

    @staticmethod
    def _watch(record: GradRecord, out):
        k = 0
        for o in out:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(record.hook(k))
                k += 1
        return out

    def _call(self, entry: _Entry, inputs: list[torch.Tensor], gate: bool):
        if gate:
            record = GradRecord(entry)
            inputs, _ = self._gated(record, inputs)
            out = self._watch(record, entry.fn(*inputs))
        else:
            out = entry.fn(*inputs)
        return self._finish(entry, out)

    def _finish(self, entry: _Entry, out):
        entry.calls += 1
        self.planned = entry.planned
        self.plan = entry.planned.plan if entry.planned is not None else None
        return entry.step.unflatten_outputs(out)


def check_time_limit(time_limit_s) -> None:
    """Raise ValueError unless ``time_limit_s`` is None or a positive, finite number of seconds."""
    if time_limit_s is None:
        return
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) \
            or not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a positive number of seconds")


def _check_wrapper(model: torch.nn.Module) -> None:
    """Refuse wrappers whose own forward cannot be traced into a plan, saying what to do instead."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError(
            "compile(DDP(model)) cannot work: DDP all-reduces gradients from hooks on autograd's own "
            "backward, which the compiled step replaces, so ranks would keep their local gradients. "
            "Compile first, then wrap: DDP(remat_compiler.compile(model, ...))")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ValueError(
            "compile(torch.compile(model)) is not supported: remat_compiler traces the model itself. "
            "Pass the model (remat_compiler.compile(model, memory_budget, backend='inductor') has "
            "Inductor compile the planned forward and backward); torch.compile around the compiled "
            "module runs the plan unchanged")


def compile(model: torch.nn.Module, memory_budget=None, *, solver: str | Callable[..., Plan] | Strategy = "cpsat",
            cost_model: CostModel | None = None, plan: Plan | str | None = None, hold_outputs: bool = True,
            policy: Policy | None = None, plan_cache: PlanCache | str | os.PathLike | None = None,
            backend: str = "eager", max_seq_len: int | None = None, max_batch_size: int | None = None,
            **solver_options) -> CompiledModule:
    """Return a module that trains like ``model`` with recomputation planned under ``memory_budget``.

    Parameters
    ----------
    model : torch.nn.Module
    memory_budget : int | str | float | None
        Peak bytes of the training step above what was resident before it (parameters, inputs and
        optimizer state excluded; activations, recomputed values, gradients included): an int of
        bytes, a unit string (``"1.5GiB"``), a fraction in (0, 1] of the no-recompute peak, or None
        (no limit: the no-recompute plan).
    solver : str | callable | Strategy
        ``"cpsat"`` (default), ``"greedy"``, ``"save_all"``, ``"checkpoint_blocks"``, an MoE strategy
        (:data:`remat_compiler.solvers.SOLVERS`), or a callable
        ``solve(cost_graph, budget_bytes, **opts) -> Plan``. On a model of
        :class:`~remat_compiler.moe.MoELayer` s left at ``combine="autograd"`` and/or transformers
        MoE blocks whose experts can run the fused combine, ``"cpsat"`` also chooses each segment's
        combine, autograd or fused, in its one solve (:func:`chooses_combines`).
    cost_model : passes.CostModel, optional
        Compute rate and bandwidths for the runtime estimate.
    plan : Plan or str, optional
        Apply this saved plan (or its JSON text) instead of solving; it must be for the same
        graph, and with a ``memory_budget`` its peak must fit it (else PlanMismatchError).
    policy : callable, optional
        Hard decisions the solver obeys (:mod:`remat_compiler.policies`: ``save_matmuls``,
        ``save_only(...)``, ``never_save(...)``, ``first_of(...)``), given with ``solver="cpsat"``.
    plan_cache : str, PathLike or PlanCache, optional
        A folder of plans (:mod:`remat_compiler.plan_cache`): a plan for the same graph, budget,
        cost model, solver and options is read from it (verified; a corrupt or mismatched file is
        reported with a ``PlanCacheWarning`` and re-planned) instead of solving, and each new plan
        is written to it atomically, so later processes reuse it. Not with ``plan``.
    hold_outputs : bool
        True (default, safe): the caller keeps the model's outputs until backward ends, as in
        ``out = m(x); loss_fn(out, y).backward()``; they count to the end of the step. False: the
        caller lets go of them before backward except the scalar loss it calls ``backward()`` on
        (``m(x, labels=y).loss.backward()`` drops the logits); the plan then frees, keeps or
        recomputes them like any other value. If the model returns a scalar loss, backward runs
        from it alone: the other outputs come back without a gradient path (a backward through
        them raises), so no zero gradient the size of the logits is made for them. If a caller
        that said False holds them anyway, the step peaks above the plan by up to their size.
    backend : str
        What runs the planned forward and backward. ``"eager"`` (default): op by op, as emitted;
        the plan's peak is exact. ``"inductor"``: compiled by Inductor (fused kernels; faster, the
        first call compiles for tens of seconds, a C++ compiler is needed on CPU). The plan is made
        on the graph Inductor's decompositions give, its saved values are exactly the compiled
        forward's outputs, and the peak of the code Inductor wrote is walked before it runs
        (``m.planned.compiled``): above the budget, the step is re-planned lower, and after
        ``INDUCTOR_REPLANS`` tries it runs the eager plan with a warning.
    max_seq_len : int, optional
        Serve every sequence length up to this bound with one trace and one plan (dynamic padding,
        as the HF Trainer's collator pads): dim 0 (batch) and dim 1 (sequence) of every input are
        traced symbolically and the step is planned at the bound, whose peak is the most any
        shorter call reaches (:mod:`remat_compiler.dynamic`); a fraction budget is of the
        no-recompute peak at the bound. A call above the bound, of a size 1, or one the traced
        graph does not hold for is traced and planned for its own shape, as without the option.
        None (default): each new shape is traced and planned on its own. Eager backend only.
    max_batch_size : int, optional
        With ``max_seq_len``: the largest batch that shares the plan; None: the first call's.
    **solver_options :
        The solver's options (CP-SAT: ``time_limit_s`` for the whole solve, ``num_workers``,
        ``deterministic``, ``objective``...; a hand-picked strategy takes none).

    Returns
    -------
    CompiledModule

    Raises
    ------
    ValueError
        For a budget that is not one of the accepted forms, an unknown solver or an option it does
        not take, a time limit that is not positive, a ``plan`` that is not a plan, both ``plan`` and
        ``plan_cache``, or a wrapper
        that cannot be compiled (``DDP(model)``: compile first, then wrap; ``torch.compile(model)``:
        pass the model).

    Example
    -------
    >>> m = remat_compiler.compile(model, memory_budget="1.5GiB")   # doctest: +SKIP
    >>> loss_fn(m(x), y).backward(); print(m.plan.explain())         # doctest: +SKIP
    """
    spec = PlanSpec.make(memory_budget, solver, solver_options, policy=policy, cost_model=cost_model, plan=plan,
                         plan_cache=plan_cache)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile expects an nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}: 'eager' runs the plan op by op "
                         f"(the default), 'inductor' compiles its forward and backward with Inductor")
    _check_wrapper(model)
    shapes = ShapeBounds.make(max_seq_len, max_batch_size)
    if shapes is not None and (backend != "eager" or plan is not None):
        raise ValueError("max_seq_len= plans one range of shapes on the eager backend without a given plan; "
                         "backend='inductor' and plan= plan per shape (leave max_seq_len out)")
    from remat_compiler.fsdp import is_fsdp_model  # sharded with FSDP2: the step with its collectives
    if is_fsdp_model(model):
        if shapes is not None:
            raise ValueError("max_seq_len= is not available for FSDP2-sharded models: leave it out")
        from remat_compiler.fsdp import FSDPCompiledModule
        return FSDPCompiledModule(model, spec, hold_outputs, backend)
    return CompiledModule(model, spec, hold_outputs, backend, shapes=shapes)
