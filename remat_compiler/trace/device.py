"""Tracing a model that holds no data, for the device it is planned for: meta tensors and FakeTensors
(:func:`tensors_for_planning`), and a plan for CUDA traced on a CPU-only build (:func:`trace_device`)."""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx


__all__ = ["META_PLANS_FOR", "without_data", "DeviceTraceWarning", "trace_device", "tensors_for_planning",
           "warn_cpu_only_ops"]


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


def warn_cpu_only_ops(joint: fx.GraphModule, plans_for: str) -> None:
    """Warn (:class:`DeviceTraceWarning`) where a graph traced on the CPU for ``plans_for`` calls kernels
    only the CPU dispatches to: the GPU traces another graph there and refuses the plan."""
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
    becomes a FakeTensor on ``device`` (default :data:`META_PLANS_FOR`, the CPU) that wraps it: views of one
    meta storage stay views of one fake storage, so the storage structure
    (:mod:`remat_compiler.passes.storage`) is the one real CPU tensors give, and the graph, its fingerprint, its
    costs (:func:`remat_compiler.passes.calibrate_scalar_storage` runs the CPU kernels on zeros, as for a CPU
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
