"""Helpers of tests/test_moe_custom_peak.py; on 2 gloo ranks, :func:`run_shape` runs inside
``moe_compile_worker.run_rank``'s job (one spawn for the expert-parallel tests of a world size).

For each shape of :data:`SHAPES` it builds the same MoE model (float64, seed 0) with its loss
``(out ** 2).mean()`` inside, runs the step eagerly, then compiles it with ``moe_fast`` and with
``moe_custom`` and records, per strategy: the gradients, the plan's predicted peak and saved bytes,
the measured step peaks of a few steps (:class:`~remat_compiler.memory.LiveStorageTracker`), and
whether the plan's simulated peak lies in the backward of an MoE segment (and of which role).
"""
from __future__ import annotations

import torch

import remat_compiler
from remat_compiler.moe import MoEStack
from remat_compiler.schedule import simulate

from helpers import assert_same, median, token_peaks, token_step
from moe_compile_worker import MeanSquare  # the model with its loss inside

__all__ = ["SHAPES", "RANK_SHAPES", "STRATEGIES", "make_model", "make_tokens", "y_bytes", "run_shape", "check_shape"]

# F > H and F < H, top-2 and top-1, one layer and two; 4 experts, 32 tokens a rank, float64.
# capacity_factor 2.0: top-2 drops nothing (2.0 = E / top_k), top-1 can drop assignments.
SHAPES = [
    dict(num_layers=1, hidden_size=16, ffn_hidden_size=24, top_k=2),
    dict(num_layers=1, hidden_size=24, ffn_hidden_size=12, top_k=2),
    dict(num_layers=1, hidden_size=16, ffn_hidden_size=40, top_k=1),
    dict(num_layers=2, hidden_size=24, ffn_hidden_size=8, top_k=1),
    dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, top_k=2),
]
# on 2 ranks (the suite's time is bounded): F < H at top-2 (where the all-to-alls made custom exceed
# fast before the fix) and the two-layer shapes, where fast holds a y at its peak; together still
# F > H and F < H, top-1 and top-2
RANK_SHAPES = [SHAPES[1], SHAPES[3], SHAPES[4]]
NUM_EXPERTS, TOKENS = 4, 32
STRATEGIES = ("moe_fast", "moe_custom")
STEPS = 3


def make_model(shape: dict, group=None) -> MeanSquare:
    torch.manual_seed(0)
    stack = MoEStack(shape["num_layers"], shape["hidden_size"], shape["ffn_hidden_size"], NUM_EXPERTS,
                     shape["top_k"], group=group)
    return MeanSquare(stack).double()


def make_tokens(shape: dict, world: int = 1, rank: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * TOKENS, shape["hidden_size"], generator=gen, dtype=torch.float64)
    return x[rank * TOKENS:(rank + 1) * TOKENS].clone()


def y_bytes(shape: dict) -> int:
    """Bytes of the gathered expert outputs ``[T * top_k, H]`` that the autograd combine saves, all layers."""
    return shape["num_layers"] * TOKENS * shape["top_k"] * shape["hidden_size"] * 8


def _peak_place(module, shape: dict) -> dict:
    """Where the plan's simulated peak is: phase and MoE role of the node running then, and the bytes
    of the gathered expert outputs ``y`` (``[T * top_k, H]``, saved for the unpermute's backward)
    that are live at that moment."""
    cg, plan = module.planned.cg, module.plan
    sim = simulate(cg, plan.schedule)
    node = sim.peak_node
    tag = cg.attr(node, "moe") or {}
    phase = "bw" if sim.peak_time >= sim.num_fw_steps else "fw"  # a recomputation runs in backward
    segments = sorted({(cg.attr(n, "moe") or {}).get("segment") for n in cg.fw_order} - {None})
    before = segments.index(tag["segment"]) if tag.get("segment") in segments else 0
    y_numel = TOKENS * shape["top_k"] * shape["hidden_size"]
    y_live = sum(sim.sizes[k] for k in sim.live_at(sim.peak_time)
                 if k[1] == "fw" and (cg.attr(k[0], "moe") or {}).get("role") in ("combine_a2a", "unpermute")
                 and (cg.attr(k[0], "shape") or ())[-1:] == (shape["hidden_size"],)
                 and sim.sizes[k] == y_numel * 8)
    return {"node": node, "phase": phase, "role": tag.get("role"), "layers_before": before,
            "y_live_bytes": y_live}


def run_shape(shape: dict, group=None, world: int = 1, rank: int = 0) -> dict:
    """Eager gradients and, per strategy, gradients, predicted / measured peaks and the peak's place."""
    x = make_tokens(shape, world, rank)
    out = {"eager": token_step(make_model(shape, group), x)}
    for name in STRATEGIES:
        module = remat_compiler.compile(make_model(shape, group), solver=name)
        grads = token_step(module, x)  # the first call traces and plans
        out[name] = {"grads": grads, "predicted": module.plan.peak_bytes, "saved": module.plan.saved_bytes,
                     "measured": token_peaks(module, x, STEPS), "peak_at": _peak_place(module, shape)}
    return out


def check_shape(res: dict, shape: dict, label: str) -> None:
    """Assert what tests/test_moe_custom_peak.py checks of one shape's :func:`run_shape` results."""
    for name in STRATEGIES:
        assert_same(res[name]["grads"], res["eager"], f"{label} {name}", rtol=1e-10, atol=1e-12,  # float64
                    none_ok=True)
        assert median(res[name]["measured"]) == res[name]["predicted"], (label, name, res[name])
    fast, custom = (min(res[n]["measured"]) for n in STRATEGIES)
    assert res["moe_fast"]["saved"] - res["moe_custom"]["saved"] == y_bytes(shape), label
    at = res["moe_fast"]["peak_at"]
    assert custom <= fast - at["y_live_bytes"], (label, fast, custom, at, res["moe_custom"]["peak_at"])


def print_table() -> None:
    """The figures behind issue 16's bound, one row a shape on one process:
    ``python tests/moe_peak_worker.py``."""
    print("| shape | moe_fast peak | moe_custom peak | y (all layers) | fast - y | custom - (fast - y) "
          "| fast's peak at | y live there | custom <= fast - y live |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        res = run_shape(shape)
        fast, custom = (min(res[n]["measured"]) for n in STRATEGIES)
        at, y = res["moe_fast"]["peak_at"], y_bytes(shape)
        label = "L{num_layers} H{hidden_size} F{ffn_hidden_size} top-{top_k}".format(**shape)
        print(f"| {label} | {fast} | {custom} | {y} | {fast - y} | {custom - (fast - y):+d} "
              f"| {at['phase']} {at['role']} ({at['node']}) | {at['y_live_bytes']} "
              f"| {custom <= fast - at['y_live_bytes']} |")


if __name__ == "__main__":
    print_table()
