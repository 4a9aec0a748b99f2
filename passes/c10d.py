"""Which graph nodes are collectives: functional ones (``torch.distributed._functional_collectives``)
and the blocking custom ones of :data:`BLOCKING`.

A traced functional collective is two nodes: the collective itself (``all_to_all_single``,
``all_reduce`` ...), which starts the communication and returns a tensor still being written, and its
``wait_tensor``, which blocks until the result is complete and hands back that same tensor (same
storage). A blocking collective is one node whose result is complete when it returns (the MoE
layer's ``remat::all_to_all_uneven``, the all-to-all with split sizes that functional collectives
cannot trace with static shapes). The passes, the cost graph's inputs and codegen all recognise them
here.

>>> [n.name for n in gm.graph.nodes if is_collective(n)]          # doctest: +SKIP
['all_to_all_single', 'all_to_all_single_1']
"""
from __future__ import annotations

import torch.fx as fx

__all__ = ["NAMESPACES", "BLOCKING", "is_c10d", "is_collective", "is_wait"]

#: The op namespaces of functional collectives: the current one, the legacy one and the autograd one.
NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")

#: Custom ops that communicate and return their complete result (no ``wait_tensor``), by qualified name.
BLOCKING = ("remat::all_to_all_uneven",)


def _qualified_name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else ""


def is_c10d(node: fx.Node) -> bool:
    """True for any collective op node: a functional collective, its ``wait_tensor``, or a blocking one."""
    return node.op == "call_function" and (getattr(node.target, "namespace", None) in NAMESPACES
                                           or _qualified_name(node) in BLOCKING)


def is_wait(node: fx.Node) -> bool:
    """True for a functional collective's ``wait_tensor`` (it hands back its input's storage)."""
    return is_c10d(node) and getattr(node.target, "__name__", "").startswith("wait_tensor")


def is_collective(node: fx.Node) -> bool:
    """True for a collective that moves data (all-to-all, all-reduce, ...), not a wait."""
    return is_c10d(node) and not is_wait(node)
