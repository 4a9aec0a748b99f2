"""The compiler in one flat list of steps, and the module users train with.

::

    gm = trace(model, args)                              # joint fwd+bwd aten graph (AOTAutograd)
    gm = run_passes(gm, num_fwd_outputs=...)             # phases, storage, costs, blocks, MoE tags
    cg = CostGraph.from_graph_module(gm)                 # networkx graph with bytes / FLOPs / runtime
    plan = solve(cg, budget, solver)                     # CP-SAT or a hand-picked strategy
    check_plan(cg, plan)                                 # the plan agrees with the simulator
    fw, bw = emit(gm, plan)                              # forward / backward GraphModules
    check_emitted(fw, bw, plan, cg)                      # the emitted code peaks where the plan says

:func:`compile` runs the same steps inside AOTAutograd's partitioner, once per input signature.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import networkx as nx
import torch
import torch.fx as fx

from passes import CostModel, run_passes
from remat_compiler.budget import Budget, parse_budget
from remat_compiler.check import check_emitted, check_plan
from remat_compiler.codegen import emit
from remat_compiler.costgraph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError, PlanMismatchError, RematError
from remat_compiler.plan import Plan
from remat_compiler.policies import Policy, apply_policy
from remat_compiler.solvers import get_solver, resolve_budget, solve
from remat_compiler.trace import (INPLACE_AFTER_SAVE, StepFunction, aot_step, flatten_step,
                                  is_inplace_after_save, mark_mutated_inputs, run_traced, signature_of,
                                  trace)

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
    check_time_limit(solver_options.get("time_limit_s"))
    gm, cg = analyze(model, args, kwargs, cost_model=cost_model, solver=solver, hold_outputs=hold_outputs)
    return plan_graph(gm, cg, memory_budget, solver=solver, **solver_options)


@dataclass
class _Entry:
    step: StepFunction
    fn: Callable
    planned: PlannedGraph | None = None
    calls: int = 0
    extras: dict = field(default_factory=dict)
    grad_deps: list | None = None     # per flat input: the tangents its gradient reads (see _GradGate)
    gate: bool = True                 # whether calls need the gate (decided once the graph is known)


# One trace at a time in this process: a trace swaps the model's parameters for the trace's tensors
# (functional_call) and sets torch.compiler's process-wide "compiling" flag; two at once corrupt both.
_TRACE_LOCK = threading.RLock()


class _GradRecord:
    """Which of a call's outputs backward reached: filled by hooks on the outputs, read by the gate."""

    def __init__(self, entry: _Entry):
        self.entry = entry
        self.reached: set[int] = set()

    def hook(self, i: int) -> Callable:
        def mark(grad):
            if grad is not None:  # autograd calls the hooks of unreached outputs with None
                self.reached.add(i)
        return mark


class _GradGate(torch.autograd.Function):
    """Identity on the inputs that require grad; in backward, None for each input whose gradient
    reads only outputs backward never reached, as in eager (AOTAutograd's backward gets zeros for
    unused outputs and would hand back zero gradients where eager leaves ``.grad`` None)."""

    @staticmethod
    def forward(ctx, record, positions, *tensors):
        ctx.set_materialize_grads(False)  # an input backward gives no gradient stays None
        ctx.record, ctx.positions = record, positions
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        deps, reached = ctx.record.entry.grad_deps, ctx.record.reached
        out = []
        for pos, g in zip(ctx.positions, grads):
            d = deps[pos] if deps is not None and pos < len(deps) else None
            out.append(None if g is None or (d is not None and not (d & reached)) else g)
        return (None, None, *out)


def _grad_deps(planned: PlannedGraph) -> list | None:
    """For each flat input, the indices of the tangents its gradient depends on (None: no gradient)."""
    cg = planned.cg
    tangents = {t: i for i, t in enumerate(cg.tangents)}
    deps = []
    for o in cg.bw_outputs:
        if o is None:
            deps.append(None)
            continue
        deps.append(frozenset(tangents[a] for a in nx.ancestors(cg.g, o) | {o} if a in tangents))
    return deps


class _ForwardWithSignature:
    """``CompiledModule.forward``: on an instance, the compiled step with the original ``forward``'s
    signature (HF ``Trainer`` reads it to pick the dataset columns the model takes); on the class,
    the plain step function."""

    def __get__(self, obj, objtype=None) -> Callable:
        if obj is None:
            return objtype._step
        fn = obj.__dict__.get("_forward_with_signature")
        if fn is None or fn.owner() is not obj:  # (a copy made without __getstate__ has the original's)
            step = obj._step

            def fn(*args, **kwargs):
                return step(*args, **kwargs)
            fn.owner = weakref.ref(obj)
            try:
                fn.__signature__ = inspect.signature(obj._orig_mod.forward)
            except (TypeError, ValueError):  # a forward without a signature (a builtin)
                pass
            fn.__doc__ = obj._orig_mod.forward.__doc__
            obj.__dict__["_forward_with_signature"] = fn
        return fn


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

    def _key(self, args, kwargs) -> tuple:
        """Everything that changes the traced graph: the call's signature, each parameter's and
        buffer's shape, dtype, device and requires_grad, training mode and autocast."""
        state = tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad)
                      for t in (*self._orig_mod.parameters(), *self._orig_mod.buffers()))
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)) + \
            ((torch.is_autocast_cache_enabled(),) if torch.is_autocast_enabled("cpu")
             or torch.is_autocast_enabled("cuda") else ())
        return (signature_of(args, kwargs), state, self._orig_mod.training, autocast)

    def __getstate__(self):
        # the per-signature entries hold AOTAutograd's compiled functions, which do not pickle: a
        # loaded module traces and plans again on its first call (a fixed plan= is kept)
        state = self.__dict__.copy()
        state["_entries"], state["_failures"] = {}, {}
        state.pop("_forward_with_signature", None)
        state["plan"] = state["planned"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def _partition(self, entry: _Entry):
        def partition(joint, _joint_inputs, *, num_fwd_outputs, **_kw):
            joint = mark_mutated_inputs(joint, entry.step)
            gm = run_passes(joint, num_fwd_outputs=num_fwd_outputs, cost_model=self._cost_model)
            cg = CostGraph.from_graph_module(gm, hold_outputs=self._hold_outputs)
            if self._fixed_plan is not None:
                self._fixed_plan.check_applies_to(cg)
                plan = self._fixed_plan
                planned = PlannedGraph(gm, cg, plan, check_plan(cg, plan))
                budget_bytes = resolve_budget(cg, self._budget)
                if budget_bytes is not None and planned.sim.peak_bytes > budget_bytes:
                    raise PlanMismatchError(
                        f"the plan given peaks at {planned.sim.peak_bytes} bytes, above memory_budget "
                        f"{budget_bytes} bytes: pass a larger budget, or leave plan= out to re-plan "
                        f"under this one")
            elif _distributed():
                planned = _plan_on_rank0(gm, cg, lambda: plan_graph(
                    gm, cg, self._budget, solver=self._solver, **self._solver_options))
            else:
                planned = plan_graph(gm, cg, self._budget, solver=self._solver, **self._solver_options)
            entry.planned = planned
            entry.grad_deps = _grad_deps(planned)
            fw, bw = emit(gm, planned.plan)
            check_emitted(fw, bw, planned.plan, cg)
            return fw, bw
        return partition

    forward = _ForwardWithSignature()

    @torch._dynamo.disable  # torch.compile around this module runs the plan as emitted (no graph)
    def _step(self, *args, **kwargs):
        if not torch.is_grad_enabled() or not self._orig_mod.training:
            return self._orig_mod(*args, **kwargs)
        key = self._key(args, kwargs)
        if key in self._failures:  # an infeasible budget for this signature: the same answer, at once
            raise self._failures[key]
        entry = self._entries.get(key)
        step, flat = flatten_step(self._orig_mod, args, kwargs, loss_only=not self._hold_outputs)
        if entry is None:
            with _TRACE_LOCK:
                entry = self._entries.get(key)
                if entry is None:
                    return self._first_call(key, step, flat)
        state = entry.step.state_tensors()
        return self._call(entry, state + flat, entry.gate)

    def _first_call(self, key, step: StepFunction, flat: list[torch.Tensor]):
        entry = _Entry(step=step, fn=None)
        entry.fn = aot_step(step, self._partition(entry))
        record = _GradRecord(entry)
        inputs, positions = self._gated(record, step.state_tensors() + flat)
        try:
            try:
                with prepared(self._orig_mod, self._solver):
                    out = run_traced(entry.fn, self._orig_mod, inputs)
            except RuntimeError as exc:
                # backward through an extra output reads a value the forward then mutated in place:
                # eager only fails if the caller backpropagates through it, so plan the loss alone
                if not is_inplace_after_save(exc) or step.loss_only:
                    raise
                step.loss_only, step.loss_only_reason = True, INPLACE_AFTER_SAVE
                entry.fn = aot_step(step, self._partition(entry))
                with prepared(self._orig_mod, self._solver):
                    out = run_traced(entry.fn, self._orig_mod, inputs)
        except InfeasibleBudgetError as exc:
            self._failures[key] = exc
            raise
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

    def _gated(self, record: _GradRecord, inputs: list[torch.Tensor]):
        positions = tuple(i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad)
        if not positions:
            return inputs, positions
        gated = _GradGate.apply(record, positions, *(inputs[i] for i in positions))
        inputs = list(inputs)
        for i, t in zip(positions, gated):
            inputs[i] = t
        return inputs, positions

    @staticmethod
    def _watch(record: _GradRecord, out):
        k = 0
        for o in out:
            if isinstance(o, torch.Tensor) and o.requires_grad:
                o.register_hook(record.hook(k))
                k += 1
        return out

    def _call(self, entry: _Entry, inputs: list[torch.Tensor], gate: bool):
        if gate:
            record = _GradRecord(entry)
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


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _plan_on_rank0(gm: fx.GraphModule, cg: CostGraph, make_plan: Callable[[], PlannedGraph]) -> PlannedGraph:
    """Under torch.distributed every rank runs rank 0's plan (a differing plan deadlocks collectives):
    rank 0 solves and broadcasts the plan, or the error it met, which every rank then raises (a rank
    that failed alone would leave the others waiting in the broadcast)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    planned, payload = None, [None]
    if dist.get_rank() == 0:
        try:
            planned = make_plan()
            payload = [("plan", planned.plan.to_json())]
        except InfeasibleBudgetError as exc:
            payload = [("infeasible", exc.budget_bytes, exc.min_feasible_bytes, exc.proven, str(exc))]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            payload = [("error", f"{type(exc).__name__}: {exc}")]
            failure = exc
    with unset_fake_temporarily():  # planning runs inside AOTAutograd's fake mode; the broadcast is real
        dist.broadcast_object_list(payload, src=0)
    kind, *rest = payload[0]
    if kind == "infeasible":
        budget, smallest, proven, message = rest
        exc = InfeasibleBudgetError(budget, smallest, proven=proven)
        exc.args = (message,)
        raise exc
    if kind == "error":
        if dist.get_rank() == 0:
            raise failure
        raise RematError(f"rank 0 could not plan this step: {rest[0]}")
    if planned is None:
        plan = Plan.from_json(rest[0])
        planned = PlannedGraph(gm, cg, plan, check_plan(cg, plan))
    return planned


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
            "compile(torch.compile(model)) is not supported: remat_compiler traces the model itself "
            "and runs its plan op by op. Pass the model (remat_compiler.compile(model, ...)); "
            "torch.compile around the compiled module runs the plan unchanged. Running plans with "
            "Inductor is the compiled-speed work, not yet available")


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
    plan : Plan or str, optional
        Apply this saved plan (or its JSON text) instead of solving; it must be for the same
        graph, and with a ``memory_budget`` its peak must fit it (else PlanMismatchError).
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
        For a budget that is not one of the accepted forms, an unknown solver, a time limit that
        is not positive, a ``plan`` that is not a plan, or a wrapper that cannot be compiled
        (``DDP(model)``: compile first, then wrap; ``torch.compile(model)``: pass the model).

    Example
    -------
    >>> m = remat_compiler.compile(model, memory_budget="1.5GiB")   # doctest: +SKIP
    >>> loss_fn(m(x), y).backward(); print(m.plan.explain())         # doctest: +SKIP
    """
    budget = parse_budget(memory_budget)
    get_solver(solver)
    check_time_limit(solver_options.get("time_limit_s"))
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"compile expects an nn.Module, got {type(model).__name__}")
    _check_wrapper(model)
    if isinstance(plan, (str, bytes)):
        plan = Plan.from_json(plan)
    elif plan is not None and not isinstance(plan, Plan):
        raise ValueError(f"plan= takes a Plan or the JSON text Plan.to_json writes, got "
                         f"{type(plan).__name__}")
    if policy is not None:
        solver_options["policy"] = policy
    return CompiledModule(model, budget, solver, cost_model, plan, solver_options, hold_outputs)
