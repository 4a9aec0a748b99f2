"""The MoE combine choice, made before the step is traced for its plan: each MoE segment's combine
(autograd or fused) chosen with the saved set in one CP-SAT solve over both traces.

:func:`resolve_combines` is the step the callers run (:func:`remat_compiler.plan_model`, the compiled
module's first call): where the default solver can choose (:func:`chooses_combines`) it traces the step
with each combine and solves the union (:func:`choose_combines`); else it records why no segment was a
choice (:func:`explain_unchosen`). Either way it returns the spec with a
:class:`~remat_compiler.solvers.chosen.CombineChoice` record (``spec.combines``), which
:func:`remat_compiler.pipeline.decide` applies by name: nothing here replaces the strategy's ``solve``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from remat_compiler.budget import parse_budget
from remat_compiler.clock import Deadline
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.graph import CostGraph
from remat_compiler.moe.segments import segment_combines, why_not_choosable
from remat_compiler.passes import CostModel
from remat_compiler.pipeline import PlanSpec, annotate, timed
from remat_compiler.plan import Plan, moe_combine_of
from remat_compiler.plan_cache import key_fields, key_of
from remat_compiler.runtime import distributed, on_rank0
from remat_compiler.schedule import build_schedule, no_recompute, simulate
from remat_compiler.solvers import SOLVERS, resolve_budget
from remat_compiler.solvers.chosen import CombineChoice
from remat_compiler.solvers.combine_choice import MODES as COMBINE_MODES, align_combines
from remat_compiler.solvers.cpsat.choice import solve_choice
from remat_compiler.trace import TracedStep

__all__ = ["resolve_combines", "chooses_combines", "choose_combines", "explain_unchosen", "CHOICE_OPTIONS",
           "COMPARE_SHARE", "COMPARE_MIN_S"]


def resolve_combines(spec: PlanSpec, model: torch.nn.Module, trace_once: Callable[[], TracedStep], *,
                     spent: dict[str, float] | None = None) -> PlanSpec:
    """``spec`` with the MoE combine choice's record: the combines chosen in one solve where the
    default solver can choose them for ``model`` (:func:`choose_combines`, its time in
    ``spent["choose combines"]``), else why no segment was a choice (:func:`explain_unchosen`).

    Parameters
    ----------
    spec : PlanSpec
    model : torch.nn.Module
    trace_once : callable
        Traces the step once as the model is now (the choice switches its segments' combines around it).
    spent : dict, optional
        Where the choice's wall seconds are recorded.

    Returns
    -------
    PlanSpec
    """
    if not chooses_combines(spec, model):
        return explain_unchosen(spec, model)
    with timed({} if spent is None else spent, "choose combines"):
        return choose_combines(spec, model, trace_once)


#: The options of the default solver under which it chooses each MoE segment's combine (``progress``
#: too: it reports the solve that follows when the choice finds no plan; the choice's own is silent).
CHOICE_OPTIONS = frozenset({"time_limit_s", "num_workers", "objective", "deterministic", "tolerance"})


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
    return dataclasses.replace(spec, combines=CombineChoice(why={seg: f"no choice: {w}" for seg, w in why.items()}))


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
    chosen combines and applies that choice: its ``combines`` record
    (:class:`~remat_compiler.solvers.chosen.CombineChoice`), which :func:`~remat_compiler.pipeline.decide`
    applies.

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
    traces the same combines and then runs rank 0's plan (:func:`~remat_compiler.pipeline.decide`). An
    error on rank 0 is raised on every rank.

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
    # rank 0 chose these combines and plans them: this rank traces with them and runs its plan
    return dataclasses.replace(spec, budget=budget, combines=CombineChoice(modes=rest[1]), options={}, plan_cache=None)


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
            cached = spec.plan_cache.load(key, cg, budget_bytes, spec.options)  # None: re-planned
        if cached is not None:
            return (dataclasses.replace(spec, budget=budget, plan=cached, plan_cache=None),
                    ("plan", budget_bytes, cached.to_json()))
        store = (spec.plan_cache, key, fields)
    graphs["fused"] = traced_with({p: "fused" for p in choices})
    fused_as_traced = moe_combine_of(graphs["fused"])
    if all(fused_as_traced.get(p, {}).get("mode") != "fused" for p in choices):
        why = {seg: f"no choice: {why_not.get(seg) or _UNFUSED}" for seg in segments}
        return dataclasses.replace(spec, combines=CombineChoice(why=why)), ("as is",)
    union = align_combines(graphs["autograd"], graphs["fused"])
    # the choice's clock, then any fallback's (what is left of the call's, where time_limit_s bounds it)
    deadline = spec.clock() or Deadline(spec.options.get("time_limit_s", 30.0),
                                        deterministic=bool(spec.options.get("deterministic")))
    try:
        choice = solve_choice(union, budget_bytes, **{k: v for k, v in spec.options.items() if k in CHOICE_OPTIONS},
                              deadline=deadline)
    except InfeasibleBudgetError:  # none found without reruns: plan the model as it is, in the time left
        why = {seg: f"no choice: {why_not[seg]}" if why_not.get(seg) else _NONE_FOUND for seg in segments}
        as_is = CombineChoice(why=why)
        return dataclasses.replace(spec, options={**spec.options, "deadline": deadline}, combines=as_is), ("as is",)
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
    chosen = CombineChoice(modes, tuple(choice.saved), status=choice.status, gap=choice.gap,
                           solve_time_s=choice.solve_time_s, model_peak_bytes=choice.model_peak_bytes,
                           flipped_peak_bytes=flipped, flipped_recompute_s=flipped_s, store=store,
                           not_chosen={seg: why_not.get(seg) or _UNFUSED for seg in segments
                                       if seg not in choice.modes},
                           fraction_base_bytes=no_recompute(graphs["autograd"]).peak_bytes,
                           tolerance=spec.options.get("tolerance", 0.0))
    return (dataclasses.replace(spec, budget=budget, combines=chosen, options={}, plan_cache=None),
            ("chosen", budget_bytes, modes))
