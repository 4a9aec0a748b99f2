"""Pass: which repeated block (transformer layer, MLP layer) each node belongs to.

Reads ``meta["custom"]["remat.trace_module"]`` (the module path recorded while tracing) and writes
``meta["remat.module"]`` (that path, "" at top level) and ``meta["remat.block"]`` (the path of the
repeated child module that contains it, or None). Blocks are the children of the container
(``nn.ModuleList`` / ``nn.Sequential``) that holds the most same-class siblings, at least two; the
container's path is stored in ``gm.meta["remat.block_container"]``.
"""
from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from remat_compiler.passes.keys import BLOCK, BLOCK_CONTAINER, MODULE, PHASE, TRACE_MODULE, TRACE_MODULE_CLASS

__all__ = ["annotate_blocks", "module_path"]


def module_path(node: fx.Node) -> str:
    custom = node.meta.get("custom") or {}
    return custom.get(TRACE_MODULE, "") or ""


def annotate_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    """Annotate ``remat.module`` and ``remat.block`` on every node (forward nodes decide the blocks)."""
    # children of each parent path, with the class of the child module, as seen in the trace
    children: dict[str, dict[str, str]] = defaultdict(dict)
    for n in gm.graph.nodes:
        path = module_path(n)
        n.meta[MODULE] = path
        if n.meta.get(PHASE) != "fw" or not path:
            continue
        parts = path.split(".")
        custom = n.meta.get("custom") or {}
        for i in range(1, len(parts) + 1):
            parent, child = ".".join(parts[: i - 1]), parts[i - 1]
            if child.isdigit():
                children[parent].setdefault(child, "")
        if parts[-1].isdigit():
            children[".".join(parts[:-1])][parts[-1]] = custom.get(TRACE_MODULE_CLASS, "")
    best, best_count = None, 1
    for parent, kids in sorted(children.items()):
        if len(kids) > best_count:
            best, best_count = parent, len(kids)
    gm.meta[BLOCK_CONTAINER] = best
    for n in gm.graph.nodes:
        n.meta[BLOCK] = None
        if best is None:
            continue
        path = n.meta[MODULE]
        prefix = f"{best}." if best else ""
        if path.startswith(prefix):
            rest = path[len(prefix):].split(".")
            if rest and rest[0].isdigit():
                n.meta[BLOCK] = f"{prefix}{rest[0]}"
    return gm
