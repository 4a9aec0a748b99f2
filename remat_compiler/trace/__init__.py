"""Capture a model's training step (forward + backward) as one joint aten-level fx graph.

The capture is PyTorch's own: AOTAutograd traces the model's forward with FakeTensors and autograd's
backward into one joint graph, whose placeholders are ``primals_*`` (parameters, buffers, inputs) and
``tangents_*`` (gradients of the outputs). Every node carries ``meta["val"]`` (a FakeTensor with shape,
dtype and storage identity) and ``meta["custom"]["remat.trace_module"]``, the dotted path of the innermost
module that ran it.

Beside the capture: :mod:`.device` traces a model that holds no data (meta tensors, FakeTensors) for
the device it is planned for, and :mod:`.failures` says why a trace failed and what to do instead.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_function
from torch.func import functional_call

from remat_compiler.passes import keys
from remat_compiler.eager_paths import as_eager_runs
from remat_compiler.errors import UntraceableModelError
from remat_compiler.trace.device import (META_PLANS_FOR, DeviceTraceWarning, tensors_for_planning, trace_device,
                                         warn_cpu_only_ops, without_data)
from remat_compiler.trace.failures import describe_trace_failure, is_tracing_failure
from remat_compiler.trace_sites import boolean_index_sites, config_advice, user_frame

__all__ = ["StepFunction", "TracedStep", "trace", "flatten_step", "signature_of_leaves",
           "annotate_joint", "without_data", "tensors_for_planning", "META_PLANS_FOR", "trace_device",
           "DeviceTraceWarning", "trace_step", "aot_step", "run_traced", "aot_logs_wanted",
           "copy_graph_module"]

MODULE_KEY = keys.TRACE_MODULE
MODULE_CLASS_KEY = keys.TRACE_MODULE_CLASS
MUTATED_KEY = keys.MUTATED_INPUT
HOLD_OUTPUTS_KEY = keys.HOLD_OUTPUTS


@dataclass
class StepFunction:
    """A model call flattened to ``fn(*params, *buffers, *tensor_inputs) -> tuple(tensor_outputs)``.

    Non-tensor arguments are baked in as constants (they are part of the signature), and the output's
    non-tensor leaves are restored by :meth:`unflatten_outputs`.

    ``hold_outputs`` says whether the caller keeps the model's outputs through backward (see
    :func:`remat_compiler.compile`). Without it (or when ``loss_only_reason`` gives another reason)
    and with a scalar output that requires grad (the loss), the other outputs leave the traced step
    without a gradient path: backward then gets no zero-filled gradient for them (autograd
    materialises one per unused output of a custom Function, as large as the logits).
    :meth:`unflatten_outputs` hands them back behind a guard whose backward raises, so a backward
    through them is an error, never a silently missing gradient.
    """

    model: torch.nn.Module
    param_names: list[str]
    buffer_names: list[str]
    arg_spec: pytree.TreeSpec
    arg_leaves: list[Any]  # tensors replaced by None
    tensor_positions: list[int]
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)  # tensors replaced by None
    out_tensor_positions: list[int] = field(default_factory=list)
    hold_outputs: bool = True
    loss_only_reason: str | None = None  # why only the loss is differentiated (None: every output)
    no_grad_positions: list[int] = field(default_factory=list)  # outputs returned without a gradient
    mutated_positions: set[int] = field(default_factory=set)  # flat inputs the step mutates in place
    plans_for: str | None = None  # the device type planned for, where the trace ran on another one
    trace_notes: list[str] = field(default_factory=list)  # what tracing changed (remat_compiler.eager_paths)

    @property
    def num_state(self) -> int:
        return len(self.param_names) + len(self.buffer_names)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.state_from(tuple(self.model.named_parameters()), tuple(self.model.named_buffers()))

    def state_from(self, named_parameters: Sequence[tuple[str, torch.Tensor]],
                   named_buffers: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The step's parameters then buffers, in its order, out of the model's named ones (as
        ``named_parameters()`` and ``named_buffers()`` list them now)."""
        if [n for n, _ in named_parameters] == self.param_names \
                and [n for n, _ in named_buffers] == self.buffer_names:
            return [t for _, t in named_parameters] + [t for _, t in named_buffers]
        named_p, named_b = dict(named_parameters), dict(named_buffers)
        return [named_p[n] for n in self.param_names] + [named_b[n] for n in self.buffer_names]

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n_p, n_s = len(self.param_names), self.num_state
        state = dict(zip(self.param_names, flat[:n_p]))
        state.update(zip(self.buffer_names, flat[n_p:n_s]))
        leaves = list(self.arg_leaves)
        for pos, tensor in zip(self.tensor_positions, flat[n_s:]):
            leaves[pos] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.arg_spec)
        out = functional_call(self.model, state, args, kwargs)
        self.mutated_positions |= {i for i, t in enumerate(flat) if _has_data_mutation(t)}
        out_leaves, out_spec = pytree.tree_flatten(out)
        self.no_grad_positions = []
        if self.loss_only_reason is not None and any(isinstance(x, torch.Tensor) and x.dim() == 0 and x.requires_grad
                                  for x in out_leaves):
            for i, x in enumerate(out_leaves):
                if isinstance(x, torch.Tensor) and x.dim() != 0 and x.requires_grad:
                    out_leaves[i] = x.detach()
                    self.no_grad_positions.append(i)
        self.out_spec = out_spec
        self.out_tensor_positions = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        self.out_leaves = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return tuple(out_leaves[i] for i in self.out_tensor_positions)

    def flat_input_name(self, i: int) -> str:
        """The name of flat input ``i``: a parameter's or buffer's dotted name, or ``input <k>``."""
        names = self.param_names + self.buffer_names
        return names[i] if i < len(names) else f"input {i - len(names)}"

    def unflatten_outputs(self, tensors) -> Any:
        leaves = list(self.out_leaves)
        for pos, tensor in zip(self.out_tensor_positions, tensors):
            leaves[pos] = tensor
        if self.no_grad_positions:
            loss = next(x for x in leaves if isinstance(x, torch.Tensor) and x.dim() == 0 and x.requires_grad)
            for pos in self.no_grad_positions:
                leaves[pos] = _NoGradientThrough.apply(leaves[pos], loss, self.loss_only_reason)
        return pytree.tree_unflatten(leaves, self.out_spec)


HOLD_OUTPUTS_OFF = "hold_outputs=False"
INPLACE_AFTER_SAVE = (
    "the model modifies in place a value that backward through this output would need, so (as in "
    "eager, where such a backward raises) only the scalar loss is differentiated")


def is_inplace_after_save(exc: BaseException) -> bool:
    """Autograd's error for a backward that reads a value modified in place after it was saved."""
    return isinstance(exc, RuntimeError) and "modified by an inplace operation" in str(exc)


def _has_data_mutation(t) -> bool:
    """Whether AOTAutograd's functionalization saw ``t``'s data mutated (False outside a trace)."""
    from torch._functorch._aot_autograd.functional_utils import has_data_mutation
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FunctionalTensor) and bool(has_data_mutation(t))


def annotate_joint(joint: fx.GraphModule, step: StepFunction) -> fx.GraphModule:
    """Record on the joint graph what the trace knows and the graph does not show.

    ``gm.meta["remat.hold_outputs"]``: whether the caller keeps the outputs through backward (read
    by :meth:`~remat_compiler.graph.CostGraph.from_graph_module`). ``meta["remat.mutated_input"]``
    (the input's name) on the placeholders of the inputs the step mutates in place (a buffer's
    ``add_``, training-mode BatchNorm's running statistics): their value in backward is not the
    forward's, so nothing that reads them may be recomputed there (:mod:`remat_compiler.passes.costs`).
    ``gm.meta["remat.device"]``: the device type the step runs on (the traced tensors', or
    ``step.plans_for`` when the trace ran on the CPU in place of CUDA, then also
    ``gm.meta["remat.traced_on"] = "cpu"``). ``gm.meta["remat.trace_notes"]``: what the trace changed
    to follow eager's path (:mod:`remat_compiler.eager_paths`).
    """
    from remat_compiler.passes.storage import step_device

    joint.meta[HOLD_OUTPUTS_KEY] = step.hold_outputs
    joint.meta[keys.TRACE_NOTES] = list(step.trace_notes)
    traced_on = step_device(joint)
    joint.meta[keys.DEVICE] = step.plans_for or traced_on
    if step.plans_for is not None and step.plans_for != traced_on:
        joint.meta[keys.TRACED_ON] = traced_on
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    for i, n in enumerate(primals):
        if i in step.mutated_positions:
            n.meta[MUTATED_KEY] = step.flat_input_name(i)
    return joint


class _NoGradientThrough(torch.autograd.Function):
    """An output planned without a gradient path (``hold_outputs=False``): backward through it raises."""

    @staticmethod
    def forward(ctx, out, _loss, reason):
        ctx.reason = reason
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *_grads):
        if ctx.reason != HOLD_OUTPUTS_OFF:
            raise RuntimeError(f"this output of the compiled model has no gradient path: {ctx.reason}")
        raise RuntimeError(
            "this output of a model compiled with hold_outputs=False has no gradient path: that "
            "setting plans a step that calls backward() on the scalar loss only. Compile with "
            "hold_outputs=True (the default) to backpropagate through the model's other outputs.")


def flatten_step(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                 hold_outputs: bool = True) -> tuple[StepFunction, list[torch.Tensor]]:
    """Flatten ``model(*args, **kwargs)`` into a :class:`StepFunction` and its tensor inputs
    (``hold_outputs``: see :class:`StepFunction`)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    step = StepFunction(
        model=model,
        param_names=[n for n, _ in model.named_parameters()],
        buffer_names=[n for n, _ in model.named_buffers()],
        arg_spec=spec,
        arg_leaves=[None if isinstance(x, torch.Tensor) else x for x in leaves],
        tensor_positions=positions,
        hold_outputs=hold_outputs,
        loss_only_reason=None if hold_outputs else HOLD_OUTPUTS_OFF,
    )
    return step, [leaves[i] for i in positions]


def signature_of_leaves(leaves: list, spec: pytree.TreeSpec) -> tuple:
    """A hashable key of a call, flattened (``pytree.tree_flatten((tuple(args), kwargs))``): each
    tensor's shape, dtype, device and requires_grad; other leaves as is."""
    key = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append(("T", tuple(x.shape), str(x.dtype), str(x.device), bool(x.requires_grad)))
        else:
            try:
                hash(x)
                key.append(("C", x))
            except TypeError:
                key.append(("C", repr(x)))
    return (str(spec), tuple(key))


class _ModuleAnnotator:
    """Forward hooks that record, on every traced node, the innermost module that produced it.

    ``running`` is the stack of ``(path, module)`` being run; a module whose forward raised is not
    popped, so after a tracing failure its last entry is the module that failed."""

    def __init__(self, model: torch.nn.Module):
        self._handles = []
        self._stack: list[Any] = []
        self.running: list[tuple[str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name, type(module).__name__)))
            self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, name: str, cls: str) -> Callable:
        def hook(module, args):
            self.running.append((name, module))
            meta = fx_traceback.current_meta
            self._stack.append(meta.get("custom"))
            custom = dict(meta.get("custom") or {})
            custom[MODULE_KEY] = name
            custom[MODULE_CLASS_KEY] = cls
            meta["custom"] = custom
        return hook

    def _exit(self, module, args, output):
        self.running.pop()
        meta = fx_traceback.current_meta
        old = self._stack.pop()
        if old is None:
            meta.pop("custom", None)
        else:
            meta["custom"] = old

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class TracedStep:
    """The joint graph of one training step and what is needed to interpret it."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    step: StepFunction


class _JointCaptured(Exception):
    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int):
        super().__init__("joint graph captured")
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs


def _boxed(gm: fx.GraphModule, example_inputs) -> Callable:
    """Run the graph as is, with the boxed calling convention so each input is freed after last use."""
    from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, example_inputs)


def copy_graph_module(gm: fx.GraphModule, env: dict | None = None) -> fx.GraphModule:
    """A copy of ``gm`` with nodes of its own (the same names; each node's meta a new dict of the same
    values), its output's meta, its calling convention and its ``meta``; its Python code is generated
    when first asked for. ``env``, if given, is filled with each node of ``gm`` and its copy."""
    from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module

    graph = fx.Graph()
    env = {} if env is None else env
    out = graph.graph_copy(gm.graph, env)
    graph.output(out).meta = dict(next(iter(gm.graph.find_nodes(op="output"))).meta)
    graph._codegen = gm.graph._codegen
    copy = _make_graph_module(gm, graph, graph_module_cls=_LazyGraphModule)
    copy.meta.update(gm.meta)
    return copy


def aot_logs_wanted() -> bool:
    """Whether anyone reads AOTAutograd's graph logs (``TORCH_LOGS`` naming its graphs, or a
    ``TORCH_TRACE`` / ``TORCH_COMPILE_DEBUG`` structured log): it prints the joint, forward and
    backward graphs for them whether they are read or not (measured: 3.5% of the zoo's tests)."""
    import logging
    import os

    from torch._functorch._aot_autograd import graph_compile

    if os.environ.get("TORCH_TRACE") or os.environ.get("TORCH_COMPILE_DEBUG"):
        return True
    return any(log.isEnabledFor(logging.INFO) for log in (graph_compile.aot_joint_log, graph_compile.aot_graphs_log))


def aot_step(step: StepFunction, partition_fn: Callable, *, fw_compiler: Callable = _boxed,
             bw_compiler: Callable = _boxed, decompositions: dict | None = None) -> Callable:
    """Wrap ``step`` in AOTAutograd with our partitioner; the result runs forward and backward.

    By default the partitioned graphs run as they are (op by op); the Inductor backend passes its
    compilers and decompositions (:mod:`remat_compiler.inductor`)."""
    return aot_function(step, fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                        decompositions=decompositions, enable_log=aot_logs_wanted())


def run_traced(fn: Callable, model: torch.nn.Module, flat: list[torch.Tensor], step: StepFunction | None = None):
    """Call an AOT-wrapped step with module annotation on, tracing the path eager runs
    (:func:`~remat_compiler.eager_paths.as_eager_runs`, its notes kept in ``step.trace_notes``); map
    tracing failures to clear errors."""
    annotator = _ModuleAnnotator(model)
    try:
        with fx_traceback.preserve_node_meta(), _compiling(), as_eager_runs(model) as notes:
            if step is not None:
                step.trace_notes = notes
            return fn(*flat)
    except _JointCaptured:
        raise
    except UntraceableModelError:
        raise
    except Exception as exc:  # re-raised with the failing op and user line named; never swallowed
        if is_tracing_failure(exc):
            failed = annotator.running[-1] if annotator.running else None
            sites = []
            if user_frame(traceback.extract_tb(exc.__traceback__)) is None:  # raised in backward: trace again
                with fx_traceback.preserve_node_meta(), _compiling(), as_eager_runs(model):
                    sites = boolean_index_sites(lambda: fn(*flat),
                                                lambda: annotator.running[-1][0] if annotator.running else "")
            raise UntraceableModelError(describe_trace_failure(exc, failed, sites, config_advice(model))) from exc
        raise
    finally:
        annotator.remove()


@contextlib.contextmanager
def _compiling():
    """Tell models they are being compiled, as torch.compile does, so they take their traceable paths
    (HuggingFace models skip data-dependent fast-path checks when ``torch.compiler.is_compiling()``)."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, hold_outputs: bool = True,
          device=None) -> TracedStep:
    """Capture the joint forward+backward aten graph of ``model(*args, **kwargs)``.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its parameters and buffers become graph inputs. They may be on the meta device
        or FakeTensors (:func:`tensors_for_planning`: a meta model is traced as on the CPU).
    args, kwargs :
        Example inputs. Only shapes, dtypes and ``requires_grad`` matter; nothing runs for real
        (they may be on the meta device too).
    hold_outputs : bool
        Whether the caller keeps the outputs through backward (see :func:`remat_compiler.compile`);
        recorded in the graph's meta.
    device : str or torch.device, optional
        The device a model whose tensors hold no data (meta) is planned for (default: the CPU); a
        model with data on a device plans for that one. ``"cuda"`` traces fake CUDA tensors where
        PyTorch is built with CUDA, and on a CPU-only build traces on the CPU and plans for CUDA
        (:func:`trace_device`: what differs, and a :class:`DeviceTraceWarning` where it matters).

    Returns
    -------
    TracedStep
        The joint GraphModule (``primals_*``, ``tangents_*`` placeholders; node ``meta["val"]``),
        how many of its outputs belong to the forward, and the flattened step function.

    Raises
    ------
    UntraceableModelError
        If the model has data-dependent shapes or control flow; the message names the op and line.
    """
    step, flat_inputs = flatten_step(model, args, kwargs, hold_outputs=hold_outputs)
    return trace_step(step, model, step.state_tensors() + flat_inputs, device=device)


def trace_step(step: StepFunction, model: torch.nn.Module, flat: list, *, device=None) -> TracedStep:
    """:func:`trace` for a step already flattened (:func:`flatten_step`): ``flat`` is its state
    tensors and then its inputs. Nothing runs for real (the step is traced on fake tensors), so a
    compiled module's first call can trace its step again, e.g. with other MoE combines.

    Raises
    ------
    UntraceableModelError
        As :func:`trace`.
    """
    trace_as = META_PLANS_FOR
    if device is not None and any(without_data(t) for t in flat):
        trace_as, step.plans_for = trace_device(device)

    def capture(joint, _inputs, *, num_fwd_outputs, **_kw):
        raise _JointCaptured(annotate_joint(joint, step), num_fwd_outputs)

    fn = aot_step(step, capture)
    try:
        run_traced(fn, model, tensors_for_planning(flat, trace_as), step)
    except _JointCaptured as captured:
        if step.plans_for is not None:
            warn_cpu_only_ops(captured.joint, step.plans_for)
        return TracedStep(joint=captured.joint, num_fwd_outputs=captured.num_fwd_outputs, step=step)
    raise UntraceableModelError(
        "the model's forward produced no output that requires grad, so there is no backward to plan: "
        "make sure parameters or inputs require grad and the output depends on them")
