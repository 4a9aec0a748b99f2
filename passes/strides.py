"""Where a kernel's traced (fake) strides differ from the real kernel's, make the layout the traced one.

The joint graph is traced on FakeTensors, whose strides come from each op's meta kernel. For some
ops the meta kernel and the real CPU kernel disagree: ``aten.softplus_backward``'s meta kernel
returns a contiguous result where the CPU kernel follows a transposed gradient's layout (the
layout-following TensorIterator kernels are the class). Autograd records ``reshape`` as ``view``
where the fake tensor is viewable, and the real tensor then cannot take that view: the step fails
in backward with "view size is not compatible with input tensor's size and stride" (PyTorch's own
``aot_eager`` fails the same way).

:func:`traced_layouts` finds every such op that a ``view`` depends on and inserts, right after it,
``aten.clone(memory_format=torch.contiguous_format)`` feeding all its readers: the value then has
the traced layout on the real run too, so every traced view holds. The clone is a node of the graph
before costing, so the plan counts its bytes like any other value and the prediction stays the
measured peak.

Which ops to check: an op that allocates its output (it does not alias an input), whose traced
output is contiguous, that reads a tensor input that is not contiguous, and that some ``view``
reads through a chain of view ops. Each is run once on zero-filled real inputs with the traced
sizes and strides (briefly allocated); if the real output's strides differ from the traced ones,
the layout is made the traced one. A step traced for another device than the CPU is left alone
(its real kernels are not this machine's).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat_compiler.passes.storage import step_device

__all__ = ["traced_layouts", "layout_differs"]

_ATEN = torch.ops.aten


def _aliases_an_input(target) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _reads_through_views_into_view(node: fx.Node) -> bool:
    """Whether a ``view`` reads ``node``'s storage through a chain of aliasing ops."""
    todo, seen = [(u, node) for u in node.users], set()
    while todo:
        u, base = todo.pop()
        if u in seen or u.op != "call_function" or not isinstance(u.target, torch._ops.OpOverload):
            continue
        seen.add(u)
        if u.target is _ATEN.view.default:
            return True
        if _aliases_an_input(u.target) and u.args and u.args[0] is base:
            todo.extend((w, u) for w in u.users)
    return False


def _real_strided(v):
    """A zero-filled real tensor with a FakeTensor's sizes, strides and dtype (nested in lists)."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
    if isinstance(v, (list, tuple)):
        return type(v)(_real_strided(x) for x in v)
    return v


def layout_differs(node: fx.Node) -> bool:
    """Whether the real kernel of ``node`` gives another layout than its traced value has.

    Runs the op once on zero-filled real inputs of its traced sizes and strides. An op the zero
    inputs make fail (``RuntimeError``) counts as agreeing: nothing is known against the trace.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    val = node.meta.get("val")

    def real(a):
        return _real_strided(a.meta.get("val")) if isinstance(a, fx.Node) else a

    with unset_fake_temporarily(), torch.no_grad():
        try:
            out = node.target(*fx.node.map_aggregate(node.args, real), **fx.node.map_aggregate(node.kwargs, real))
        except RuntimeError:
            return False
    return isinstance(out, torch.Tensor) and out.stride() != tuple(val.stride())


def _suspect(node: fx.Node) -> bool:
    """An allocating deterministic aten op with a contiguous traced output and a non-contiguous
    tensor input, read by a ``view`` (see the module docstring)."""
    val = node.meta.get("val")
    target = node.target
    if node.op != "call_function" or not isinstance(val, torch.Tensor) or val.device.type != "cpu" \
            or not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten" \
            or _aliases_an_input(target) or target._schema.is_mutable \
            or torch.Tag.nondeterministic_seeded in target.tags or not val.is_contiguous():
        return False
    inputs = [a.meta.get("val") for a in node.all_input_nodes]
    if not any(isinstance(t, torch.Tensor) and t.dim() > 1 and not t.is_contiguous() for t in inputs):
        return False
    return _reads_through_views_into_view(node)


def traced_layouts(gm: fx.GraphModule) -> fx.GraphModule:
    """Insert a contiguous clone after each op whose real layout differs from its traced one and
    that a ``view`` depends on (see the module docstring); recompile if any was inserted."""
    if step_device(gm) != "cpu":
        return gm
    changed = False
    for node in list(gm.graph.nodes):
        if not _suspect(node) or not layout_differs(node):
            continue
        with gm.graph.inserting_after(node):
            clone = gm.graph.call_function(_ATEN.clone.default, (node,),
                                           {"memory_format": torch.contiguous_format})
        node.replace_all_uses_with(clone, delete_user_cb=lambda u: u is not clone)
        clone.meta = {k: v for k, v in node.meta.items() if not k.startswith("remat.")}
        val = node.meta["val"]
        with val.fake_mode:  # a value of its own (its own storage), with the same traced layout
            clone.meta["val"] = _ATEN.clone.default(val, memory_format=torch.contiguous_format)
        changed = True
    if changed:
        gm.recompile()
    return gm
