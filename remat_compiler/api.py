"""The front door: the entry functions users call.

:func:`compile` returns the module that trains with a plan (:class:`~remat_compiler.module.CompiledModule`);
:func:`plan_model` plans one call of a model without running it (the CLI's ``plan``); :func:`analyze` and
:func:`trace_for_planning` give the graph a plan is made for. Each checks its arguments, builds the
:class:`~remat_compiler.pipeline.PlanSpec` and hands over to the rooms behind it:

- :mod:`remat_compiler.pipeline`: ``PlanSpec``, ``plan_joint`` (annotate, decide, check, emit, check emitted);
- :mod:`remat_compiler.combines`: the MoE combine choice, made before the plan;
- :mod:`remat_compiler.module`: ``CompiledModule``, one traced and planned entry per input signature;
- :mod:`remat_compiler.inductor`: the Inductor backend (``backend="inductor"``).

The names those rooms define are importable from here too, as before they had rooms of their own.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch
import torch.fx as fx

from remat_compiler.clock import check_time_limit
from remat_compiler.dynamic import ShapeBounds
from remat_compiler.combines import (CHOICE_OPTIONS, COMPARE_MIN_S, COMPARE_SHARE, choose_combines, chooses_combines,
                                     explain_unchosen, resolve_combines)
from remat_compiler.fsdp.module import FSDPCompiledModule
from remat_compiler.fsdp.choices import record_unit_choices
from remat_compiler.fsdp.planning import fake_process_group, shard_for_planning
from remat_compiler.fsdp.seeds import FSDPSeeds
from remat_compiler.fsdp.units import is_fsdp_model
from remat_compiler.graph import CostGraph
from remat_compiler.module import BACKENDS, CompiledModule, check_wrapper
from remat_compiler.passes import CostModel
from remat_compiler.pipeline import COMPILE_TOLERANCE, PlannedGraph, PlanSpec, annotate, decide, plan_joint, timed
from remat_compiler.plan import Plan
from remat_compiler.plan_cache import PlanCache
from remat_compiler.policies import Policy
from remat_compiler.solvers import Strategy, get_solver
from remat_compiler.stamp import trace_stamped
from remat_compiler.trace import TracedStep, trace

__all__ = ["compile", "CompiledModule", "plan_model", "plan_joint", "annotate", "analyze", "PlanSpec",
           "PlannedGraph", "chooses_combines", "choose_combines", "explain_unchosen", "CHOICE_OPTIONS",
           "trace_for_planning", "decide", "resolve_combines", "check_time_limit", "BACKENDS",
           "COMPARE_SHARE", "COMPARE_MIN_S", "plan_sharded", "analyze_sharded"]


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
        bytes are those ``torch.cuda.max_memory_allocated()`` counts (:mod:`remat_compiler.passes.allocator`).
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
        (:func:`plan_sharded`; traced in full).

    Returns
    -------
    PlannedGraph

    Raises
    ------
    ValueError, InfeasibleBudgetError, UntraceableModelError, PlanMismatchError
    """
    if fsdp is not None:  # one rank of an N-way FSDP2 step, over a fake process group
        return plan_sharded(model, args, kwargs, memory_budget, fsdp=fsdp, solver=solver, cost_model=cost_model,
                            hold_outputs=hold_outputs, policy=policy, plan=plan, plan_cache=plan_cache,
                            device=device, **solver_options)
    started_s = time.perf_counter()
    spec = dataclasses.replace(PlanSpec.make(memory_budget, solver, solver_options, policy=policy,
                                             cost_model=cost_model, plan=plan, plan_cache=plan_cache),
                               started_s=started_s)
    spent: dict[str, float] = {}
    spec = resolve_combines(spec, model, lambda: trace_for_planning(
        model, args, kwargs, hold_outputs=hold_outputs, device=_plans_for(device, cost_model),
        stamp_layers=stamp_layers), spent=spent)
    with timed(spent, "trace"), spec.prepared(model):
        traced = trace_for_planning(model, args, kwargs, hold_outputs=hold_outputs,
                                    device=_plans_for(device, cost_model), stamp_layers=stamp_layers)
    planned = plan_joint(traced.joint, traced.num_fwd_outputs, spec)
    planned.timings = {**spent, **planned.timings}
    return planned



def plan_sharded(model: torch.nn.Module, args: tuple, kwargs: dict | None, memory_budget, *, fsdp: int,
                 **plan_options):
    """:func:`remat_compiler.plan_model` for rank 0 of an ``fsdp``-way FSDP2 step
    (:func:`~remat_compiler.fsdp.planning.shard_for_planning`, in a
    :func:`~remat_compiler.fsdp.planning.fake_process_group`), traced in full
    (``stamp_layers`` does not apply to the sharded step), its solve starting from FSDP2's own
    settings as known plans (:class:`~remat_compiler.fsdp.seeds.FSDPSeeds`), each unit's choice in
    ``plan.extras["fsdp_units"]`` and ``fsdp`` in ``plan.extras["fsdp_world"]``.

    Returns
    -------
    PlannedGraph
    """
    with fake_process_group(fsdp):
        step = _sharded_for_planning(model, fsdp, plan_options)
        plan_options["stamp_layers"] = False
        takes = get_solver(plan_options.get("solver", "cpsat")).options or ()
        if "memo" in takes and "memo" not in plan_options and plan_options.get("plan_cache") is None \
                and plan_options.get("plan") is None and not plan_options.get("deterministic"):
            plan_options["memo"] = FSDPSeeds(unit_params=tuple(len(u.params) for u in step.units))
        planned = plan_model(step, args, kwargs, memory_budget, **plan_options)
        record_unit_choices(planned, step.units)
    planned.plan.extras["fsdp_world"] = fsdp
    return planned


def analyze_sharded(model: torch.nn.Module, args: tuple, kwargs: dict | None, *, fsdp: int, **options):
    """:func:`analyze` for rank 0 of an ``fsdp``-way FSDP2 step: its graph and
    cost graph (the CLI's ``pareto --fsdp N``)."""
    with fake_process_group(fsdp):
        return analyze(_sharded_for_planning(model, fsdp, options), args, kwargs, stamp_layers=False, **options)


def _sharded_for_planning(model: torch.nn.Module, fsdp: int, options: dict):
    """:func:`~remat_compiler.fsdp.planning.shard_for_planning` for the device ``options`` plan for."""
    return shard_for_planning(model, fsdp, device=_plans_for(options.get("device"), options.get("cost_model")))


def _plans_for(device, cost_model: CostModel | None):
    """The device a data-less model is planned for: ``device``, else the cost model's, else None."""
    if device is not None:
        return device
    return cost_model.device if cost_model is not None else None


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
    cost_model : remat_compiler.passes.CostModel, optional
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
        ``remat_compiler.inductor.backend.INDUCTOR_REPLANS`` tries it runs the eager plan with a warning.
    max_seq_len : int, optional
        Serve every sequence length up to this bound with one trace and one plan (dynamic padding,
        as the HF Trainer's collator pads): dim 0 (batch) and dim 1 (sequence) of every input are
        traced symbolically and the step is planned at the bound, whose peak is the most any
        shorter call reaches (:mod:`remat_compiler.dynamic`); a fraction budget is of the
        no-recompute peak at the bound. A call above the bound, of a size 1, or one the traced
        graph does not hold for is traced and planned for its own shape, as without the option.
        None (default): each new shape is traced and planned on its own. With
        ``backend="inductor"`` Inductor compiles the plan once over symbolic sizes, its code walked
        at the bound and re-planned lower while that walk peaks above the budget; where that does
        not get under it, or the code cannot be made or read, or under torch.distributed, each shape
        is planned and compiled on its own (:mod:`remat_compiler.inductor.ranges`). Not with ``plan=``.
    max_batch_size : int, optional
        With ``max_seq_len``: the largest batch that shares the plan; None: the first call's.
    **solver_options :
        The solver's options (CP-SAT: ``time_limit_s`` for the whole solve, ``num_workers``,
        ``deterministic``, ``objective``, ``tolerance``...; a hand-picked strategy takes none).
        CP-SAT's ``tolerance`` defaults here to
        :data:`~remat_compiler.pipeline.COMPILE_TOLERANCE` (0.01): the search stops once the plan
        is proven within 1% of the step's estimated cost of the best plan; ``tolerance=0``
        searches to a proof of optimality (or the time limit), as ``plan_model`` does.

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
    shapes = ShapeBounds.make(max_seq_len, max_batch_size)
    if shapes is not None and plan is not None:
        raise ValueError("max_seq_len= plans one range of shapes without a given plan; plan= plans per "
                         "shape (leave max_seq_len out)")
    spec = PlanSpec.make(memory_budget, solver, solver_options, policy=policy, cost_model=cost_model, plan=plan,
                         plan_cache=plan_cache, defaults={"tolerance": COMPILE_TOLERANCE})
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile expects an nn.Module, got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}: 'eager' runs the plan op by op "
                         f"(the default), 'inductor' compiles its forward and backward with Inductor")
    check_wrapper(model)
    if is_fsdp_model(model):  # sharded with FSDP2: the step with its collectives
        if shapes is not None:
            raise ValueError("max_seq_len= is not available for FSDP2-sharded models: leave it out")
        return FSDPCompiledModule(model, spec, hold_outputs, backend)
    return CompiledModule(model, spec, hold_outputs, backend, shapes=shapes)
