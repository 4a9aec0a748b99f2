"""The fused combine for transformers' MoE experts: down projection + routing-weighted sum, ``y`` never saved.

transformers' default experts (``experts_implementation="grouped_mm"``, ``grouped_mm_experts_forward``
in ``transformers/integrations/moe.py``; Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3's routed
experts) sort the ``S = T * top_k`` token copies by expert and run, per sorted row ``s`` of expert ``e``
holding assignment ``(t, k)``::

    a_s   = act(x_t W_gate_e^T) * (x_t W_up_e^T)         (grouped GEMM1, SwiGLU)
    y_s   = a_s @ down_proj_e^T                          (grouped GEMM2, [S, H])
    out_t = sum_k p_tk * y_s                             (weight, restore the order, sum)

Autograd saves ``y`` for ``d(p)``. Here the last two lines are one :class:`GroupedFusedCombine`
node, whose backward takes ``d(p)`` from the dgrad GEMM, as :mod:`remat_compiler.moe.combine` does for
:class:`~remat_compiler.moe.MoELayer` (``G = dL/dout``, ``W2_e = down_proj_e^T``)::

    H_s       = G_t @ down_proj_e                        (the dgrad, needed for dL/da anyway)
    dL/dp_tk  = <G_t, y_s> = <H_s, a_s>
    dL/da_s   = p_tk * H_s
    dL/d down_proj_e = sum_{s in e} G_t^T (p_tk * a_s)

Saved for backward: ``a``, ``down_proj``, the expert offsets, the sorted probabilities and each sorted
row's token (the last two autograd saves anyway for the gathers that made them); never ``y``, nor the
inverse permutation that restored the order. Both backward GEMMs and the row dot products run in one
custom op, :func:`grouped_combine_dgrad`, through one ``[S, F]`` buffer, like
:func:`~remat_compiler.moe.combine.combine_dgrad`: it allocates nothing but its outputs.

:func:`hf_fused_combine_mode` swaps this in, while a step is traced, for every experts module that
follows the pattern (:func:`why_not_fusable` says why one does not), and :func:`hf_combine_modes`
for the blocks it names (the default solver's per-segment choice); the forward it runs is
transformers' own, op for op and in transformers' order, so its outputs are identical and its traced
forward is the unfused one's, node for node.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from .combine import rowdot

__all__ = ["grouped_combine_dgrad", "GroupedFusedCombine", "GroupedFusedCombineStep", "why_not_fusable",
           "hf_blocks", "hf_combine_modes", "hf_fused_combine_mode", "FUSED_CHILD"]

#: the submodule of a swapped experts module that runs the fused combine (``remat_compiler.passes.moe`` tags its nodes)
FUSED_CHILD = "fused_combine"


@torch.library.custom_op("remat::grouped_combine_dgrad", mutates_args=())
def grouped_combine_dgrad(grad_rows: torch.Tensor, w2: torch.Tensor, act: torch.Tensor, p_rows: torch.Tensor,
                          offsets: torch.Tensor, need_w2: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped fused combine's backward GEMMs, ``d(probs)`` read off the dgrad, in one ``[S, F]`` buffer.

    Parameters
    ----------
    grad_rows : torch.Tensor
        ``[S, H]`` unscaled ``G`` of each expert-sorted row's token.
    w2 : torch.Tensor
        ``[E, H, F]`` the experts' ``down_proj`` (transformers' layout: ``y_s = a_s @ w2[e]^T``).
    act : torch.Tensor
        ``[S, F]`` saved SwiGLU output, rows sorted by expert.
    p_rows : torch.Tensor
        ``[S, 1]`` probability of each sorted row.
    offsets : torch.Tensor
        ``[E]`` int32 cumulative rows per expert (``grouped_mm``'s ``offs``); expert ``e`` owns rows
        ``offsets[e-1]:offsets[e]``.
    need_w2 : bool
        Whether to compute ``dL/dw2`` (False when ``down_proj`` needs no gradient).

    Returns
    -------
    tuple of torch.Tensor
        ``dL/da = p * (G w2[e])`` (``[S, F]``), ``dL/dp = <G w2[e], a>`` per row (``[S, 1]``) and
        ``dL/dw2[e] = G^T (p * a)`` over the expert's rows (``[E, H, F]``, zero for an expert with no
        rows; empty when ``need_w2`` is False). One ``[S, F]`` buffer holds ``p * a`` for the wgrad,
        then ``G w2[e]`` (the row dot products are a batched GEMM on it) and is scaled in place into
        ``dL/da``: the op allocates nothing but its outputs. Expert by expert, like transformers'
        ``grouped_mm_fallback`` (one host sync for the offsets).

    Example
    -------
    >>> grad_act, dp, grad_w2 = grouped_combine_dgrad(g, down_proj, act, p, offsets, True)  # doctest: +SKIP
    """
    buf = torch.mul(act, p_rows)  # p * a: the wgrad's scaled operand, [S, F]
    grad_w2 = grad_rows.new_zeros(w2.shape) if need_w2 else grad_rows.new_empty(0)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            rows = slice(start, end)
            if need_w2:
                torch.mm(grad_rows[rows].t(), buf[rows], out=grad_w2[e])  # [H, F]
            torch.mm(grad_rows[rows], w2[e], out=buf[rows])  # G w2[e], over p * a once the wgrad read it
        start = end
    dp = rowdot(buf, act)  # <G w2[e], a> = <G, y>: read before the scaling
    return buf.mul_(p_rows), dp, grad_w2


@grouped_combine_dgrad.register_fake
def _(grad_rows, w2, act, p_rows, offsets, need_w2):
    rows = grad_rows.shape[0]
    grad_w2 = grad_rows.new_empty(*w2.shape) if need_w2 else grad_rows.new_empty(0)
    return grad_rows.new_empty(rows, act.shape[1]), grad_rows.new_empty(rows, 1), grad_w2


@register_flop_formula(torch.ops.remat.grouped_combine_dgrad)
def _grouped_combine_dgrad_flop(grad_shape, w2_shape, act_shape, p_shape, offsets_shape, need_w2,
                                out_shape=None, **kwargs) -> int:
    """The dgrad GEMM (``2 * S * H * F``, as ``remat_compiler.passes.costs`` counts a grouped GEMM), the row dot
    products (``2 * S * F``, as ``bmm`` counts them) and the wgrad GEMM when asked; the scalings left out."""
    rows, hidden = grad_shape
    width = act_shape[1]
    return 2 * rows * hidden * width * (2 if need_w2 else 1) + 2 * rows * width


class GroupedFusedCombine(torch.autograd.Function):
    """Down projection, routing weights, order restored and each token's rows summed, as one node.

    Forward runs transformers' ops (``_grouped_linear``, the weighting, the inverse permutation, the
    per-token sum) in transformers' order, so its output is identical to the unfused experts'. See
    the module docstring for the backward. Use through :class:`GroupedFusedCombineStep`.
    """

    @staticmethod
    def forward(ctx, act, w2, offsets, probs_g, perm, token_g, num_top_k):
        from transformers.integrations.moe import _grouped_linear

        y = _grouped_linear(act, w2, offsets, bias=None, is_transposed=False)  # [S, H]
        weighted = y * probs_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        weighted = weighted[inv_perm]
        out = weighted.view(-1, num_top_k, weighted.shape[-1]).sum(dim=1)
        ctx.save_for_backward(act, w2, offsets, probs_g, token_g)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        act, w2, offsets, probs_g, token_g = ctx.saved_tensors
        need_act, need_w2, _, need_probs = ctx.needs_input_grad[:4]
        grad_act = grad_w2 = grad_probs = None
        if need_act or need_w2 or need_probs:
            # in the experts' dtype (a float32 router over bfloat16 experts: G and p are float32)
            grad_rows = grad_out.to(act.dtype)[token_g]  # [S, H]: G of each sorted row's token
            p_rows = probs_g.to(act.dtype).unsqueeze(-1)
            grad_act, dp, grad_w2 = grouped_combine_dgrad(grad_rows, w2, act, p_rows, offsets, need_w2)
            grad_probs = dp.view(-1).to(probs_g.dtype) if need_probs else None
        return (grad_act if need_act else None, grad_w2 if need_w2 else None, None, grad_probs,
                None, None, None)


class GroupedFusedCombineStep(nn.Module):
    """:class:`GroupedFusedCombine` as a submodule (no parameters), so that its traced nodes carry a
    module path of their own (``<experts>.fused_combine``, which ``remat_compiler.passes.moe`` tags ``fused``)."""

    def forward(self, act, w2, offsets, probs_g, perm, token_g, num_top_k: int) -> torch.Tensor:
        return GroupedFusedCombine.apply(act, w2, offsets, probs_g, perm, token_g, num_top_k)


def _fused_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` for the pattern :func:`why_not_fusable` accepts,
    with the down projection and the weighted combine run by the ``fused_combine`` child. The routing
    weights may be wider than the experts (Mixtral's and DeepSeek-V3's routers give float32 ones to
    bfloat16 experts: the weighted rows and their sum are float32, as transformers computes them); where
    the hidden states and the two weights differ in dtype (autocast) it runs transformers' forward
    unfused."""
    from transformers.integrations.moe import _grouped_linear, grouped_mm_experts_forward

    dtypes = {hidden_states.dtype, self.gate_up_proj.dtype, self.down_proj.dtype}
    if len(dtypes) != 1 or not top_k_weights.is_floating_point():
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.size(-1)
    # transformers' ops in transformers' order, so that the traced forward is node for node the
    # unfused one's (the combine choice, remat_compiler.solvers.combine_choice, relies on it)
    weights = top_k_weights.reshape(-1)
    # the S = T * k (token, slot) copies, sorted by expert: row s holds copy order[s], of token s_token[s]
    sorted_experts, order = torch.sort(top_k_index.reshape(-1))
    s_token = order // k
    rows = hidden_states[s_token]
    s_prob = weights[order]
    # rows per expert as grouped_mm's cumulative offsets (histc takes floats on the CPU, ints on CUDA)
    counted = sorted_experts.float() if hidden_states.device.type in ("cpu", "mps") else sorted_experts.int()
    offsets = torch.cumsum(torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1),
                           dim=0, dtype=torch.int32)
    gate_up = _grouped_linear(rows, self.gate_up_proj, offsets, bias=None, is_transposed=False)
    act = self._apply_gate(gate_up)  # [S, F]
    out = getattr(self, FUSED_CHILD)(act, self.down_proj, offsets, s_prob, order, s_token, k)
    return out.to(hidden_states.dtype)


def why_not_fusable(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot run the fused combine, or None when it can.

    It can when it is a transformers experts module (``@use_experts_implementation``) running
    transformers' ``grouped_mm`` forward, gated (``gate_up_proj`` concatenated), without biases, post
    norm or transposed weights, and not expert-parallel. One more condition is met only per call, so
    it is not checked here: the hidden states come in the weights' dtype (not under autocast).

    Parameters
    ----------
    experts : nn.Module
        An MoE block's ``experts`` child.

    Returns
    -------
    str or None
    """
    config = getattr(experts, "config", None)
    if config is None or not hasattr(experts, "has_gate"):
        return f"{type(experts).__name__} is not a transformers experts module (@use_experts_implementation)"
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    impl = getattr(config, "_experts_implementation", None)
    if impl != "grouped_mm" or ALL_EXPERTS_FUNCTIONS.get(impl) is not grouped_mm_experts_forward:
        return f"it runs experts_implementation={impl!r}, not transformers' 'grouped_mm'"
    layout = {"has_gate": True, "is_concatenated": True, "has_bias": False, "has_post_expert_norm": False,
              "is_transposed": False, "_is_expert_parallel": False}
    off = [f"{k}={getattr(experts, k, None)!r}" for k, v in layout.items() if getattr(experts, k, None) != v]
    if off:
        return f"its layout is not the fused pattern's ({', '.join(off)})"
    weights = (getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None))
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return "it has no 3-D gate_up_proj / down_proj expert weights"
    if "forward" in vars(experts) or FUSED_CHILD in experts._modules:
        return f"its forward is already replaced on the instance (or it has a {FUSED_CHILD!r} child)"
    return None


def hf_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The transformers MoE blocks of ``model`` that ``remat_compiler.passes.moe`` recognises
    (:data:`remat_compiler.passes.moe.MOE_BLOCKS`) and that have an ``experts`` child, by module path: the names of
    their segments in a traced graph (``meta["remat.moe"]["segment"]``)."""
    from remat_compiler.passes.moe import MOE_BLOCKS

    return {path: m for path, m in model.named_modules()
            if MOE_BLOCKS.get(type(m).__name__, "moe_layer") != "moe_layer"
            and isinstance(getattr(m, "experts", None), nn.Module)}


@contextlib.contextmanager
def hf_combine_modes(model: nn.Module, modes):
    """Run the named transformers MoE blocks of ``model`` with the fused combine; restore on exit.

    Parameters
    ----------
    model : nn.Module
    modes : {"autograd", "fused"} or mapping of str to str
        ``"fused"``: every block whose experts :func:`why_not_fusable` accepts (the others are left
        as they are); ``"autograd"``: none. A mapping names blocks by module path
        (:func:`hf_blocks`) with their combine: ``"fused"`` swaps the fused combine into that
        block's experts, ``"autograd"`` leaves it as transformers runs it; blocks not named are
        left as they are.

    Raises
    ------
    ValueError
        For a mode that is not ``"autograd"`` or ``"fused"``, a path that is not an MoE block of
        ``model`` (naming those it has), or ``"fused"`` for a block whose experts cannot run it
        (saying why). Nothing is swapped then.

    Example
    -------
    >>> with hf_combine_modes(model, {"model.layers.0.mlp": "fused"}):   # doctest: +SKIP
    ...     traced = remat_compiler.trace(model, (), inputs)
    """
    blocks = hf_blocks(model)
    if isinstance(modes, str):
        if modes not in ("autograd", "fused"):
            raise ValueError(f"combine mode must be one of ('autograd', 'fused'), got {modes!r}")
        swapped = [m.experts for m in blocks.values() if modes == "fused" and why_not_fusable(m.experts) is None]
    else:
        swapped = []
        for path, mode in dict(modes).items():
            if mode not in ("autograd", "fused"):
                raise ValueError(f"combine mode of {path!r} must be one of ('autograd', 'fused'), got {mode!r}")
            if path not in blocks:
                raise ValueError(f"{path!r} is not a transformers MoE block of the model; its blocks: "
                                 f"{', '.join(repr(p) for p in blocks) or 'none'}")
            why = why_not_fusable(blocks[path].experts)
            if mode == "fused" and why is not None:
                raise ValueError(f"{path!r} cannot run the fused combine: {why}")
            if mode == "fused":
                swapped.append(blocks[path].experts)
    try:
        for m in swapped:
            m.add_module(FUSED_CHILD, GroupedFusedCombineStep())
            m.forward = types.MethodType(_fused_forward, m)
        yield model
    finally:
        for m in swapped:
            vars(m).pop("forward", None)
            m._modules.pop(FUSED_CHILD, None)


@contextlib.contextmanager
def hf_fused_combine_mode(model: nn.Module):
    """Run every fusable transformers experts module of ``model`` with the fused combine; restore on exit.

    For each ``experts`` child of a transformers MoE block that ``remat_compiler.passes.moe`` recognises and
    :func:`why_not_fusable` accepts, the instance gets a ``forward`` (transformers' grouped_mm forward
    with the down projection and combine fused, identical outputs) and a ``fused_combine`` child
    (:class:`GroupedFusedCombineStep`); both are removed on exit, even on error. Other experts are left
    as they are (their segments trace unfused, and ``moe_custom`` refuses them). It is
    :func:`hf_combine_modes` with ``"fused"``.

    Example
    -------
    >>> with hf_fused_combine_mode(model):       # doctest: +SKIP
    ...     traced = remat_compiler.trace(model, (), inputs)
    """
    with hf_combine_modes(model, "fused"):
        yield model
