"""Pass: which storage each value lives in and how many new bytes each node allocates.

Writes ``meta["remat.storage"]`` (the name of the node that first produced this storage; a view or an
alias names its base), ``meta["remat.bytes"]`` (the storage's bytes on the node that owns it, 0 on views,
aliases and non-tensors) and ``meta["remat.tuple"]`` (a multi-output node; its tensors belong to
its ``getitem`` users, except outputs nobody takes, whose bytes the multi-output node owns: they
live until its last ``getitem`` is read; an output its op's ``output_mask`` argument turns off is not
allocated at all, see :func:`masked_outputs`). Aliasing is read from the FakeTensors' storage identity, so every view op,
``detach`` and ``_unsafe_view`` is handled without a list of op names.

Bytes are counted in the step's allocator's units (:mod:`remat_compiler.passes.allocator`), which the pass records
in ``gm.meta["remat.allocator"]``: the cost model's ``allocator`` if it names one, else the one of
the device the step runs on (``gm.meta["remat.device"]``, written by the trace; without it, the
device of the graph's tensor inputs): on CUDA every storage is charged its caching allocator block,
a multiple of 512 B, so the plan's budget and peak are in ``torch.cuda.max_memory_allocated()``'s
units.

A FakeTensor's storage is exactly what its shape needs; a real kernel may allocate more. Scalar
results are where that happens (CPU ``mse_loss`` returns its 4-byte loss as a view into a buffer the
size of its input, which stays alive with the loss), so :func:`calibrate_scalar_storage` runs every op
with a scalar CPU result once on zero-filled real inputs of the traced shapes and records the bytes
the real result's storage holds, in ``meta["remat.real_bytes"]`` as measured and in ``remat.bytes``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.passes.allocator import AllocatorModel, allocator_for, allocator_named
from remat_compiler.passes.c10d import is_wait
from remat_compiler.passes.keys import ALLOCATOR, BYTES, DEVICE, REAL_BYTES, STORAGE, TUPLE

__all__ = ["annotate_storage", "calibrate_scalar_storage", "masked_outputs", "storage_bytes", "strided_span_bytes",
           "step_device", "step_allocator"]


def storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


def strided_span_bytes(t: torch.Tensor) -> int:
    """Bytes of the smallest storage holding ``t``'s sizes and strides at offset 0 (``empty_strided``)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def step_device(gm: fx.GraphModule) -> str:
    """The device type the step runs on: ``gm.meta["remat.device"]`` if the trace wrote it, else the
    first non-CPU device among the graph's tensor inputs, else ``"cpu"``."""
    if DEVICE in gm.meta:
        return gm.meta[DEVICE]
    for p in gm.graph.find_nodes(op="placeholder"):
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type not in ("cpu", "meta"):
            return val.device.type
    return "cpu"


def step_allocator(gm: fx.GraphModule, cost_model=None) -> AllocatorModel:
    """The allocator the step's bytes are counted in: the cost model's ``allocator`` if it names one,
    else the step's device's (:func:`step_device`).

    Raises
    ------
    ValueError
        If the cost model names an unknown allocator.
    """
    name = getattr(cost_model, "allocator", None)
    return allocator_named(name) if name else allocator_for(step_device(gm))


def _is_tangent(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.name.startswith("tangents")


def _returns_input(n: fx.Node) -> bool:
    return is_wait(n) and isinstance(n.args[0], fx.Node)


def masked_outputs(n: fx.Node) -> set[int]:
    """Outputs of a multi-output aten op that its ``output_mask`` argument turns off.

    Backward ops such as ``native_batch_norm_backward(..., output_mask)`` return an undefined tensor
    (no storage) for each output whose mask entry is False, but some of their meta kernels still
    return a full-size FakeTensor there (BatchNorm's ``grad_input`` when the input needs no gradient),
    so the traced value would count bytes the real kernel never allocates."""
    target = n.target
    if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return set()
    for i, arg in enumerate(target._schema.arguments):
        if arg.name != "output_mask":
            continue
        mask = n.kwargs["output_mask"] if "output_mask" in n.kwargs else \
            n.args[i] if i < len(n.args) else arg.default_value
        if isinstance(mask, (list, tuple)) and all(isinstance(m, bool) for m in mask):
            return {j for j, m in enumerate(mask) if not m}
    return set()


def annotate_storage(gm: fx.GraphModule, cost_model=None) -> fx.GraphModule:
    """Annotate storage ownership and allocated bytes on every node of ``gm``, in the allocator's
    units (:func:`step_allocator` of ``cost_model``), and record the allocator's name."""
    allocator = step_allocator(gm, cost_model)
    gm.meta[ALLOCATOR] = allocator.name
    charged = allocator.charged_bytes
    owner: dict[StorageWeakRef, str] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        n.meta[TUPLE] = isinstance(val, (tuple, list))
        if _returns_input(n):  # wait_tensor hands back its input's storage at run time
            src = n.args[0]
            n.meta[STORAGE], n.meta[BYTES] = src.meta.get(STORAGE), 0
            if isinstance(val, torch.Tensor):
                owner.setdefault(StorageWeakRef(val.untyped_storage()), src.meta.get(STORAGE))
        elif isinstance(val, torch.Tensor):
            key = StorageWeakRef(val.untyped_storage())
            if key in owner:
                n.meta[STORAGE], n.meta[BYTES] = owner[key], 0
            else:
                owner[key] = n.name
                nbytes = strided_span_bytes(val) if _is_tangent(n) else storage_bytes(val)
                n.meta[STORAGE], n.meta[BYTES] = n.name, charged(nbytes)
        elif n.meta[TUPLE]:
            # outputs no getitem takes (e.g. nll_loss's total_weight) live in the tuple until its
            # last getitem is read; they belong to the multi-output node itself
            # (an output the op's output_mask turns off is not allocated, whatever its fake value)
            taken = {u.args[1] for u in n.users if u.target is operator.getitem}
            masked = masked_outputs(n)
            loose = 0
            for i, t in enumerate(val):
                if i in taken or i in masked or not isinstance(t, torch.Tensor):
                    continue
                key = StorageWeakRef(t.untyped_storage())
                if key not in owner:
                    owner[key] = n.name
                    loose += charged(storage_bytes(t))
            n.meta[STORAGE], n.meta[BYTES] = (n.name, loose) if loose else (None, 0)
        else:
            n.meta[STORAGE], n.meta[BYTES] = None, 0
    return gm


def _real_like(v):
    """A zero-filled real tensor like a FakeTensor (nested in lists), or the value itself."""
    if isinstance(v, torch.Tensor):
        return torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    if isinstance(v, (list, tuple)):
        return type(v)(_real_like(x) for x in v)
    return v


def calibrate_scalar_storage(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace the traced bytes of scalar CPU results by what the real kernel's storage holds.

    Runs each deterministic aten op whose result is a 0-dim CPU tensor owning its storage once, on
    zero-filled real inputs of its traced shapes (each input briefly allocated); random, mutating
    and collective ops are skipped, and so is an op the zero inputs make fail (its traced bytes stay).
    The measured bytes are also written alone as ``meta["remat.real_bytes"]``, a fact about the real
    kernel that a reader of the FakeTensors (:mod:`remat_compiler.emitted`) cannot derive; in
    ``remat.bytes`` it is charged as the step's allocator charges it. A step that runs on another
    device (``gm.meta["remat.device"]``: a CUDA plan traced on the CPU) is left as traced: its real
    kernels are not the CPU's.

    An op fails by raising ``RuntimeError``: torch's error when a kernel's argument checks reject
    its inputs (a linear-algebra error on a singular zero matrix is one), when the zero inputs
    cannot be allocated, and, as its subclass ``NotImplementedError``, when the op has no kernel for
    these inputs' device. Any other exception is a bug and is raised.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if step_device(gm) != "cpu":
        return gm
    charged = allocator_named(gm.meta[ALLOCATOR]).charged_bytes if ALLOCATOR in gm.meta else int
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor) or val.dim() != 0 \
                or val.device.type != "cpu" or n.meta.get(STORAGE) != n.name:
            continue
        target = n.target
        if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" \
                or torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
            continue

        def real(a):
            return _real_like(a.meta.get("val")) if isinstance(a, fx.Node) else a

        with unset_fake_temporarily(), torch.no_grad():
            try:
                args = torch.fx.node.map_aggregate(n.args, real)
                kwargs = torch.fx.node.map_aggregate(n.kwargs, real)
                out = target(*args, **kwargs)
            except RuntimeError:  # see the docstring: keep the traced bytes
                continue
            if isinstance(out, torch.Tensor):
                n.meta[REAL_BYTES] = storage_bytes(out)
                n.meta[BYTES] = max(n.meta[BYTES], charged(n.meta[REAL_BYTES]))
    return gm
