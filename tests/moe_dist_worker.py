"""Rank entry point for the expert-parallel MoE tests (spawned by tests/test_moe_layer.py).

Every rank seeds torch identically, builds the same full layer and keeps its expert shard, takes
its slice of one global token batch, runs forward and backward for both combine modes, and saves
outputs and gradients to ``out_dir/rank{r}.pt`` for the parent to compare against a
single-process layer run on all tokens.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function

from remat_compiler.moe import MoELayer

__all__ = ["CONFIG", "make_layer", "make_batch", "trace_step", "count_all_to_all", "run_rank"]

CONFIG = dict(hidden_size=8, ffn_hidden_size=6, num_experts=8, top_k=2, tokens_per_rank=6)
TIMEOUT_S = 60


def make_layer(group, combine: str) -> MoELayer:
    """The test layer in float64; capacity_factor = E / top_k so no token is ever dropped."""
    torch.manual_seed(0)
    cfg = CONFIG
    layer = MoELayer(
        cfg["hidden_size"],
        cfg["ffn_hidden_size"],
        cfg["num_experts"],
        cfg["top_k"],
        group=group,
        capacity_factor=cfg["num_experts"] / cfg["top_k"],
        combine=combine,
    )
    return layer.double()


def make_batch(world: int):
    """Global tokens ``x`` and upstream gradient ``g``, both ``[world * T, H]`` float64."""
    gen = torch.Generator().manual_seed(1)
    shape = (world * CONFIG["tokens_per_rank"], CONFIG["hidden_size"])
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, g


def trace_step(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    """Trace forward+backward of ``layer`` with AOTAutograd (static shapes) and run it once.

    Returns
    -------
    (out, grads, graphs)
        ``out`` detached; ``grads`` maps "x" and each parameter name to its gradient; ``graphs``
        maps "fw" / "bw" to the captured forward / backward GraphModules.
    """
    names = [name for name, _ in layer.named_parameters()]
    graphs = {}

    def step(inp, *params):
        return torch.func.functional_call(layer, dict(zip(names, params)), (inp,))

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)

        return compiler

    compiled = aot_function(step, fw_compiler=keep("fw"), bw_compiler=keep("bw"))
    leaves = [x.detach().clone().requires_grad_(True)]
    leaves += [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    out = compiled(*leaves)
    out.backward(g)
    grads = {name: leaf.grad for name, leaf in zip(["x"] + names, leaves)}
    return out.detach(), grads, graphs


def count_all_to_all(gm) -> int:
    """Number of ``all_to_all_single`` call nodes in a traced GraphModule."""
    return sum(
        1 for n in gm.graph.nodes if n.op == "call_function" and "all_to_all_single" in str(n.target)
    )


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Run both combine modes on this rank's tokens and save the results."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        group = dist.group.WORLD
        x_all, g_all = make_batch(world)
        rows = slice(rank * CONFIG["tokens_per_rank"], (rank + 1) * CONFIG["tokens_per_rank"])
        results = {}
        for combine in ("autograd", "fused"):
            layer = make_layer(group, combine)
            x = x_all[rows].clone().requires_grad_(True)
            out = layer(x)
            out.backward(g_all[rows])
            results[combine] = {
                "out": out.detach(),
                "x": x.grad,
                "router": layer.router.linear.weight.grad,
                "w1": layer.gemm1.weight.grad,
                "w2": layer.gemm2.weight.grad,
            }
            traced_out, traced_grads, graphs = trace_step(make_layer(group, combine), x, g_all[rows])
            results[combine]["traced"] = {"out": traced_out, **traced_grads}
            results[combine]["a2a_nodes"] = {k: count_all_to_all(gm) for k, gm in graphs.items()}
        try:
            MoELayer(8, 6, num_experts=2 * world + 1, top_k=2, group=group)
            results["indivisible_raised"] = False
        except ValueError:
            results["indivisible_raised"] = True
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
