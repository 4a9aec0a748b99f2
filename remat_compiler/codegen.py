"""Codegen: the forward and backward GraphModules of a plan, for AOTAutograd's autograd.Function.

The forward is AOTAutograd's own extraction with the plan's saved values as extra outputs. The
backward is rebuilt in the plan's schedule order: each recomputed node appears just before the first
backward step that needs it, and fx's generated code releases every value after its last use.

After each collective's ``wait_tensor`` the emitted graphs hold the collective's inputs until gloo's
work lets go of them (:mod:`remat_compiler.collectives`).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat_compiler.passes.c10d import is_c10d, is_wait
from remat_compiler.passes.costs import is_training_batch_norm
from remat_compiler.passes.keys import NUM_FWD_OUTPUTS, PHASE, RECOMPUTE_UNREAD
from remat_compiler.passes.rng import is_dropout_at, replaying
from remat_compiler.collectives import release_after_waits
from remat_compiler.errors import PlanCheckError
from remat_compiler.plan import Plan
from remat_compiler.trace import copy_graph_module

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
    recomputed = set(plan.schedule.recomputed)
    for name in scheduled:
        n = by_name.get(name)
        if n is None or n.op not in ("call_function", "get_attr"):
            continue  # dead in this backward (e.g. a gradient nobody asked for)
        if name in recomputed and is_training_batch_norm(n):
            env[n] = _batch_norm_without_stats(new, n, env)
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
        if name in recomputed and is_dropout_at(n):  # draws the forward's mask again
            env[n].args = replaying(env[n])
    out = next(iter(bw.graph.find_nodes(op="output")))
    new_out = new.node_copy(out, lambda a: env[a])
    new_out.meta = out.meta
    new.lint()
    return fx.GraphModule(bw, new)


def _batch_norm_without_stats(graph: fx.Graph, n: fx.Node, env: dict) -> fx.Node:
    """A recomputed training-mode BatchNorm, run without its running statistics: the same kernel gives
    the same normalised output and batch statistics, and the buffers (updated in place by the
    forward) are neither read nor written again."""
    x, w, b = (env[a] if isinstance(a, fx.Node) else a for a in n.args[:3])
    momentum, eps = n.args[6], n.args[7]
    out = graph.call_function(torch.ops.aten._native_batch_norm_legit.no_stats,
                              (x, w, b, True, momentum, eps))
    out.meta = dict(n.meta)
    out.name = n.name
    return out


def _batch_norm_stats_unread(gm: fx.GraphModule, bn: list[fx.Node]) -> fx.GraphModule:
    """A copy of ``gm`` whose recomputed training-mode BatchNorms ``bn`` read their input in place of
    the running statistics (backward runs them as ``no_stats``, which reads none)."""
    env: dict[fx.Node, fx.Node] = {}
    new = copy_graph_module(gm, env)
    for n in bn:
        copy = env[n]
        copy.args = (*copy.args[:3], copy.args[0], copy.args[0], *copy.args[5:])
    return new


def _forward_saves(fw: fx.GraphModule, num_fwd: int, saved: list[str]) -> None:
    """Make ``fw`` return its ``num_fwd`` outputs followed by the values named ``saved``."""
    out = next(iter(fw.graph.find_nodes(op="output")))
    by_name = {n.name: n for n in fw.graph.nodes}
    outs = list(out.args[0])
    out.args = (tuple(outs[:num_fwd] + [by_name[n] for n in saved]),)
    fw.graph.lint()
    fw.recompile()


def _impure_unless_collective(node: fx.Node) -> bool:
    return not is_c10d(node) and node.is_impure()


def emit(gm: fx.GraphModule, plan: Plan) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition the joint graph ``gm`` by ``plan``: return (forward, backward) GraphModules.

    The forward returns the user outputs followed by the saved values (AOTAutograd's convention);
    the backward takes the saved values and the tangents and returns the input gradients.
    """
    from torch._functorch.partitioners import _extract_fwd_bwd_modules  # imports inductor: slow

    num_fwd = gm.meta[NUM_FWD_OUTPUTS]
    names = {n.name: n for n in gm.graph.nodes}
    saved_values = []
    for x in plan.schedule.bw_inputs:
        n = names[x]
        if n.meta.get(PHASE) == "tangent":
            continue
        # a collective's result is saved once waited for (same storage): the forward waits for it
        # and releases the collective's inputs then, instead of leaving the wait to the backward
        waits = [u for u in n.users if is_wait(u)] if n.op == "call_function" else []
        n = waits[0] if waits else n
        if n not in saved_values:
            saved_values.append(n)
    bn = [names[r] for r in plan.schedule.recomputed if is_training_batch_norm(names[r])]
    # the plan saves no running statistics that only those recomputations would read (they are no
    # edges of the cost graph: ``remat.recompute_unread``); gm's BatchNorms still read them, so this
    # extraction gets them too, and with bn it is for the forward alone
    stats = list(dict.fromkeys(names[a] for n in bn for a in n.meta.get(RECOMPUTE_UNREAD, ())
                               if names[a] not in saved_values))
    # sizes backward reads (a graph traced with symbolic shapes, remat_compiler.dynamic) are saved as
    # SymInts: AOTAutograd keeps them apart from the tensors, after them in the forward's outputs
    syms = [n for n in saved_values if isinstance(n.meta.get("val"), (int, torch.SymInt))]
    saved_values = [n for n in saved_values if n not in syms]
    fw, bw = _extract_fwd_bwd_modules(gm, saved_values + stats, saved_sym_nodes=syms, num_fwd_outputs=num_fwd)
    if bn:  # backward recomputes them without their running statistics (see reorder_backward)
        bw_gm = _batch_norm_stats_unread(gm, bn)
        bw_names = {n.name: n for n in bw_gm.graph.nodes}
        keep = [bw_names[n.name] for n in saved_values]
        _, bw = _extract_fwd_bwd_modules(bw_gm, keep, saved_sym_nodes=[], num_fwd_outputs=num_fwd)
        _forward_saves(fw, num_fwd, [p.name for p in bw.graph.find_nodes(op="placeholder")
                                     if p.meta.get(PHASE) != "tangent"])
    # fx keeps functional collectives as impure; a dead one is dead on every rank (same plan)
    fw.graph.eliminate_dead_code(is_impure_node=_impure_unless_collective)
    bw.graph.eliminate_dead_code(is_impure_node=_impure_unless_collective)
    fw.recompile()
    bw = reorder_backward(bw, plan)
    return release_after_waits(fw), release_after_waits(bw)
