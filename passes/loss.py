"""Fuse the backward of cross-entropy (``log_softmax`` + ``nll_loss``) into one op.

Autograd's backward of ``nll_loss(log_softmax(x))`` runs ``nll_loss_backward`` (a dense gradient
the size of the logits, zero except one entry a row) and then ``_log_softmax_backward_data``, which
reads it and the saved ``log_softmax`` and writes a third logits-sized tensor: three at once, the
peak of a language model's loss head (24 MiB on the benchmark GPT-2). The fused op computes the
same values from ``log_softmax`` and the targets directly, with one output:

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

__all__ = ["fuse_cross_entropy_backward", "log_softmax_nll_backward", "WHOLE_LOSS_OPS"]


@torch.library.custom_op("remat::log_softmax_nll_backward", mutates_args=())
def log_softmax_nll_backward(grad: torch.Tensor, ls: torch.Tensor, target: torch.Tensor,
                             weight: torch.Tensor | None, reduction: int, ignore_index: int,
                             total_weight: torch.Tensor) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad, ls, target, ...), ls, 1)`` for a 2-D ``ls``."""
    n = ls.shape[0]
    g = -(grad / total_weight) if reduction == 1 else -grad  # aten: mean divides by total_weight
    g = g.expand(n) if g.dim() == 0 else g
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    row = g * weight[safe] if weight is not None else g
    row = torch.where(valid, row, torch.zeros_like(row))  # row i's sum of nll_loss_backward's output
    out = torch.exp(ls)
    out.mul_(row.neg().unsqueeze(1))
    out.scatter_add_(1, safe.unsqueeze(1), row.unsqueeze(1).to(out.dtype))
    return out


@log_softmax_nll_backward.register_fake
def _(grad, ls, target, weight, reduction, ignore_index, total_weight):
    return torch.empty_like(ls)


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
    ``nll_loss_backward`` has no other reader by one :func:`log_softmax_nll_backward` node (the aten
    ops or their :data:`WHOLE_LOSS_OPS` twins)."""
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
        with gm.graph.inserting_before(lsbd):
            fused = gm.graph.call_function(torch.ops.remat.log_softmax_nll_backward.default,
                                           (grad, ls, target, weight, reduction, ignore_index, total_weight))
        # the values a traced custom op was called with are its own (Inductor lays out a fallback's
        # inputs by them): the fused op has other arguments
        fused.meta = {k: v for k, v in lsbd.meta.items() if k != "eager_input_vals"}
        lsbd.replace_all_uses_with(fused)
        gm.graph.erase_node(lsbd)
        gm.graph.erase_node(nll)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
