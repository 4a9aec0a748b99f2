"""Graph passes: pure steps ``GraphModule -> GraphModule`` that talk only through ``node.meta["remat.*"]``.

Before annotating, :func:`passes.rng.replayable_dropout` makes dropout replay its RNG state where it
is recomputed, and :func:`passes.loss.fuse_cross_entropy_backward` rewrites cross-entropy's backward
into one op (it holds two logits-sized tensors instead of three). Every key the passes write or
read, with its meaning and its writer, is in :mod:`passes.keys`.
"""
from __future__ import annotations

import torch.fx as fx

from passes.blocks import annotate_blocks
from passes.costs import CostModel, annotate_costs
from passes.loss import fuse_cross_entropy_backward
from passes.moe import tag_moe_segments
from passes.phases import annotate_phases
from passes.rng import replayable_dropout
from passes.storage import annotate_storage, calibrate_scalar_storage

__all__ = ["run_passes", "CostModel", "annotate_phases", "annotate_storage", "calibrate_scalar_storage",
           "annotate_costs", "annotate_blocks", "tag_moe_segments", "fuse_cross_entropy_backward",
           "replayable_dropout"]


def run_passes(gm: fx.GraphModule, *, num_fwd_outputs: int, cost_model: CostModel | None = None
               ) -> fx.GraphModule:
    """Run the standard pass list over a joint graph and return it.

    Parameters
    ----------
    gm : fx.GraphModule
        The joint forward+backward graph from :func:`remat_compiler.trace.trace`.
    num_fwd_outputs : int
        How many of the joint graph's outputs are forward outputs.
    cost_model : CostModel, optional
        Compute rate, memory and link bandwidth for the runtime estimate.
    """
    gm.graph.eliminate_dead_code()
    gm = replayable_dropout(gm)
    gm = fuse_cross_entropy_backward(gm)
    gm = annotate_phases(gm, num_fwd_outputs=num_fwd_outputs)
    gm = annotate_storage(gm)
    gm = calibrate_scalar_storage(gm)
    gm = annotate_costs(gm, cost_model or CostModel())
    gm = annotate_blocks(gm)
    return tag_moe_segments(gm)
