"""A pointwise value that several layers read, computed once into a buffer of its own
(:func:`store_shared_values`, with the ``remat::stored`` op Inductor lowers so).

The Inductor backend runs it on each graph it compiles (:func:`remat_compiler.inductor.compile_graph`);
it is not one of :data:`PASSES` (the planner prices every value as a buffer of its own already).
Importing it registers the op's Inductor lowering.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .keys import BLOCK

__all__ = ["store_shared_values"]


@torch.library.custom_op("remat::stored", mutates_args=())
def _stored(x: torch.Tensor) -> torch.Tensor:
    """``x``, computed once into a buffer of its own: Inductor lowers it so (:func:`store_shared_values`);
    outside Inductor, a copy."""
    return x.clone()


@_stored.register_fake
def _(x):
    return torch.empty_like(x)


def _register_stored_lowering() -> None:
    from torch._inductor.lowering import register_lowering

    @register_lowering(torch.ops.remat.stored.default, type_promotion_kind=None)
    def _store(x):
        x.realize()
        return x


_register_stored_lowering()


def _is_view(node: fx.Node) -> bool:
    """Whether a node's output is a view of its input (by the op's schema), or an item of a tuple."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s value, looking through views of it."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and _is_view(user):
            todo.extend(user.users)
        else:
            found.append(user)
    return found


def store_shared_values(gm: fx.GraphModule) -> list[str]:
    """Make Inductor compute each pointwise value that several layers read once, into a buffer.

    Inductor inlines a pointwise value into every kernel that reads it unless its own heuristic
    realizes it (on the CPU: a value of ``exp``, ``tanh`` and the like, or a large expression). A
    value made once for all the layers (an attention mask, a rotary table) that the plan does not
    save may then be computed again inside each layer's kernel: on the benchmark GPT-2, a plan that
    saved the boolean causal mask had the float mask made from it selected again inside all six
    attention softmax kernels of the forward, about 1 ms more each. The plan prices every value as a
    buffer of its own, alive from its node to its last reader, so storing it keeps the code within
    what the plan counted; the walk of the code checks that.

    Each such value (an aten op tagged pointwise, not an output, read through views by nodes of two
    or more blocks: ``meta["remat.block"]``, :func:`remat_compiler.passes.annotate_blocks`) gets a
    ``remat::stored`` node its readers read instead. Returns the names of the values.
    """
    out = next(iter(gm.graph.find_nodes(op="output")))
    outputs = set(out.all_input_nodes)
    stored = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in outputs or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.pointwise not in node.target.tags:
            continue
        blocks = {r.meta.get(BLOCK) for r in _readers(node)} - {None}
        if len(blocks) < 2:
            continue
        with gm.graph.inserting_after(node):
            kept = gm.graph.call_function(torch.ops.remat.stored.default, (node,))
        kept.meta = {k: v for k, v in node.meta.items() if k != "eager_input_vals"}
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
        stored.append(node.name)
    if stored:
        gm.graph.lint()
        gm.recompile()
    return stored
