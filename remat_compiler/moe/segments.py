"""Every MoE segment of a model by the name its traced graph gives it, and its combine set per segment.

A segment is an :class:`~remat_compiler.moe.MoELayer` or a transformers MoE block
(:func:`~remat_compiler.moe.hf.hf_blocks`), named by its module path in the model, as
``meta["remat.moe"]["segment"]`` names it in the traced graph (:mod:`remat_compiler.passes.moe`) and
``plan.extras["moe_combine"]`` records it. :func:`segment_combines` traces each with the combine a
mapping names (MoELayer: ``combine_mode``; HF block: the fused down projection + combine swapped into
its experts or not); :func:`why_not_choosable` says, per segment, whether the default solver can
choose its combine in its solve (:func:`remat_compiler.combines.chooses_combines`).

Example
-------
>>> why_not_choosable(model)                      # doctest: +SKIP
{'model.model.layers.0.mlp': None, 'model.model.layers.1.mlp': None}
>>> with segment_combines(model, {"model.model.layers.0.mlp": "fused"}):   # doctest: +SKIP
...     traced = remat_compiler.trace(model, (), inputs)
"""
from __future__ import annotations

import contextlib

import torch

from .hf import hf_blocks, hf_combine_modes, why_not_fusable
from .layer import MoELayer, combine_modes

__all__ = ["why_not_choosable", "segment_combines"]


def why_not_choosable(model: torch.nn.Module) -> dict[str, str | None]:
    """Per MoE segment of ``model`` (module path), why its combine cannot be chosen per segment, or
    None where it can.

    An MoELayer can with the default ``combine="autograd"``, with or without an expert-parallel
    group, equal or uneven splits (its two combines' backwards differ in their collectives too:
    the choice's solve charges each piece's communication); a user's ``combine="fused"`` is kept.
    A transformers block can where its experts can run the fused combine
    (:func:`~remat_compiler.moe.hf.why_not_fusable`).

    Returns
    -------
    dict of str to str or None
    """
    found: dict[str, str | None] = {}
    for path, m in model.named_modules():
        if isinstance(m, MoELayer):
            found[path] = "its combine='fused' is the user's" if m.combine_mode != "autograd" else None
    for path, block in hf_blocks(model).items():
        why = why_not_fusable(block.experts)
        found[path] = None if why is None else f"its experts cannot run the fused combine: {why}"
    return found


@contextlib.contextmanager
def segment_combines(model: torch.nn.Module, modes: dict[str, str]):
    """Trace each named MoE segment of ``model`` with its combine while the block runs; restore on exit.

    Parameters
    ----------
    model : torch.nn.Module
    modes : mapping of str to str
        Segment (module path of an MoELayer or a transformers MoE block) -> ``"autograd"`` or
        ``"fused"``; segments not named keep theirs.

    Raises
    ------
    ValueError
        For a path that is no MoE segment of ``model`` (naming those it has), an unknown mode, or
        ``"fused"`` for a transformers block whose experts cannot run it (saying why).
    """
    layers = {path for path, m in model.named_modules() if isinstance(m, MoELayer)}
    blocks = set(hf_blocks(model))
    unknown = [p for p in modes if p not in layers and p not in blocks]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not an MoE segment of the model; its segments: "
                         f"{', '.join(repr(p) for p in sorted(layers | blocks)) or 'none'}")
    with combine_modes(model, {p: m for p, m in modes.items() if p in layers}), \
            hf_combine_modes(model, {p: m for p, m in modes.items() if p in blocks}):
        yield model
