"""The expert-parallel checks of the bare MoE layer, run on each rank of the gloo jobs that
``moe_compile_worker.run_rank`` spawns for tests/test_moe_compile.py (one job per world size pays
for one spawn), and the tracing helpers tests/test_moe_layer.py uses.

Every rank seeds torch identically, builds the same full layer and keeps its expert shard, takes
its slice of one global token batch, runs forward and backward for both combine modes, and returns
outputs and gradients for the parent to compare against a single-process layer run on all tokens.
"""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function

from remat_compiler.moe import MoELayer

__all__ = ["CONFIG", "make_layer", "make_batch", "trace_step", "count_all_to_all", "run_layer", "single_process",
           "layer_checks"]

CONFIG = dict(hidden_size=8, ffn_hidden_size=6, num_experts=8, top_k=2, tokens_per_rank=6)


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


def run_layer(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Forward + backward from ``x`` with upstream gradient ``g``: ``{out, x, router, w1, w2}``, the
    output and the gradients of the input and of every parameter."""
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    out.backward(g)
    return {"out": out.detach(), "x": x.grad, "router": layer.router.linear.weight.grad,
            "w1": layer.gemm1.weight.grad, "w2": layer.gemm2.weight.grad}


def single_process(combine: str, world: int) -> dict:
    """What the ranks must give together: the layer on one process, holding every expert, run on all
    ranks' tokens (:func:`run_layer`)."""
    return run_layer(make_layer(None, combine), *make_batch(world))


def layer_checks(group, world: int, rank: int) -> dict:
    """Both combine modes on this rank's tokens, run eagerly and traced, and whether a layer whose
    experts do not divide over the ranks is refused: ``{combine: {out, x, router, w1, w2, traced,
    a2a_nodes}, "indivisible_raised": bool}``. Runs inside ``moe_compile_worker.run_rank``'s job."""
    x_all, g_all = make_batch(world)
    rows = slice(rank * CONFIG["tokens_per_rank"], (rank + 1) * CONFIG["tokens_per_rank"])
    results = {}
    for combine in ("autograd", "fused"):
        x, g = x_all[rows], g_all[rows]
        results[combine] = run_layer(make_layer(group, combine), x, g)
        traced_out, traced_grads, graphs = trace_step(make_layer(group, combine), x, g)
        results[combine]["traced"] = {"out": traced_out, **traced_grads}
        results[combine]["a2a_nodes"] = {k: count_all_to_all(gm) for k, gm in graphs.items()}
    try:
        MoELayer(8, 6, num_experts=2 * world + 1, top_k=2, group=group)
        results["indivisible_raised"] = False
    except ValueError:
        results["indivisible_raised"] = True
    return results
