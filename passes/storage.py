"""Pass: which storage each value lives in and how many new bytes each node allocates.

Writes ``meta["remat.storage"]`` (the name of the node that first produced this storage; a view or an
alias names its base), ``meta["remat.bytes"]`` (the storage's bytes on the node that owns it, 0 on views,
aliases and non-tensors) and ``meta["remat.tuple"]`` (a multi-output node; its tensors belong to
its ``getitem`` users, except outputs nobody takes, whose bytes the multi-output node owns: they
live until its last ``getitem`` is read). Aliasing is read from the FakeTensors' storage identity, so every view op,
``detach`` and ``_unsafe_view`` is handled without a list of op names.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["annotate_storage", "STORAGE", "BYTES", "TUPLE"]

STORAGE = "remat.storage"
BYTES = "remat.bytes"
TUPLE = "remat.tuple"


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(t.numel() * t.element_size())


def _returns_input(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional" \
        and getattr(n.target, "__name__", "").startswith("wait_tensor") and isinstance(n.args[0], fx.Node)


def annotate_storage(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate storage ownership and allocated bytes on every node of ``gm``."""
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
                n.meta[STORAGE], n.meta[BYTES] = n.name, _storage_bytes(val)
        elif n.meta[TUPLE]:
            # outputs no getitem takes (e.g. nll_loss's total_weight) live in the tuple until its
            # last getitem is read; they belong to the multi-output node itself
            taken = {u.args[1] for u in n.users if u.target is operator.getitem}
            loose = 0
            for i, t in enumerate(val):
                if i in taken or not isinstance(t, torch.Tensor):
                    continue
                key = StorageWeakRef(t.untyped_storage())
                if key not in owner:
                    owner[key] = n.name
                    loose += _storage_bytes(t)
            n.meta[STORAGE], n.meta[BYTES] = (n.name, loose) if loose else (None, 0)
        else:
            n.meta[STORAGE], n.meta[BYTES] = None, 0
    return gm
