"""The compiler in one flat list of steps, and the module users train with.

::

    gm = trace(model, args)                              # joint fwd+bwd aten graph (AOTAutograd)
    gm = run_passes(gm, num_fwd_outputs=...)             # phases, storage, costs, blocks, MoE tags
    cg = CostGraph.from_graph_module(gm)                 # networkx graph with bytes / FLOPs / runtime
    plan = solve(cg, budget, solver)                     # CP-SAT or a hand-picked strategy
    check_plan(cg, plan)                                 # independent liveness simulation
    fw, bw = emit(gm, plan)                              # forward / backward GraphModules

:func:`compile` runs the same steps inside AOTAutograd's partitioner, once per input signature.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from passes import CostModel, run_passes
from remat_compiler.budget import Budget, parse_budget
from remat_compiler.check import check_plan
from remat_compiler.codegen import emit
from remat_compiler.costgraph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.policies import Policy, apply_policy
from remat_compiler.solvers import get_solver, solve
from remat_compiler.trace import StepFunction, aot_step, flatten_step, run_traced, signature_of, trace

__all__ = ["compile", "CompiledModule", "plan_model", "plan_graph", "PlannedGraph", "analyze", "prepared"]


@dataclass
class PlannedGraph:
    """Every intermediate of the pipeline, for inspection and dumps."""

    gm: fx.GraphModule
    cg: CostGraph
    plan: Plan
    sim: Any = None


def prepared(model: torch.nn.Module, solver) -> contextlib.AbstractContextManager:
    """The solver's model preparation for tracing, if it has one (``solver.prepare_model(model)``).

    A strategy that needs a different traced graph (the MoE custom backward traces the fused combine)
    provides ``prepare_model``, a context manager active while the step is traced.
    """
    prepare = getattr(get_solver(solver), "prepare_model", None)
    return prepare(model) if prepare is not None else contextlib.nullcontext()


def analyze(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
            cost_model: CostModel | None = None, solver="cpsat",
            hold_outputs: bool = True) -> tuple[fx.GraphModule, CostGraph]:
    """Trace and annotate a model's step: the first three pipeline steps (``hold_outputs``: see
    :func:`compile`)."""
    with prepared(model, solver):
        traced = trace(model, args, kwargs, loss_only=not hold_outputs)
    gm = run_passes(traced.joint, num_fwd_outputs=traced.num_fwd_outputs, cost_model=cost_model)
    return gm, CostGraph.from_graph_module(gm, hold_outputs=hold_outputs)


def plan_graph(gm: fx.GraphModule, cg: CostGraph, memory_budget=None, *,
               solver: str | Callable[..., Plan] = "cpsat", policy: Policy | None = None,
               **solver_options) -> PlannedGraph:
    """Solve and check a plan for an analysed graph: the pipeline's ``solve`` and ``check_plan``.

    ``policy`` (:mod:`remat_compiler.policies`) turns into the solver's ``forced_saved`` and
    ``forbidden_saved``; a solver that takes neither raises ValueError.
    """
    if policy is not None:
        if "forced_saved" not in inspect.signature(get_solver(solver)).parameters:
            raise ValueError(f"a policy constrains CP-SAT; solver {solver!r} takes no forced saves "
                             f"(use solver='cpsat')")
        solver_options["forced_saved"], solver_options["forbidden_saved"] = apply_policy(cg, policy)
    plan = solve(cg, memory_budget, solver, **solver_options)
    sim = check_plan(cg, plan)
    return PlannedGraph(gm=gm, cg=cg, plan=plan, sim=sim)


def plan_model(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, memory_budget=None, *,
               solver: str | Callable[..., Plan] = "cpsat", cost_model: CostModel | None = None,
               hold_outputs: bool = True, **solver_options) -> PlannedGraph:
    """Plan recomputation for one call of a model without running it (the CLI's ``plan``).

    Parameters
    ----------
    model, args, kwargs :
        The model and an example call (only shapes and dtypes matter).
    memory_budget :
        Bytes, a unit string, a fraction of the no-recompute peak, or None.
    solver :
        A solver name (``"cpsat"``, ``"save_all"``, ``"checkpoint_blocks"``, MoE strategies) or a
        callable ``solve(cost_graph, budget_bytes, **opts) -> Plan``.

    Returns
    -------
    PlannedGraph

    Raises
    ------
    ValueError, InfeasibleBudgetError, UntraceableModelError
    """
    parse_budget(memory_budget)
    get_solver(solver)
    gm, cg = analyze(model, args, kwargs, cost_model=cost_model, solver=solver, hold_outputs=hold_outputs)
    return plan_graph(gm, cg, memory_budget, solver=solver, **solver_options)


@dataclass
class _Entry:
    step: StepFunction
    fn: Callable
    planned: PlannedGraph | None = None
    calls: int = 0
    extras: dict = field(default_factory=dict)


class CompiledModule(torch.nn.Module):
    """A model that trains with a recomputation plan. Built by :func:`compile`.

    It shares the original's parameters and buffers: ``parameters()``, ``state_dict()`` (same keys as
    the original) and optimizers built on either keep working. Each new input signature (shapes,
    dtypes, devices, requires_grad, non-tensor arguments) is traced and planned on its first call;
    ``plan`` is the plan of the last call. In ``eval()`` or without grad, the model runs as is.
    """

    def __init__(self, model: torch.nn.Module, budget: Budget, solver, cost_model: CostModel | None,
                 plan: Plan | None, solver_options: dict, hold_outputs: bool = True):
        super().__init__()
        self._hold_outputs = hold_outputs
        self._orig_mod = model
        self._budget = budget
        self._solver = solver
        self._cost_model = cost_model
        self._fixed_plan = plan
        self._solver_options = solver_options
        self._entries: dict[tuple, _Entry] = {}
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

    def _key(self, args, kwargs) -> tuple:
        req = tuple(p.requires_grad for p in self._orig_mod.parameters())
        return (signature_of(args, kwargs), req, self._orig_mod.training)

    def _partition(self, entry: _Entry):
        def partition(joint, _joint_inputs, *, num_fwd_outputs, **_kw):
            gm = run_passes(joint, num_fwd_outputs=num_fwd_outputs, cost_model=self._cost_model)
            cg = CostGraph.from_graph_module(gm, hold_outputs=self._hold_outputs)
            if self._fixed_plan is not None:
                self._fixed_plan.check_applies_to(cg)
                plan = self._fixed_plan
                planned = PlannedGraph(gm, cg, plan, check_plan(cg, plan))
            else:
                planned = plan_graph(gm, cg, self._budget, solver=self._solver, **self._solver_options)
                planned = _sync_across_ranks(planned)
            entry.planned = planned
            return emit(gm, planned.plan)
        return partition

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not self._orig_mod.training:
            return self._orig_mod(*args, **kwargs)
        key = self._key(args, kwargs)
        entry = self._entries.get(key)
        step, flat = flatten_step(self._orig_mod, args, kwargs, loss_only=not self._hold_outputs)
        if entry is None:
            entry = _Entry(step=step, fn=None)
            entry.fn = aot_step(step, self._partition(entry))
            with prepared(self._orig_mod, self._solver):
                out = run_traced(entry.fn, self._orig_mod, step.state_tensors() + flat)
            self._entries[key] = entry
        else:
            out = entry.fn(*entry.step.state_tensors(), *flat)
        entry.calls += 1
        self.planned = entry.planned
        self.plan = entry.planned.plan
        return entry.step.unflatten_outputs(out)


def _sync_across_ranks(planned: PlannedGraph) -> PlannedGraph:
    """Under torch.distributed, every rank takes rank 0's plan (a differing plan deadlocks collectives)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return planned
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    payload = [planned.plan.to_json() if dist.get_rank() == 0 else None]
    with unset_fake_temporarily():  # planning runs inside AOTAutograd's fake mode; the broadcast is real
        dist.broadcast_object_list(payload, src=0)
    plan = Plan.from_json(payload[0])
    sim = check_plan(planned.cg, plan)
    return PlannedGraph(planned.gm, planned.cg, plan, sim)


def compile(model: torch.nn.Module, memory_budget=None, *, solver: str | Callable[..., Plan] = "cpsat",
            cost_model: CostModel | None = None, plan: Plan | None = None, hold_outputs: bool = True,
            policy: Policy | None = None, **solver_options) -> CompiledModule:
    """Return a module that trains like ``model`` with recomputation planned under ``memory_budget``.

    Parameters
    ----------
    model : torch.nn.Module
    memory_budget : int | str | float | None
        Peak bytes of the training step above what was resident before it (parameters, inputs and
        optimizer state excluded; activations, recomputed values, gradients included): an int of
        bytes, a unit string (``"1.5GiB"``), a fraction in (0, 1] of the no-recompute peak, or None
        (no limit: the no-recompute plan).
    solver : str | callable
        ``"cpsat"`` (default), ``"save_all"``, ``"checkpoint_blocks"``, an MoE strategy, or a callable
        ``solve(cost_graph, budget_bytes, **opts) -> Plan``.
    cost_model : passes.CostModel, optional
        Compute rate and bandwidths for the runtime estimate.
    plan : Plan, optional
        Apply this saved plan instead of solving (it must be for the same graph).
    policy : callable, optional
        Hard decisions the solver obeys (:mod:`remat_compiler.policies`: ``save_matmuls``,
        ``save_only(...)``, ``never_save(...)``, ``first_of(...)``), given with ``solver="cpsat"``.
    hold_outputs : bool
        True (default, safe): the caller keeps the model's outputs until backward ends, as in
        ``out = m(x); loss_fn(out, y).backward()``; they count to the end of the step. False: the
        caller lets go of them before backward except the scalar loss it calls ``backward()`` on
        (``m(x, labels=y).loss.backward()`` drops the logits); the plan then frees, keeps or
        recomputes them like any other value. If the model returns a scalar loss, backward runs
        from it alone: the other outputs come back without a gradient path (a backward through
        them raises), so no zero gradient the size of the logits is made for them. If a caller
        that said False holds them anyway, the step peaks above the plan by up to their size.
    **solver_options :
        Passed to the solver (``time_limit_s``, ``num_workers``...).

    Returns
    -------
    CompiledModule

    Raises
    ------
    ValueError
        For a budget that is not one of the accepted forms, or an unknown solver.

    Example
    -------
    >>> m = remat_compiler.compile(model, memory_budget="1.5GiB")   # doctest: +SKIP
    >>> loss_fn(m(x), y).backward(); print(m.plan.explain())         # doctest: +SKIP
    """
    budget = parse_budget(memory_budget)
    get_solver(solver)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile expects an nn.Module, got {type(model).__name__}")
    if policy is not None:
        solver_options["policy"] = policy
    return CompiledModule(model, budget, solver, cost_model, plan, solver_options, hold_outputs)
