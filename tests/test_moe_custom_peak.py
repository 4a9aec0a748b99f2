"""moe_custom's step peak against moe_fast's (issue: the fused backward must hold no more than fast's).

Shapes: F > H and F < H, top-2 and top-1, one and two layers (``moe_peak_worker.SHAPES``), on one
process, and three of them (``RANK_SHAPES``: both sides of F vs H and of top-k) on 2 gloo ranks (in
tests/test_moe_compile.py's 2-rank job). Per shape and rank (``moe_peak_worker.check_shape``):
gradients equal eager's, the predicted peak is the measured one, custom saves exactly ``y`` less
than fast, and custom's measured peak is at most fast's minus the ``y`` bytes fast holds at its peak
(live in its simulation there: a layer's ``y`` is freed in that layer's unpermute backward, so this
is 0 when fast peaks in the backward of its last layer to run, and the ``y`` of the layers whose
backward has not begun otherwise).
"""
from __future__ import annotations

import pytest

import moe_peak_worker as worker


def _id(s):
    return "L{num_layers}-H{hidden_size}-F{ffn_hidden_size}-k{top_k}".format(**s)


@pytest.mark.parametrize("shape", [pytest.param(s, id=_id(s)) for s in worker.SHAPES])
def test_custom_peak_one_rank(shape):
    worker.check_shape(worker.run_shape(shape), shape, "1 rank")
