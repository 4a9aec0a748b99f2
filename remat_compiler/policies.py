"""What the user decides: tiny predicates over graph values, applied to CP-SAT as hard constraints.

A policy is a function ``policy(cost_graph, name) -> "save" | "recompute" | None`` over the forward
values a plan decides about (:attr:`CostGraph.candidates`): ``"save"`` keeps the value from the forward,
``"recompute"`` forbids keeping it (backward recomputes it if it needs it), None leaves it to the solver.
Combine them with :func:`first_of`; the first policy with an opinion wins.

>>> policy = first_of(save_matmuls, never_save("aten.gelu"))                 # doctest: +SKIP
>>> m = remat_compiler.compile(model, "2GiB", policy=policy)                  # doctest: +SKIP

Values that must not be recomputed (random ops) are always saved, whatever a policy says.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Literal

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import save_all_set

__all__ = ["Policy", "MATMUL_OPS", "save_matmuls", "save", "save_only", "never_save", "first_of",
           "apply_policy"]

Decision = Literal["save", "recompute"] | None
Policy = Callable[[CostGraph, str], Decision]

#: Ops whose outputs ``save_matmuls`` keeps (matrix products, convolutions, attention).
MATMUL_OPS = frozenset({
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
    "aten._grouped_mm.default", "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
})


def _matches(cg: CostGraph, name: str, patterns: tuple[str, ...]) -> bool:
    """A pattern (fnmatch) matches the node's name, its op, or the module path that produced it."""
    keys = (name, cg.attr(name, "op"), cg.attr(name, "module") or "")
    return any(fnmatch.fnmatchcase(k, p) or k.startswith(p + ".") for p in patterns for k in keys)


def save_matmuls(cg: CostGraph, name: str) -> Decision:
    """Keep the outputs of matrix products, convolutions and attention (JAX's ``dots_saveable``)."""
    return "save" if cg.attr(name, "op") in MATMUL_OPS else None


def _by_pattern(patterns: tuple[str, ...], matched: Decision, other: Decision) -> Policy:
    def policy(cg: CostGraph, name: str) -> Decision:
        return matched if _matches(cg, name, patterns) else other
    return policy


def save(*patterns: str) -> Policy:
    """Keep the values whose name, op or module path matches a pattern (``"*.attn.c_attn"``)."""
    return _by_pattern(patterns, "save", None)


def save_only(*patterns: str) -> Policy:
    """Keep the matching values and no other (the rest is recomputed where backward needs it)."""
    return _by_pattern(patterns, "save", "recompute")


def never_save(*patterns: str) -> Policy:
    """Never keep the matching values (``"aten.gelu*"``, ``"transformer.h.*.mlp"``)."""
    return _by_pattern(patterns, "recompute", None)


def first_of(*policies: Policy) -> Policy:
    """The first policy's decision that is not None."""
    def policy(cg: CostGraph, name: str) -> Decision:
        for p in policies:
            d = p(cg, name)
            if d is not None:
                return d
        return None
    return policy


def apply_policy(cg: CostGraph, policy: Policy) -> tuple[list[str], list[str]]:
    """The values a policy forces to be saved and forbids saving, among those backward reads.

    Returns
    -------
    (forced_saved, forbidden_saved) : lists of candidate names, for ``solve_cpsat``.

    Raises
    ------
    ValueError
        If the policy returns something other than "save", "recompute" or None.
    """
    forced, forbidden = [], []
    for v in save_all_set(cg):
        d = policy(cg, v)
        if d == "save":
            forced.append(v)
        elif d == "recompute" and not cg.attr(v, "never_recompute"):
            forbidden.append(v)
        elif d not in (None, "recompute"):
            raise ValueError(f"a policy returned {d!r} for {v}; expected 'save', 'recompute' or None")
    return forced, forbidden
