"""Fused GEMM2 -> A2A(combine) -> weighted Unpermute that never saves the expert output ``y``.

The plain autograd chain ``y = a @ W2`` -> all-to-all -> ``out_t = sum_k p_tk * y[slot(t, k)]``
saves the gathered ``y`` (``[T * top_k, H]``, the largest tensor of an MoE layer) because the
multiplication by the probabilities needs it for ``d(probs)``. This module computes ``d(probs)``
from the dgrad GEMM that backward performs anyway, for dispatched row ``r = slot(t, k)`` and
``G = dL/dout``::

    H_r        = G_t @ W2_e^T                 (one GEMM, needed for dL/da anyway)
    dL/dp_tk   = <G_t, y_r> = <H_r, a_r>      (a row sum, y is never needed)
    dL/da_r    = p_tk * H_r
    dL/dW2_e   = sum_{r in e} a_r^T (p_tk * G_t)

Saved for backward: ``a`` (the SwiGLU output), ``W2``, ``probs`` and the routing slots; never ``y``.

Where the probabilities meet the experts: forward keeps ``probs`` on the token side (the
unpermute applies them there). Backward gathers the *unscaled* ``G`` into the capacity buffer
(through the inverse of the slot map, :func:`assignment_of_rows`) and sends it to the experts through the all-to-all that reverses the combine, and sends the
probabilities along in a second, small all-to-all of one scalar per row. ``dL/dp`` (one scalar per
row) comes back through a third small all-to-all. With one rank none of these calls is issued.

Memory of the backward. AOTAutograd traces ``FusedCombine.backward`` into aten ops and functionalizes
them, so an in-place ``H.mul_(p)`` written there becomes an out-of-place ``mul`` and the traced
backward holds ``H`` and ``p * H`` (two ``[rows, F]`` tensors) at once; likewise the wgrad operand
``p * G`` (or ``p * a``) would be a ``[rows, H]`` (``[rows, F]``) temporary held with ``G``, ``a`` and
the recomputation of ``a``. :func:`combine_dgrad` is therefore one custom op (opaque to the trace, like
``remat_compiler.passes.loss``'s fused cross-entropy backward) for both GEMMs: one ``[rows, F]`` buffer holds
``p * a`` for the wgrad GEMM, then ``H`` from the dgrad GEMM, whose row dot products with ``a`` give
``d(probs)``, and is scaled in place into ``dL/da``. Its only allocations are its three outputs, which
the plan's simulator counts like any op's.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import bmm_flop, register_flop_formula

from ._dist import expert_to_token, group_world_size, token_to_expert
from ._uneven import Route, experts_to_rows, rows_to_experts

__all__ = ["FusedCombine", "fused_combine", "weighted_unpermute", "assignment_of_rows", "rowdot",
           "combine_dgrad"]


def weighted_unpermute(y_tok: torch.Tensor, probs: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Gather each token's expert rows and sum them weighted by the routing probabilities.

    Parameters
    ----------
    y_tok : torch.Tensor
        ``[E * C, H]`` token-side buffer (experts in global order, ``C`` rows each).
    probs : torch.Tensor
        ``[T, top_k]`` routing probabilities.
    slot : torch.Tensor
        ``[T, top_k]`` int64 row of ``y_tok`` holding ``(t, k)``; ``E * C`` marks a dropped
        assignment, which contributes zero.

    Returns
    -------
    torch.Tensor
        ``[T, H]`` with ``out_t = sum_k probs[t, k] * y_tok[slot[t, k]]``.
    """
    tokens, top_k = probs.shape
    padded = torch.cat([y_tok, y_tok.new_zeros(1, y_tok.shape[1])])
    gathered = padded.index_select(0, slot.reshape(-1)).view(tokens, top_k, -1)
    return (gathered * probs.unsqueeze(-1)).sum(1)


def assignment_of_rows(slot: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each capacity row, the assignment it holds: ``t * top_k + k``, or ``T * top_k`` if unused.

    Parameters
    ----------
    slot : torch.Tensor
        ``[T, top_k]`` int64 rows, ``num_rows`` for a dropped assignment.
    num_rows : int
        ``E * C``.

    Returns
    -------
    torch.Tensor
        ``[num_rows]`` int64. Each real row receives at most one assignment, so this inverse map
        turns "scatter assignments into rows" into a gather (no ``[T * top_k, D]`` copy).
    """
    tokens, top_k = slot.shape
    assignments = torch.arange(tokens * top_k, device=slot.device)
    inverse = torch.full((num_rows + 1,), tokens * top_k, dtype=torch.long, device=slot.device)
    return inverse.scatter(0, slot.reshape(-1), assignments)[:num_rows]


def _pad_row(x: torch.Tensor) -> torch.Tensor:
    """``x`` (2-D) with one zero row appended, the target of "no assignment" indices."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1, keepdim=True)`` for ``[..., D]`` tensors, as a batched GEMM (no ``a * b`` temp)."""
    width = a.shape[-1]
    out = torch.bmm(a.reshape(-1, 1, width), b.reshape(-1, width, 1))
    return out.view(*a.shape[:-1], 1)


@torch.library.custom_op("remat::combine_dgrad", mutates_args=())
def combine_dgrad(grad_exp: torch.Tensor, w2: torch.Tensor, act: torch.Tensor, p_exp: torch.Tensor,
                  need_w2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused combine's backward GEMMs, with ``d(probs)`` taken from the dgrad, in one ``[rows, F]`` buffer.

    Parameters
    ----------
    grad_exp : torch.Tensor
        ``[E_local, rows, H]`` unscaled ``G`` on the expert side (zero rows where unused).
    w2 : torch.Tensor
        ``[E_local, F, H]``.
    act : torch.Tensor
        ``[E_local, rows, F]`` saved SwiGLU output (contiguous, as SwiGLU makes it).
    p_exp : torch.Tensor
        ``[E_local, rows, 1]`` probability of each row (zero where unused).
    need_w2 : bool
        Whether to compute ``dL/dW2`` (False when ``W2`` needs no gradient).

    Returns
    -------
    tuple of torch.Tensor
        ``dL/da = p * (G W2^T)`` (``[E_local, rows, F]``), ``dL/dp = <G W2^T, a>`` per row
        (``[E_local, rows, 1]``) and ``dL/dW2 = (p * a)^T G`` (``[E_local, F, H]``; empty when
        ``need_w2`` is False). One ``[rows, F]`` buffer serves first as ``p * a`` for the wgrad GEMM,
        then as ``G W2^T`` (the row dot products are read off it, a batched GEMM) and is scaled in
        place into ``dL/da``: the op allocates nothing but its outputs.

    Example
    -------
    >>> grad_act, dp, grad_w2 = combine_dgrad(g_exp, w2, act, p_exp, True)  # doctest: +SKIP
    """
    buf = torch.mul(act, p_exp)  # p * a: the wgrad's scaled operand, [E_local, rows, F]
    grad_w2 = torch.bmm(buf.transpose(1, 2), grad_exp) if need_w2 else grad_exp.new_empty(0)
    torch.bmm(grad_exp, w2.transpose(1, 2), out=buf)  # G W2^T, into the same buffer
    dp = rowdot(buf, act)  # <G W2^T, a> = <G, y>: read before the scaling
    return buf.mul_(p_exp), dp, grad_w2


@combine_dgrad.register_fake
def _(grad_exp, w2, act, p_exp, need_w2):
    rows = (*grad_exp.shape[:2],)
    grad_w2 = grad_exp.new_empty(*w2.shape) if need_w2 else grad_exp.new_empty(0)
    return grad_exp.new_empty(*rows, w2.shape[1]), grad_exp.new_empty(*rows, 1), grad_w2


@register_flop_formula(torch.ops.remat.combine_dgrad)
def _combine_dgrad_flop(grad_shape, w2_shape, act_shape, p_shape, need_w2, out_shape=None, **kwargs) -> int:
    """The dgrad GEMM, the row dot products (as ``bmm`` counts them) and the wgrad GEMM when asked;
    the scalings left out."""
    experts, rows, hidden = grad_shape
    width = w2_shape[1]
    flops = (bmm_flop(grad_shape, (experts, hidden, width))
             + bmm_flop((experts * rows, 1, width), (experts * rows, width, 1)))
    return flops + (bmm_flop((experts, width, rows), grad_shape) if need_w2 else 0)


def _to_experts(tok: torch.Tensor, group, route) -> torch.Tensor:
    """Token-side rows (``[E, C, D]`` capacity buffer, or ``[T*top_k, D]`` with a route) to the experts."""
    if route is None:
        return token_to_expert(tok, group, differentiable=False)
    return rows_to_experts(tok.reshape(-1, tok.shape[-1]), route, group)


def _to_tokens(buf: torch.Tensor, group, route, num_rows: int) -> torch.Tensor:
    """Expert-side ``[E_local, rows, D]`` back to the token side (``[E, C, D]``, or ``[num_rows, D]``)."""
    if route is None:
        return expert_to_token(buf, group, differentiable=False)
    return experts_to_rows(buf, route, group, num_rows)


class FusedCombine(torch.autograd.Function):
    """GEMM2 + combine all-to-all + probability-weighted unpermute with a memory-lean backward.

    See the module docstring for the math. Use through :func:`fused_combine`. The backward's
    largest transient is one ``[E_local, W*C, F]`` buffer (``p * a``, then ``H``, scaled in place into
    ``dL/da`` by :func:`combine_dgrad`, which also makes ``dL/dW2``); it gathers ``G`` into the
    token-side buffer (no per-assignment copy of ``G``) and takes ``d(probs)`` as a batched row dot
    product (no ``H * a`` temp). The token side is the ``[E, C]`` capacity buffer with equal splits,
    or the ``[T * top_k]`` routed rows with a :class:`~remat_compiler.moe._dist.Route` (uneven
    splits): the route's four tensors follow ``group`` as arguments.
    """

    @staticmethod
    def forward(ctx, act, w2, probs, slot, group, *route):
        route = Route(*route) if route else None
        y = torch.bmm(act, w2)  # [E_local, world * C, H]
        if route is None:
            y_tok = expert_to_token(y, group, differentiable=False)  # [E, C, H]
        else:
            y_tok = experts_to_rows(y, route, group, slot.numel())  # [T * top_k, H]
        out = weighted_unpermute(y_tok.reshape(-1, y_tok.shape[-1]), probs, slot)
        ctx.save_for_backward(act, w2, probs, slot, *(route or ()))
        ctx.group = group
        ctx.token_buffer_shape = tuple(y_tok.shape[:-1])  # (E, C), or (T * top_k,)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        act, w2, probs, slot, *route = ctx.saved_tensors
        route = Route(*route) if route else None
        group = ctx.group
        shape = ctx.token_buffer_shape
        num_rows = math.prod(shape)
        tokens, top_k = probs.shape

        # Unscaled G and the probability of each token-side row (zero rows where unused); to the experts.
        assignment = assignment_of_rows(slot, num_rows)
        token = torch.div(assignment, top_k, rounding_mode="floor")  # unused rows -> T, the zero row
        g_tok = _pad_row(grad_out).index_select(0, token).view(*shape, -1)
        p_tok = _pad_row(probs.reshape(-1, 1)).index_select(0, assignment).view(*shape, 1)
        g_exp = _to_experts(g_tok, group, route)  # [E_local, W*C, H]
        p_exp = _to_experts(p_tok, group, route)  # [E_local, W*C, 1]

        grad_act = grad_w2 = grad_probs = None
        if any(ctx.needs_input_grad[:3]):
            # wgrad and dgrad GEMMs, d(probs) read off the dgrad: one [E_local, W*C, F] buffer
            grad_act, dp_exp, grad_w2 = combine_dgrad(g_exp, w2, act, p_exp, ctx.needs_input_grad[1])
        if ctx.needs_input_grad[2]:
            dp_tok = _to_tokens(dp_exp, group, route, num_rows).reshape(num_rows)
            dp_tok = torch.cat([dp_tok, dp_tok.new_zeros(1)])  # dropped assignments get 0
            grad_probs = dp_tok.index_select(0, slot.reshape(-1)).view(tokens, top_k)
        if not ctx.needs_input_grad[0]:
            grad_act = None
        if not ctx.needs_input_grad[1]:
            grad_w2 = None
        return (grad_act, grad_w2, grad_probs, None, None, *(None for _ in (route or ())))


def fused_combine(act, w2, probs, slot, group=None, route=None):
    """Run GEMM2, the combine all-to-all and the weighted unpermute as one autograd node.

    Parameters
    ----------
    act : torch.Tensor
        ``[E_local, world * C, F]`` SwiGLU output on the expert side.
    w2 : torch.Tensor
        ``[E_local, F, H]`` this rank's GEMM2 weights.
    probs : torch.Tensor
        ``[T, top_k]`` renormalised routing probabilities (token side).
    slot : torch.Tensor
        ``[T, top_k]`` int64 capacity-buffer row of each assignment, ``E * C`` when dropped (with a
        ``route``: its row among the ``T * top_k`` routed rows).
    group : torch.distributed.ProcessGroup or None
        Expert-parallel group; None or one rank means no communication.
    route : Route or None
        None: equal splits of ``[E, C]`` capacity buffers. A :class:`~remat_compiler.moe._dist.Route`
        (``MoELayer(splits="uneven")``): the dropless exchange with the routed split sizes.

    Returns
    -------
    torch.Tensor
        ``[T, H]``, equal to the autograd chain ``bmm -> all_to_all -> weighted_unpermute``.

    Raises
    ------
    ValueError
        If the shapes of ``act``, ``w2``, ``probs`` and ``slot`` do not fit together.

    Example
    -------
    >>> out = fused_combine(act, layer.gemm2.weight, probs, slot, layer.group)  # doctest: +SKIP
    """
    if act.dim() != 3 or w2.dim() != 3 or act.shape[0] != w2.shape[0] or act.shape[2] != w2.shape[1]:
        raise ValueError(
            f"act {tuple(act.shape)} and w2 {tuple(w2.shape)} must be [E_local, rows, F] and "
            "[E_local, F, H]; pass the SwiGLU output and the GEMM2 weight of the same experts"
        )
    if probs.dim() != 2 or slot.shape != probs.shape:
        raise ValueError(
            f"probs {tuple(probs.shape)} and slot {tuple(slot.shape)} must both be [T, top_k]; "
            "pass the router's probabilities and the permute's slots"
        )
    if act.shape[1] % group_world_size(group):
        raise ValueError(
            f"act has {act.shape[1]} rows per expert, not divisible by the group size; "
            "pass the expert-side buffer produced by token_to_expert"
        )
    return FusedCombine.apply(act, w2, probs, slot, group, *(route or ()))
