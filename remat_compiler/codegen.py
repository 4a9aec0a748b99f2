"""Codegen: the forward and backward GraphModules of a plan, for AOTAutograd's autograd.Function.

The forward is AOTAutograd's own extraction with the plan's saved values as extra outputs. The
backward is rebuilt in the plan's schedule order: each recomputed node appears just before the first
backward step that needs it, and fx's generated code releases every value after its last use.
"""
from __future__ import annotations

import torch.fx as fx

from remat_compiler.errors import PlanCheckError
from remat_compiler.plan import Plan

__all__ = ["emit", "reorder_backward"]


def reorder_backward(bw: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Rebuild ``bw`` so that its nodes run in the order of ``plan.schedule``.

    Raises
    ------
    PlanCheckError
        If the extracted backward does not contain exactly the nodes the schedule runs.
    """
    by_name = {n.name: n for n in bw.graph.nodes}
    scheduled = [x for rec, b in plan.schedule.bw for x in (*rec, b)]
    scheduled_set = set(scheduled)
    for n in reversed(list(bw.graph.nodes)):  # dead leftovers of extraction (a random op or the
        if n.op == "call_function" and not n.users and n.name not in scheduled_set:
            bw.graph.erase_node(n)  # forward's collectives whose results are saved) are not run
    body = {n.name for n in bw.graph.nodes if n.op in ("call_function", "get_attr")}
    missing = body - scheduled_set
    if missing:
        raise PlanCheckError(f"backward graph runs nodes the schedule does not: {sorted(missing)[:8]}")
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in bw.graph.find_nodes(op="placeholder"):
        env[n] = new.placeholder(n.name)
        env[n].meta = n.meta
    for name in scheduled:
        n = by_name.get(name)
        if n is None or n.op not in ("call_function", "get_attr"):
            continue  # dead in this backward (e.g. a gradient nobody asked for)
        env[n] = new.node_copy(n, lambda a: env[a])
    out = next(iter(bw.graph.find_nodes(op="output")))
    new_out = new.node_copy(out, lambda a: env[a])
    new_out.meta = out.meta
    new.lint()
    return fx.GraphModule(bw, new)


def _impure_unless_collective(node: fx.Node) -> bool:
    if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
        return False
    return node.is_impure()


def emit(gm: fx.GraphModule, plan: Plan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition the joint graph ``gm`` by ``plan``: return (forward, backward) GraphModules.

    The forward returns the user outputs followed by the saved values (AOTAutograd's convention);
    the backward takes the saved values and the tangents and returns the input gradients.
    """
    from torch._functorch.partitioners import _extract_fwd_bwd_modules  # imports inductor: slow

    num_fwd = gm.meta["remat.num_fwd_outputs"]
    names = {n.name: n for n in gm.graph.nodes}
    saved_values = [names[x] for x in plan.schedule.bw_inputs
                    if names[x].meta.get("remat.phase") != "tangent"]
    fw, bw = _extract_fwd_bwd_modules(gm, saved_values, saved_sym_nodes=[], num_fwd_outputs=num_fwd)
    # fx keeps functional collectives as impure; a dead one is dead on every rank (same plan)
    fw.graph.eliminate_dead_code(is_impure_node=_impure_unless_collective)
    bw.graph.eliminate_dead_code(is_impure_node=_impure_unless_collective)
    fw.recompile()
    bw = reorder_backward(bw, plan)
    return fw, bw
