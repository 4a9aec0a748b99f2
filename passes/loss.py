"""Fuse the backward of cross-entropy (``log_softmax`` + ``nll_loss``) into one op.

Autograd's backward of ``nll_loss(log_softmax(x))`` runs ``nll_loss_backward`` (a dense gradient
the size of the logits, zero except one entry a row) and then ``_log_softmax_backward_data``, which
reads it and the saved ``log_softmax`` and writes a third logits-sized tensor: three at once, the
peak of a language model's loss head (24 MiB on the benchmark GPT-2). The fused graph computes the
same values from ``log_softmax`` and the targets directly: a few aten ops on per-row vectors
(:func:`nll_rows`), then one op with one logits-sized output and no temporaries of its own
(:func:`log_softmax_nll_backward`; an op that made its row vectors inside itself allocated 17 KB the
planner could not see, on the benchmark GPT-2, where its peak was):

    d x[i, c] = exp(ls[i, c]) * g_i - [c == t_i] * g_i,    g_i = w[t_i] * grad / total_weight

(``g_i`` is the one nonzero entry of row i of ``nll_loss_backward``; 0 for ignored targets). It
follows the aten kernels' formula (``go - exp(ls) * sum(go)``, with ``sum(go) = g_i`` exactly); the
aten kernel's vectorised exp and multiply order differ from ``torch.exp`` and ``mul`` in the last bit
of about 7% of the entries (at most 1.2e-10 on unit-scale logits), so gradients agree with eager to
``torch.allclose`` tolerances, not bit for bit.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["fuse_cross_entropy_backward", "log_softmax_nll_backward", "nll_rows", "cross_entropy_backward",
           "WHOLE_LOSS_OPS"]


@torch.library.custom_op("remat::log_softmax_nll_backward", mutates_args=())
def log_softmax_nll_backward(ls: torch.Tensor, index: torch.Tensor, rows: torch.Tensor,
                             neg_rows: torch.Tensor) -> torch.Tensor:
    """``exp(ls) * rows[:, None]``, less ``rows`` at ``(i, index[i])``: cross-entropy's gradient from the
    per-row factors :func:`nll_rows` makes. It allocates its output and nothing else (every
    temporary is a graph value the planner sees): the loss head's peak is this op's."""
    out = torch.exp(ls)
    out.mul_(rows.unsqueeze(1))
    out.scatter_add_(1, index.unsqueeze(1), neg_rows.unsqueeze(1))
    return out


@log_softmax_nll_backward.register_fake
def _(ls, index, rows, neg_rows):
    return torch.empty_like(ls)


def nll_rows(grad: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int,
             ignore_index: int, total_weight: torch.Tensor, dtype: torch.dtype):
    """The row factors of ``nll_loss_backward``: each row's target (0 where ignored, a safe index)
    and ``g_i`` (0 for ignored rows), and its negation, as aten ops."""
    aten = torch.ops.aten
    valid = aten.ne.Scalar(target, ignore_index)
    index = aten.where.ScalarOther(valid, target, 0)
    g = aten.div.Tensor(grad, total_weight) if reduction == 1 else grad  # aten: mean divides by the weight
    if weight is not None:
        g = aten.mul.Tensor(aten.index.Tensor(weight, [index]), g)
    # a scalar g broadcasts in the where (no expand to the rows' count: that would write the traced
    # size into the graph, which a graph traced with symbolic sizes must read from target)
    rows = aten.where.ScalarOther(valid, g, 0.0)
    if rows.dtype != dtype:
        rows = aten._to_copy.default(rows, dtype=dtype)
    return index, rows, aten.neg.default(rows)


def cross_entropy_backward(grad: torch.Tensor, ls: torch.Tensor, target: torch.Tensor,
                           weight: torch.Tensor | None, reduction: int, ignore_index: int,
                           total_weight: torch.Tensor) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad, ls, target, ...), ls, 1)`` for a 2-D
    ``ls``, as the fused graph computes it."""
    index, rows, neg_rows = nll_rows(grad, target, weight, reduction, ignore_index, total_weight, ls.dtype)
    return log_softmax_nll_backward(ls, index, rows, neg_rows)


# The loss head's ops as opaque operators, for a trace that decomposes everything else (the Inductor
# backend's, :data:`remat_compiler.inductor.DECOMPOSITIONS`). Decomposed, the forward's log_softmax
# leaves two logits-sized intermediates in the graph that Inductor's kernel never writes (the planner,
# which prices the graph as written, would reserve memory for them), and the backward's two ops become
# a scatter into a zero-filled logits-sized tensor: one more than the fused op holds. Whole, the
# backward's pair is fused by :func:`fuse_cross_entropy_backward`, and each op runs as the aten kernel
# (Inductor calls an operator it has no decomposition for as a fallback kernel).

@torch.library.custom_op("remat::log_softmax", mutates_args=())
def _whole_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    return torch.ops.aten._log_softmax.default(x, dim, half_to_float)


@_whole_log_softmax.register_fake
def _(x, dim, half_to_float):
    return torch.ops.aten._log_softmax.default(x, dim, half_to_float)


@torch.library.custom_op("remat::nll_loss_backward", mutates_args=())
def _whole_nll_loss_backward(grad: torch.Tensor, ls: torch.Tensor, target: torch.Tensor,
                             weight: torch.Tensor | None, reduction: int, ignore_index: int,
                             total_weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.nll_loss_backward.default(grad, ls, target, weight, reduction, ignore_index,
                                                    total_weight)


@_whole_nll_loss_backward.register_fake
def _(grad, ls, target, weight, reduction, ignore_index, total_weight):
    return torch.empty_like(ls)


@torch.library.custom_op("remat::log_softmax_backward_data", mutates_args=())
def _whole_log_softmax_backward_data(grad: torch.Tensor, out: torch.Tensor, dim: int,
                                     input_dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.aten._log_softmax_backward_data.default(grad, out, dim, input_dtype)


@_whole_log_softmax_backward_data.register_fake
def _(grad, out, dim, input_dtype):
    return torch.empty_like(grad, dtype=input_dtype)


#: Decompositions that keep the loss head's ops whole: each aten op to its opaque ``remat::`` twin.
WHOLE_LOSS_OPS = {
    torch.ops.aten._log_softmax.default: torch.ops.remat.log_softmax.default,
    torch.ops.aten.nll_loss_backward.default: torch.ops.remat.nll_loss_backward.default,
    torch.ops.aten._log_softmax_backward_data.default: torch.ops.remat.log_softmax_backward_data.default,
}


def fuse_cross_entropy_backward(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace each ``_log_softmax_backward_data(nll_loss_backward(...), ls, 1)`` on 2-D logits whose
    ``nll_loss_backward`` has no other reader (the aten ops or their :data:`WHOLE_LOSS_OPS` twins) by
    :func:`nll_rows`' small aten ops and one :func:`log_softmax_nll_backward` node."""
    aten, remat = torch.ops.aten, torch.ops.remat
    changed = False
    for lsbd in list(gm.graph.nodes):
        if lsbd.op != "call_function" or lsbd.target not in (aten._log_softmax_backward_data.default,
                                                             remat.log_softmax_backward_data.default):
            continue
        nll, ls, dim = lsbd.args[0], lsbd.args[1], lsbd.args[2]
        if not isinstance(nll, fx.Node) or len(nll.users) != 1 \
                or nll.target not in (aten.nll_loss_backward.default, remat.nll_loss_backward.default):
            continue
        val = ls.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() != 2 or dim not in (1, -1):
            continue
        grad, _self, target, weight, reduction, ignore_index, total_weight = nll.args
        # the values a traced custom op was called with are its own (Inductor lays out a fallback's
        # inputs by them): the new nodes have other arguments
        meta = {k: v for k, v in lsbd.meta.items() if k not in ("eager_input_vals", "val", "tensor_meta")}
        with gm.graph.inserting_before(lsbd):
            index, rows, neg_rows = _traced_into(gm.graph, nll_rows, meta, grad, target, weight, reduction,
                                                 ignore_index, total_weight, val.dtype)
            fused = gm.graph.call_function(remat.log_softmax_nll_backward.default, (ls, index, rows, neg_rows))
        fused.meta = dict(meta, val=lsbd.meta.get("val"))
        lsbd.replace_all_uses_with(fused)
        gm.graph.erase_node(lsbd)
        gm.graph.erase_node(nll)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


class _Recording(torch.utils._python_dispatch.TorchDispatchMode):
    """Writes each aten op a function runs on the FakeTensors of graph nodes into the graph, with
    its value, as a node (see :func:`_traced_into`)."""

    def __init__(self, graph: fx.Graph, nodes: dict, meta: dict):
        super().__init__()
        self.graph, self.nodes, self.meta = graph, nodes, meta
        self.made = []  # every value recorded, alive until the end: no id of a freed one is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        as_node = lambda x: self.nodes.get(id(x), x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        node_args, node_kwargs = torch.utils._pytree.tree_map(as_node, (args, kwargs))
        node = self.graph.call_function(func, tuple(node_args), node_kwargs)
        node.meta = dict(self.meta, val=out)
        self.nodes[id(out)] = node
        self.made.append(out)
        return out


def _traced_into(graph: fx.Graph, fn, meta: dict, *args):
    """Run ``fn`` on the values of the fx nodes among ``args`` and record the aten ops it runs as
    nodes at the graph's insertion point; the nodes of its outputs."""
    nodes, vals = {}, []
    for a in args:
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            nodes[id(v)] = a
            vals.append(v)
        else:
            vals.append(a)
    fake = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor) and hasattr(v, "fake_mode"))
    with fake, _Recording(graph, nodes, meta):
        outs = fn(*vals)
    return tuple(nodes[id(o)] for o in outs)
