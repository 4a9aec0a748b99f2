"""The module users train with: :class:`CompiledModule`, one traced and planned entry per input signature.

Its first call with a new signature traces the step, chooses MoE combines where the default solver can
(:func:`remat_compiler.combines.resolve_combines`), and has AOTAutograd's partitioner run the pipeline
(:func:`remat_compiler.pipeline.plan_joint`) on the joint graph; the Inductor backend's first call is
:func:`remat_compiler.inductor.backend.first_call`. Later calls run the emitted step, behind a gate
that passes only the gradients a backward reads (:class:`~remat_compiler.runtime.GradGate`).
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from remat_compiler.combines import resolve_combines
from remat_compiler.dynamic import DynamicShapeError, ShapeBounds, entry_key, is_range_key, trace_and_run_range
from remat_compiler.errors import UntraceableModelError
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.fsdp.units import refuse_sharded_after
from remat_compiler.pipeline import PlannedGraph, PlanSpec, plan_joint
from remat_compiler.plan import Plan
from remat_compiler.runtime import ForwardWithSignature, GradGate, GradRecord, grad_deps
from remat_compiler.solvers.cpsat import SolveMemo
from remat_compiler.trace import (INPLACE_AFTER_SAVE, StepFunction, annotate_joint, aot_step, flatten_step,
                                  is_inplace_after_save, run_traced, signature_of_leaves, trace_step, without_data)

__all__ = ["CompiledModule", "BACKENDS", "check_wrapper"]


@dataclass
class _Entry:
    """One input signature's traced step: what runs it, its plan, and what its calls need."""

    step: StepFunction
    fn: Callable
    planned: PlannedGraph | None = None
    calls: int = 0
    grad_deps: list | None = None     # per flat input: the tangents its gradient reads (see GradGate)
    gate: bool = True                 # whether calls need the gate (decided once the graph is known)
    example: list | None = None       # the first call's state tensors and inputs (to trace it again)
    inductor: Any = None              # the Inductor backend's state (remat_compiler.inductor.backend.InductorState)
    shapes: object = None             # a range of shapes (remat_compiler.dynamic): its ShapeBounds
    #                                   until traced, then the ShapeRange each call is checked against

    @property
    def replans(self) -> bool:
        """Whether the next call plans this signature again: its Inductor code's first step measured
        above the budget."""
        return self.inductor is not None and self.inductor.over is not None


#: What can run the planned forward and backward (``compile(..., backend=)``).
BACKENDS = ("eager", "inductor")


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

    def _partition(self, entry: _Entry, spec: PlanSpec) -> Callable:
        """AOTAutograd's partition function for this entry: the joint graph planned under ``spec``
        (:func:`~remat_compiler.pipeline.plan_joint`), its forward and backward the partition."""
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
        if entry is None or entry.replans:
            step, flat = flatten_step(self._orig_mod, args, kwargs, hold_outputs=self._hold_outputs)
            with _TRACE_LOCK:
                entry = self._entries.get(key)
                if entry is None:
                    return self._first_call(key, step, flat)
                if entry.replans:  # its first step measured above the budget: plan again
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
            entry.inductor = after.inductor
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
        refuse_sharded_after(self)

    def _trace_and_run(self, entry: _Entry, inputs: list[torch.Tensor]):
        """Trace, plan and compile the step on its first call, and run its forward."""
        if entry.shapes is not None:  # one plan for a range of shapes, else per shape from now on
            try:
                if self._backend == "eager":
                    return trace_and_run_range(self, entry, inputs)
                from remat_compiler.inductor.ranges import first_call_range

                return first_call_range(self, entry, inputs)
            except (DynamicShapeError, UntraceableModelError) as exc:
                self._shapes_off, entry.shapes, entry.planned = str(exc), None, None
                warnings.warn(f"max_seq_len: this step cannot be planned once for every length ({exc}); "
                              f"each new shape is traced and planned on its own", RuntimeWarning, stacklevel=4)
        if self._backend == "eager":
            return self._trace_and_run_eager(entry, inputs)
        # imported here: Inductor's decomposition table costs a second at import, which the eager
        # backend never needs
        from remat_compiler.inductor.backend import first_call

        return first_call(entry, self._spec, self._orig_mod, inputs,
                          partition=lambda spec: self._partition(entry, spec),
                          eager=lambda: self._trace_and_run_eager(entry, inputs))

    def _trace_and_run_eager(self, entry: _Entry, inputs: list[torch.Tensor]):
        """The eager backend's first call: the combine choice, then the trace, plan and emit
        (:meth:`_partition`), and the step's forward."""
        spec = resolve_combines(self._spec, self._orig_mod,
                                lambda: trace_step(entry.step, self._orig_mod, entry.example))
        entry.fn = aot_step(entry.step, self._partition(entry, spec))
        with spec.prepared(self._orig_mod):
            return run_traced(entry.fn, self._orig_mod, inputs, entry.step)

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


def check_wrapper(model: torch.nn.Module) -> None:
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
