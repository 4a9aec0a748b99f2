"""The built-in demo: an MLP chain sized so that activations, not parameters, dominate the step's memory.

CLI: ``remat-compiler demo`` (or ``remat-compiler plan examples/demo.py:build --budget 0.5``).
Python: ``python examples/demo.py`` plans it at half the no-recompute peak, trains one step with the
plan and prints the plan with the measured peak.
"""
from __future__ import annotations

from remat_compiler.examples.models import build_mlp

__all__ = ["build"]


def build(width: int = 256, depth: int = 8, batch: int = 2048, seed: int = 0):
    """The demo MLP chain: ``depth`` Linear+GELU blocks of ``width`` on a ``batch`` of random rows.

    With the defaults each activation is 2 MiB against 256 KiB of weights per layer, so what a plan
    saves or recomputes decides the peak.

    Returns
    -------
    tuple
        ``(model, (x,), loss_fn)`` as :func:`examples.models.build_mlp` builds it.
    """
    return build_mlp(width=width, depth=depth, batch=batch, seed=seed)


def main(budget: float = 0.5) -> None:
    """Plan the demo at ``budget``, train one step with the plan, and print the plan and measured peak."""
    import remat_compiler

    model, args, loss_fn = build()
    compiled = remat_compiler.compile(model, memory_budget=budget)
    loss_fn(compiled(*args)).backward()  # first call: trace and plan
    for p in model.parameters():
        p.grad = None
    with remat_compiler.LiveStorageTracker() as mem:
        loss_fn(compiled(*args)).backward()
    print(compiled.plan.explain())
    print(f"\nmeasured peak {remat_compiler.human_bytes(mem.peak_bytes)} "
          f"(predicted {remat_compiler.human_bytes(compiled.plan.peak_bytes)})")


if __name__ == "__main__":
    main()
