"""Capture a model's training step (forward + backward) as one joint aten-level fx graph.

The capture is PyTorch's own: AOTAutograd traces the model's forward with FakeTensors and autograd's
backward into one joint graph, whose placeholders are ``primals_*`` (parameters, buffers, inputs) and
``tangents_*`` (gradients of the outputs). Every node carries ``meta["val"]`` (a FakeTensor with shape,
dtype and storage identity) and ``meta["custom"]["remat.trace_module"]``, the dotted path of the innermost
module that ran it.
"""
from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_function
from torch.func import functional_call

from passes import keys
from remat_compiler.eager_paths import as_eager_runs
from remat_compiler.errors import UntraceableModelError
from remat_compiler.trace_sites import IndexSite, boolean_index_sites, config_advice, user_frame

__all__ = ["StepFunction", "TracedStep", "trace", "flatten_step", "signature_of_leaves",
           "annotate_joint", "without_data", "tensors_for_planning", "META_PLANS_FOR", "trace_device",
           "DeviceTraceWarning", "trace_step"]

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
    forward's, so nothing that reads them may be recomputed there (:mod:`passes.costs`).
    ``gm.meta["remat.device"]``: the device type the step runs on (the traced tensors', or
    ``step.plans_for`` when the trace ran on the CPU in place of CUDA, then also
    ``gm.meta["remat.traced_on"] = "cpu"``). ``gm.meta["remat.trace_notes"]``: what the trace changed
    to follow eager's path (:mod:`remat_compiler.eager_paths`).
    """
    from passes.storage import step_device

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


#: The device a model on the meta device is traced and planned for (see :func:`tensors_for_planning`).
META_PLANS_FOR = torch.device("cpu")


def without_data(t) -> bool:
    """Whether ``t`` is a tensor with shape and dtype but no data: on the meta device, or fake."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t))


class DeviceTraceWarning(UserWarning):
    """A plan for CUDA was traced on the CPU and its graph has CPU-only kernels: it will not apply
    to the graph the GPU traces (see :func:`trace_device`)."""


def trace_device(device) -> tuple[torch.device, str | None]:
    """Where a model on the meta device planned for ``device`` is traced, and the device type it is
    planned for when that differs (else None).

    PyTorch traces a training step on fake CUDA tensors only where it is built with CUDA (no GPU
    needed for the trace itself). On a CPU-only build (2.13 checked) a forward on fake CUDA tensors
    runs (fake kernels do not touch the device; ``torch.cuda.is_available()`` is False; sdpa's
    backend choice, ``_fused_sdp_choice``, has no CUDA kernel, so fake mode falls back to the math
    decomposition, which is not what a GPU runs either), but autograd records each tensor's stream
    and a CPU-only build has no CUDA device guard: autograd over a fake CUDA tensor that requires
    grad aborts the process (``PyTorch is not linked with support for cuda devices``, thrown where
    Python cannot catch it), so no joint graph can be captured. There the trace runs on the CPU and the graph
    is marked as planned for CUDA (``remat.device = "cuda"``, ``remat.traced_on = "cpu"``): its bytes
    are counted as CUDA's caching allocator charges them and the CPU kernels' scalar quirks are not
    calibrated, so the plan is the one the same graph gets on the GPU. The graph is CUDA's wherever
    the aten ops do not depend on the device, which holds for matmuls, norms, pointwise ops, losses,
    embeddings and dropout (``native_dropout`` on both). It does not hold where the dispatcher
    picks a kernel per device: ``scaled_dot_product_attention`` runs
    ``_scaled_dot_product_flash_attention_for_cpu`` (or the math path) here and CUDA's flash,
    memory-efficient or cuDNN kernel there (chosen from the GPU's architecture, dtype and mask, with
    its own outputs and Philox seed/offset for dropout). Such a graph is reported with a
    :class:`DeviceTraceWarning`; on the GPU its plan is refused with PlanMismatchError (a different
    fingerprint), so plan it on the GPU machine, or build the model with eager attention
    (``attn_implementation="eager"``), whose graph is the same on both.
    """
    device = torch.device(device if device is not None else META_PLANS_FOR)
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        return torch.device("cpu"), "cuda"
    return device, None


#: Substrings of aten op names that only the CPU dispatches to (CUDA picks its own kernel there).
_CPU_ONLY_OPS = ("_for_cpu", "mkldnn", "_cpu_")


def _warn_cpu_only_ops(joint: fx.GraphModule, plans_for: str) -> None:
    ops = sorted({str(n.target) for n in joint.graph.nodes if n.op == "call_function"
                  and any(m in str(n.target) for m in _CPU_ONLY_OPS)})
    if ops:
        warnings.warn(
            f"this plan for {plans_for} was traced on the CPU (this PyTorch is built without CUDA), and its "
            f"graph calls {', '.join(ops)}, which {plans_for} replaces by its own kernels: the GPU will "
            f"trace a different graph and refuse the plan. Plan on the GPU machine, or build the model "
            f"with eager attention (attn_implementation='eager')", DeviceTraceWarning, stacklevel=4)


def tensors_for_planning(tensors: list, device=None) -> list:
    """The tensors a trace runs on: unchanged if all hold data; otherwise FakeTensors of one mode.

    Planning needs shapes, dtypes and the graph, not values, so parameters, buffers and inputs may
    be on the meta device or FakeTensors. A meta tensor has no device to plan for, and tracing on
    meta gives a graph that differs from the real one where the model makes tensors itself
    (``torch.tensor(..., device="meta")`` bypasses fake mode, so HuggingFace's ``DynamicCache``
    concatenates a real meta tensor with a fake one and the trace fails). So each meta tensor
    becomes a FakeTensor on ``device`` (default :data:`META_PLANS_FOR`, the CPU) that wraps it: views of one meta storage stay views of one fake storage, so the storage structure
    (:mod:`passes.storage`) is the one real CPU tensors give, and the graph, its fingerprint, its
    costs (:func:`passes.calibrate_scalar_storage` runs the CPU kernels on zeros, as for a CPU
    model) and the plan are those of the same model with real CPU weights. Real tensors become
    fakes of the same mode (one trace cannot mix modes), and FakeTensors the caller made are kept
    with their own mode and device (a fake CUDA model plans for CUDA). For another ``device`` than
    the CPU, real CPU tensors (example inputs) become FakeTensors on ``device`` too.

    Raises
    ------
    ValueError
        If the FakeTensors come from more than one FakeTensorMode, or are CUDA FakeTensors on a
        build of PyTorch without CUDA.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    if not any(without_data(t) for t in tensors):
        return tensors
    modes = {id(t.fake_mode): t.fake_mode for t in tensors if isinstance(t, FakeTensor)}
    if len(modes) > 1:
        raise ValueError("the model's tensors and the inputs are FakeTensors of different FakeTensorModes: "
                         "make them under one mode (or on the meta device)")
    if not torch.backends.cuda.is_built() and any(isinstance(t, FakeTensor) and t.device.type == "cuda"
                                                  for t in tensors):
        raise ValueError("FakeTensors on cuda cannot be traced by this PyTorch, which is built without CUDA "
                         "(autograd aborts the process on them): build the model on the meta device and "
                         "plan with device='cuda' (or a GPU preset: cost_model=CostModel.preset('h100')), "
                         "which traces on the CPU and plans for CUDA")
    mode = next(iter(modes.values())) if modes else FakeTensorMode()
    device = torch.device(device if device is not None else META_PLANS_FOR)
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            out.append(t)
            continue
        if t.device.type == "meta" or (t.device.type == "cpu" and device.type != "cpu"):
            fake = mode.fake_tensor_converter.from_meta_and_device(mode, t.detach().to("meta"), device)
        else:
            fake = mode.from_tensor(t.detach(), static_shapes=True)
        out.append(fake.requires_grad_(t.requires_grad) if t.requires_grad else fake)
    return out


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


def aot_step(step: StepFunction, partition_fn: Callable, *, fw_compiler: Callable = _boxed,
             bw_compiler: Callable = _boxed, decompositions: dict | None = None) -> Callable:
    """Wrap ``step`` in AOTAutograd with our partitioner; the result runs forward and backward.

    By default the partitioned graphs run as they are (op by op); the Inductor backend passes its
    compilers and decompositions (:mod:`remat_compiler.inductor`)."""
    return aot_function(step, fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=partition_fn,
                        decompositions=decompositions)


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
        if _is_tracing_failure(exc):
            failed = annotator.running[-1] if annotator.running else None
            sites = []
            if user_frame(traceback.extract_tb(exc.__traceback__)) is None:  # raised in backward: trace again
                with fx_traceback.preserve_node_meta(), _compiling(), as_eager_runs(model):
                    sites = boolean_index_sites(lambda: fn(*flat),
                                                lambda: annotator.running[-1][0] if annotator.running else "")
            raise UntraceableModelError(_describe_trace_failure(exc, failed, sites, config_advice(model))) from exc
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


def _is_tracing_failure(exc: Exception) -> bool:
    names = {type(e).__name__ for e in _exception_chain(exc)}
    markers = ("DataDependent", "GuardOnDataDependent", "Unsupported", "UnsupportedOperator",
               "DynamicOutputShape", "TraceError")
    text = " ".join(str(e) for e in _exception_chain(exc))
    return any(m in n for n in names for m in markers) or "data-dependent" in text.lower() \
        or "data dependent" in text.lower() or "_local_scalar_dense" in text or "nonzero" in text


def _exception_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _module_hint(failed: tuple[str, torch.nn.Module] | None) -> tuple[str, str | None]:
    """(where: the module whose forward failed, why it has no static-shape graph and what to do
    instead, where that is known)."""
    if failed is None:
        return "", None
    path, module = failed
    where = f" in module {path or '(the model)'!r} ({type(module).__name__})"
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) == "eager" and hasattr(module, "_apply_gate"):
        # transformers' use_experts_implementation: "eager" is the original per-expert Python loop
        return where, ("transformers' experts_implementation='eager' loops in Python over the experts "
                       "that received tokens (nonzero of the routing mask, then torch.where for each "
                       "expert's tokens), so how many expert GEMMs run and how many rows each has depend "
                       "on the routing values: no static-shape graph exists. Build the model with "
                       "experts_implementation='grouped_mm' (transformers' default; or call "
                       "model.set_experts_implementation('grouped_mm')), whose grouped GEMMs over all "
                       "tokens x top-k routed rows have static shapes.")
    return where, None


def _describe_trace_failure(exc: Exception, failed: tuple[str, torch.nn.Module] | None = None,
                            sites: Sequence[IndexSite] = (), advice: str | None = None) -> str:
    """The message: the failing op, the model line (or, for a failure in backward, the model's
    boolean-mask indexing lines, :func:`~remat_compiler.trace_sites.boolean_index_sites`), the
    module, and what to do (the module's or the model family's advice where known)."""
    op = None
    for e in _exception_chain(exc):
        for token in str(e).replace("(", " ").replace(")", " ").replace(",", " ").split():
            if token.startswith("aten.") or token.startswith("torch.ops."):
                op = token.rstrip(".:")
                break
        if op:
            break
    frame = user_frame(traceback.extract_tb(exc.__traceback__))
    where = f" at {frame.filename}:{frame.lineno} ({frame.line!s})" if frame else ""
    if not frame and sites:
        where = (" in backward, from the boolean-mask indexing at " + "; ".join(map(str, sites))
                 + " (its backward indexes by the mask, a shape that depends on the data)")
    what = f"op {op}" if op else f"{type(exc).__name__}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    in_module, why = _module_hint(failed)
    if why is not None:
        return (f"could not trace the model's training step: {what}{where}{in_module} has a "
                f"data-dependent shape or value ({first_line}): {why}")
    advice = f"; {advice}" if advice else ""
    return (f"could not trace the model's training step: {what}{where}{in_module} has a data-dependent "
            f"shape or value ({first_line}). Make that part static (fixed shapes, no .item()/.nonzero() on "
            f"activations, no Python branching on tensor values) or run it outside the compiled module{advice}.")


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
            _warn_cpu_only_ops(captured.joint, step.plans_for)
        return TracedStep(joint=captured.joint, num_fwd_outputs=captured.num_fwd_outputs, step=step)
    raise UntraceableModelError(
        "the model's forward produced no output that requires grad, so there is no backward to plan: "
        "make sure parameters or inputs require grad and the output depends on them")
