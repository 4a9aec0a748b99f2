"""Repeated blocks of a cost graph: which forward nodes are identical layers, and their boundaries.

A *block* is a child of the model's layer container (``remat.block``, tagged by :mod:`remat_compiler.passes.blocks`).
Blocks whose forward nodes have the same ops, shapes and dtypes in the same order are *identical*
(a transformer's layers); the solvers use them to tie decisions, to decompose the problem per block
and to start from per-block checkpointing. Every function here answers "none" with None or an empty
list, never with an exception.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat_compiler.graph.costgraph import CostGraph

__all__ = ["BlockStack", "identical_blocks", "block_stack", "block_classes", "block_boundary_set",
           "representative_block"]


@dataclass
class BlockStack:
    """A group of identical blocks: names in forward order and the aligned candidates.

    ``positions[p][k]`` is the p-th candidate of block ``blocks[k]``.
    """

    blocks: list[str]
    positions: list[tuple[str, ...]]


def identical_blocks(cg: CostGraph) -> list[BlockStack]:
    """Every group of 2 or more identical blocks, largest first, with their aligned candidates."""
    nodes: dict[str, list[str]] = {}
    for n in cg.fw_order:
        b = cg.attr(n, "block")
        if b is not None:
            nodes.setdefault(b, []).append(n)
    groups: dict[tuple, list[str]] = {}
    for b, ns in nodes.items():
        sig = tuple((cg.attr(n, "op"), cg.attr(n, "shape"), cg.attr(n, "dtype")) for n in ns)
        groups.setdefault(sig, []).append(b)
    cand = set(cg.candidates)
    stacks = []
    for blocks in sorted(groups.values(), key=len, reverse=True):
        if len(blocks) >= 2:
            positions = [p for p in zip(*(nodes[b] for b in blocks)) if all(v in cand for v in p)]
            stacks.append(BlockStack(blocks=blocks, positions=positions))
    return stacks


def block_stack(cg: CostGraph) -> BlockStack | None:
    """The graph's largest group of identical blocks, or None."""
    stacks = identical_blocks(cg)
    return stacks[0] if stacks else None


def representative_block(stack: BlockStack) -> int:
    """The index of the block that stands for all of a stack (the middle one: its neighbours on
    both sides are blocks too, so its windows are typical)."""
    return len(stack.blocks) // 2


def block_classes(cg: CostGraph) -> list[list[str]]:
    """Candidates that correspond across identical blocks: one list per position (empty if none)."""
    return [list(p) for stack in identical_blocks(cg) for p in stack.positions]


def block_boundary_set(cg: CostGraph) -> list[str] | None:
    """Saved set of classic per-block checkpointing: everything outside blocks, and each block's
    output (what a node outside the block reads in the forward). None if the graph has no blocks."""
    if not cg.g.graph.get("block_container") and not any(cg.attr(n, "block") for n in cg.fw_order):
        return None
    return [n for n in cg.candidates if _kept_by_checkpointing(cg, n)]


def _kept_by_checkpointing(cg: CostGraph, n: str) -> bool:
    block = cg.attr(n, "block")
    if block is None or cg.attr(n, "never_recompute"):
        return True
    # a block's output: read by a forward node outside this block (backward nodes of other blocks do
    # not count: only forward readers define the block boundary); look through views and getitems
    stack = [u for u in cg.g.successors(n) if cg.attr(u, "phase") == "fw"]
    seen = set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if cg.storage(u) == n:
            stack.extend(w for w in cg.g.successors(u) if cg.attr(w, "phase") == "fw")
        elif cg.attr(u, "block") != block:
            return True
    return n in {cg.storage(o) for o in cg.fw_outputs if o}
