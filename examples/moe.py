"""The project's MoE layer (router, permute, all-to-all, SwiGLU experts, combine) on one rank.

CLI: ``remat-compiler compare examples/moe.py:build --strategies save_all,cpsat --budget 0.95``.
Python: ``python examples/moe.py`` plans it under a budget, trains one step with the plan and
prints the plan.
"""
from __future__ import annotations

import torch

__all__ = ["build"]


def build(hidden_size: int = 256, ffn_hidden_size: int = 512, num_experts: int = 4, top_k: int = 2,
          tokens: int = 1024, combine: str = "autograd", seed: int = 0):
    """An :class:`remat_compiler.moe.MoELayer` on ``tokens`` random tokens, with loss ``mean(out**2)``.

    The input requires grad, as the output of a previous layer would.

    Returns
    -------
    tuple
        ``(layer, (x,), loss_fn)``.
    """
    from remat_compiler.moe import MoELayer

    torch.manual_seed(seed)
    layer = MoELayer(hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size, num_experts=num_experts,
                     top_k=top_k, combine=combine)
    x = torch.randn(tokens, hidden_size, requires_grad=True)
    return layer, (x,), lambda out: out.pow(2).mean()


def main(budget: float = 0.95) -> None:
    """Plan the layer at ``budget`` of its no-recompute peak, train one step, print the plan."""
    import remat_compiler

    layer, args, loss_fn = build()
    compiled = remat_compiler.compile(layer, memory_budget=budget)
    loss_fn(compiled(*args)).backward()
    print(compiled.plan.explain())


if __name__ == "__main__":
    main()
