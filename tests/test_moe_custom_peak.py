"""moe_custom's step peak against moe_fast's (issue: the fused backward must hold no more than fast's).

Shapes: F > H and F < H, top-2 and top-1, one and two layers (``moe_peak_worker.SHAPES``), on one
process, and three of them (``RANK_SHAPES``: both sides of F vs H and of top-k) on 2 gloo ranks. Per shape and rank: gradients equal eager's, the predicted peak is the
measured one, custom saves exactly ``y`` less than fast, and custom's measured peak is at most fast's
minus the ``y`` bytes fast holds at its peak (live in its simulation there: a layer's ``y`` is freed
in that layer's unpermute backward, so this is 0 when fast peaks in the backward of its last layer to
run, and the ``y`` of the layers whose backward has not begun otherwise).
"""
from __future__ import annotations

import dist_spawn
import pytest
import torch

import moe_peak_worker as worker

TOL = dict(rtol=1e-10, atol=1e-12)  # float64


def check_shape(res: dict, shape: dict, label: str) -> None:
    for name in worker.STRATEGIES:
        got, want = res[name]["grads"], res["eager"]
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=lambda m: f"{label} {name} {k}: {m}")
        peaks = res[name]["measured"]
        assert sorted(peaks)[len(peaks) // 2] == res[name]["predicted"], (label, name, res[name])
    fast, custom = (min(res[n]["measured"]) for n in worker.STRATEGIES)
    assert res["moe_fast"]["saved"] - res["moe_custom"]["saved"] == worker.y_bytes(shape), label
    at = res["moe_fast"]["peak_at"]
    assert custom <= fast - at["y_live_bytes"], (label, fast, custom, at, res["moe_custom"]["peak_at"])


def _id(s):
    return "L{num_layers}-H{hidden_size}-F{ffn_hidden_size}-k{top_k}".format(**s)


@pytest.mark.parametrize("shape", [pytest.param(s, id=_id(s)) for s in worker.SHAPES])
def test_custom_peak_one_rank(shape):
    check_shape(worker.run_shape(shape), shape, "1 rank")


def test_custom_peak_two_ranks(tmp_path):
    dist_spawn.spawn_ranks(worker.run_rank, 2, tmp_path, timeout_s=240)
    for r in range(2):
        results = torch.load(tmp_path / f"rank{r}.pt")
        assert len(results) == len(worker.RANK_SHAPES)
        for shape, res in zip(worker.RANK_SHAPES, results):
            check_shape(res, shape, f"rank {r}")
