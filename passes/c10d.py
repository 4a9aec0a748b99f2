"""Which graph nodes are functional collectives (``torch.distributed._functional_collectives``).

A traced collective is two nodes: the collective itself (``all_to_all_single``, ``all_reduce`` ...),
which starts the communication and returns a tensor still being written, and its ``wait_tensor``,
which blocks until the result is complete and hands back that same tensor (same storage). The
passes, the cost graph's inputs and codegen all recognise them here.

>>> [n.name for n in gm.graph.nodes if is_collective(n)]          # doctest: +SKIP
['all_to_all_single', 'all_to_all_single_1']
"""
from __future__ import annotations

import torch.fx as fx

__all__ = ["NAMESPACES", "is_c10d", "is_collective", "is_wait"]

#: The op namespaces of functional collectives: the current one, the legacy one and the autograd one.
NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def is_c10d(node: fx.Node) -> bool:
    """True for any functional-collective op node: a collective or its ``wait_tensor``."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) in NAMESPACES


def is_wait(node: fx.Node) -> bool:
    """True for a functional collective's ``wait_tensor`` (it hands back its input's storage)."""
    return is_c10d(node) and getattr(node.target, "__name__", "").startswith("wait_tensor")


def is_collective(node: fx.Node) -> bool:
    """True for a functional collective that moves data (all-to-all, all-reduce, ...), not its wait."""
    return is_c10d(node) and not is_wait(node)
