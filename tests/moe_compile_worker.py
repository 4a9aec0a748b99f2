"""Shared helpers of tests/test_moe_compile.py, and the rank entry point its gloo tests spawn.

Every rank seeds torch alike, builds the same :class:`MoEStack` (keeping its expert shards), takes
its rows of one global token batch, runs the step eagerly, then compiles a fresh copy with each
strategy and runs it once. It saves eager and compiled outputs and gradients, each plan's digest
(and every rank's digests, all-gathered), the plans' communication figures, the roles of the
all-to-all nodes, (on 2 ranks) the recompute time of ``moe_origin`` under two link bandwidths, and
the measured peaks of several steps of a CP-SAT plan with the loss inside the compiled module (both
CP-SAT compiles are the default solver's, which chooses each expert-parallel layer's combine on rank
0: each plan's combines and why are saved too), (on 2 ranks) the collectives of both combines'
backward pieces as the choice aligns them (:func:`union_collectives`), and
the dropless checks of :func:`moe_uneven_worker.uneven_checks` (uneven splits, in the same job so
that they pay for no spawn of their own), and (on 2 ranks) the combine choice of a stack without an
expert-parallel group (:func:`choice_on_ranks`), the bare layer's checks against one process
(:func:`moe_dist_worker.layer_checks`, for tests/test_moe_layer.py's concerns) and (on 2 ranks)
moe_custom's peak against moe_fast's (:func:`moe_peak_worker.run_shape` on its ``RANK_SHAPES``), and
(on 2 ranks) the stack under ``backend="inductor"`` (:func:`inductor_on_ranks`), to
``out_dir/rank{r}.pt``. One job per world size: each spawn of gloo ranks costs seconds of start-up.
"""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch._functorch.partitioners
import torch.distributed as dist
import torch.nn as nn

import remat_compiler
import remat_compiler.api
import remat_compiler.codegen
import remat_compiler.collectives
from remat_compiler.passes import CostModel
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.moe import MoEStack

import moe_dist_worker
import moe_uneven_worker
from helpers import token_peaks, token_step

__all__ = ["CONFIG", "STRATEGIES", "make_model", "make_batch", "compile_strategies",
           "plan_figures", "combines", "union_collectives", "all_to_all_roles", "origin_cost_per_link", "run_rank"]

# two residual MoE layers; capacity_factor 2.0 = E / top_k: nothing is dropped
CONFIG = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_experts=4, top_k=2, tokens=32)
STRATEGIES = ("save_all", "moe_origin", "moe_fast", "moe_custom")
FOUR_RANK_STRATEGIES = ("moe_origin", "moe_fast")
CPSAT_OPTIONS = dict(time_limit_s=10, num_workers=1)
TIMEOUT_S = 120
SLOW_LINK, FAST_LINK = 1.0e6, 1.0e9  # bytes/s, for the communication-cost check


def make_model(group=None, num_layers: int = CONFIG["num_layers"]) -> MoEStack:
    """The test stack in float64, built from seed 0 (each rank keeps its experts of the same stack)."""
    torch.manual_seed(0)
    cfg = CONFIG
    model = MoEStack(num_layers, cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["num_experts"],
                     cfg["top_k"], group=group)
    return model.double()


def make_batch(world: int = 1, rank: int = 0):
    """This rank's tokens ``x`` and upstream gradient ``g`` (``[tokens, hidden]``, float64)."""
    gen = torch.Generator().manual_seed(1)
    shape = (world * CONFIG["tokens"], CONFIG["hidden_size"])
    x, g = torch.randn(shape, generator=gen, dtype=torch.float64), torch.randn(shape, generator=gen,
                                                                                dtype=torch.float64)
    rows = slice(rank * CONFIG["tokens"], (rank + 1) * CONFIG["tokens"])
    return x[rows].clone(), g[rows].clone()


def compile_strategies(group, x, g, strategies=STRATEGIES) -> dict:
    """Compile a fresh stack with each strategy (moe_origin and moe_fast among them) and CP-SAT between
    origin's and fast's peaks; run once.

    Returns ``{name: (compiled module, step results)}``; the CP-SAT entry is ``"cpsat"``. A step's
    results (:func:`helpers.token_step`): ``out``, ``x``, and each parameter's gradient
    (``layers.0.router.linear.weight`` is the router, whose gradient flows only through the
    probabilities; ``gemm1``/``gemm2.weight`` are W1/W2).
    """
    results = {}
    for name in strategies:
        compiled = remat_compiler.compile(make_model(group), solver=name)
        results[name] = (compiled, token_step(compiled, x, g))
    budget = (results["moe_origin"][0].plan.peak_bytes + results["moe_fast"][0].plan.peak_bytes) // 2
    compiled = remat_compiler.compile(make_model(group), memory_budget=budget, solver="cpsat",
                                      **CPSAT_OPTIONS)
    results["cpsat"] = (compiled, token_step(compiled, x, g))
    return results


def plan_figures(module) -> dict:
    """A compiled module's plan in numbers: communication, saved and peak bytes, budget; and each
    MoE segment's combine as the plan records it and as this rank's graph traced it."""
    cg, plan = module.planned.cg, module.plan
    return {"recompute_comm_bytes": plan.recompute_comm_bytes, "saved_bytes": plan.saved_bytes,
            "fw_comm_bytes": sum(cg.attr(n, "comm_bytes") for n in cg.fw_order),
            "peak_bytes": plan.peak_bytes, "budget_bytes": plan.budget_bytes,
            "combine": combines(module)}


def combines(module) -> dict:
    """``{segment: (mode, why, mode as this rank traced it)}`` of a compiled module's plan."""
    from remat_compiler.plan import moe_combine_of

    traced = moe_combine_of(module.planned.cg)
    return {seg: (c["mode"], c.get("why", ""), traced[seg]["mode"])
            for seg, c in module.plan.extras.get("moe_combine", {}).items()}


def all_to_all_roles(cg) -> dict:
    """``{(phase, role): count}`` of the all-to-all nodes of a CostGraph."""
    counts: dict = {}
    for n in cg.order:
        if "all_to_all_single" in cg.attr(n, "op"):
            key = (cg.attr(n, "phase"), cg.attr(n, "moe")["role"])
            counts[key] = counts.get(key, 0) + 1
    return counts


def origin_cost_per_link(group, x) -> dict:
    """``{link bytes/s: (recompute_s, recompute_comm_bytes)}`` of ``moe_origin`` at two link speeds."""
    out = {}
    for speed in (SLOW_LINK, FAST_LINK):
        planned = remat_compiler.plan_model(make_model(group), (x.detach().clone().requires_grad_(True),),
                                            solver="moe_origin", cost_model=CostModel(link_bytes_per_s=speed))
        out[speed] = (planned.plan.recompute_s, planned.plan.recompute_comm_bytes)
    return out


class MeanSquare(nn.Module):
    """The stack with its loss inside, so the whole step is planned."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).pow(2).mean()


def inductor_on_ranks(group, x) -> dict:
    """A one-layer stack with its loss inside under ``backend="inductor"`` (the all-to-alls and their
    releases run in Inductor's code; one layer: Inductor's compile time grows with the graph): this
    rank's gradients and eager's, what it runs as, the budget, the walk of Inductor's code, the
    measured peak of a second step with Inductor's buffers watched, the first step's own check, and
    the warnings of the whole run."""
    model = MeanSquare(make_model(group, num_layers=1))
    eager = token_step(MeanSquare(make_model(group, num_layers=1)), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = remat_compiler.compile(model, memory_budget=0.9, backend="inductor", time_limit_s=1,
                                          num_workers=1)
        grads = token_step(compiled, x)  # traces, plans and compiles
        _, measured = token_step(compiled, x, inductor=compiled, measure=True)
    planned = compiled.planned
    return {"eager": eager, "grads": grads, "runs as": planned.backend, "budget": compiled.plan.budget_bytes,
            "walked": planned.compiled.peak_bytes if planned.compiled else None, "measured": measured,
            "first step": planned.first_step_bytes, "warnings": [str(w.message) for w in caught]}


def choice_on_ranks(x, g) -> dict:
    """The default compile of a stack without an expert-parallel group on every rank: rank 0 chooses
    each layer's combine and broadcasts it, every rank traces those combines and runs rank 0's plan.
    Its modes (recorded, and as this rank's graph traced them), the plan's digest and source, this
    rank's eager and compiled steps, and the measured and predicted peaks."""
    from remat_compiler.plan import moe_combine_of

    compiled = remat_compiler.compile(make_model(None), memory_budget=0.8, time_limit_s=2, num_workers=1)
    got = token_step(compiled, x, g)  # traces, chooses and plans
    with LiveStorageTracker() as mem:
        token_step(compiled, x, g)
    plan = compiled.plan
    return {"modes": {seg: c["mode"] for seg, c in plan.extras["moe_combine"].items()},
            "why": {seg: c.get("why", "") for seg, c in plan.extras["moe_combine"].items()},
            "traced": {seg: c["mode"] for seg, c in moe_combine_of(compiled.planned.cg).items()},
            "digest": plan.digest(), "source": compiled.planned.source, "compiled": got,
            "eager": token_step(make_model(None), x, g), "peak": mem.peak_bytes, "predicted": plan.peak_bytes,
            "budget": plan.budget_bytes}


def union_collectives(model, x) -> dict:
    """The collectives of the two combines' graphs of ``model`` as :func:`align_combines` pairs
    them: per segment and mode, its backward piece's ``(op, comm_bytes)`` and what the choice model
    charges for them (:func:`piece_comm_units`); the shared backward's collectives, in order, as
    ``(op, comm_bytes)`` pairs of the autograd and fused graphs."""
    from remat_compiler.api import analyze
    from remat_compiler.moe.segments import segment_combines, why_not_choosable
    from remat_compiler.solvers.combine_choice import align_combines
    from remat_compiler.solvers.cpsat.choice import piece_comm_units

    x = x.detach().clone().requires_grad_(True)
    graphs = {}
    for mode in ("autograd", "fused"):
        with segment_combines(model, {seg: mode for seg in why_not_choosable(model)}):
            graphs[mode] = analyze(model, (x,))[1]
    union = align_combines(graphs["autograd"], graphs["fused"])

    def comm(cg, n):
        return (cg.attr(n, "op"), cg.attr(n, "comm_bytes"))
    pieces = {seg: {mode: [comm(union.graphs[mode], n) for n in piece.nodes
                           if union.graphs[mode].attr(n, "comm_bytes") > 0] for mode, piece in both.items()}
              for seg, both in union.pieces.items()}
    shared = [(comm(graphs["autograd"], a), comm(graphs["fused"], f)) for a, f in union.shared
              if graphs["autograd"].attr(a, "comm_bytes") > 0 or graphs["fused"].attr(f, "comm_bytes") > 0]
    return {"pieces": pieces, "units": piece_comm_units(union), "shared": shared}


def measured_against_plan(group, x, steps: int = 6) -> dict:
    """A CP-SAT plan of the stack with its loss: measured peak of several steps, the predicted peak,
    and whether every collective's wait in the emitted graphs is followed by the release of its inputs
    and result."""
    model = MeanSquare(make_model(group))
    # any plan under the budget will do (its measured peak is checked against its prediction)
    compiled = remat_compiler.compile(model, memory_budget=0.8, solver="cpsat", time_limit_s=2, num_workers=1)
    peaks = token_peaks(compiled, x, steps + 1)  # the first call traces and plans
    fw, bw = remat_compiler.codegen.emit(compiled.planned.gm, compiled.plan)
    waits = [n for gm in (fw, bw) for n in gm.graph.nodes
             if getattr(n.target, "__name__", "").startswith("wait_tensor")]
    # each wait is followed by the release of its collective's inputs and of the result it waited for
    released = [n.next.target is remat_compiler.collectives.release_collective_inputs and n in n.next.args
                for n in waits]
    return {"peaks": peaks[1:], "predicted": compiled.plan.peak_bytes, "waits": len(waits),
            "released": all(released), "budget": compiled.plan.budget_bytes, "combine": combines(compiled)}


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """Eager step, every strategy compiled and run, plan digests gathered, and the other files'
    expert-parallel checks (tests/test_moe_compile.py runs their tests); saved for the parent."""
    import moe_peak_worker  # here: it imports this module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        group = dist.group.WORLD
        x, g = make_batch(world, rank)
        eager = token_step(make_model(group), x, g)
        # 4 ranks (the suite's time is bounded): the two strategies CP-SAT's budget lies between, and
        # CP-SAT; save_all and moe_custom run on 2
        compiled = compile_strategies(group, x, g, STRATEGIES if world == 2 else FOUR_RANK_STRATEGIES)
        gathered = [None] * world
        dist.all_gather_object(gathered, {name: c.plan.digest() for name, (c, _) in compiled.items()})
        torch.save({"eager": eager,
                    "compiled": {name: result for name, (_, result) in compiled.items()},
                    "digests": gathered,
                    "plans": {name: plan_figures(c) for name, (c, _) in compiled.items()},
                    "a2a_roles": all_to_all_roles(compiled["moe_fast"][0].planned.cg),
                    "link": origin_cost_per_link(group, x) if world == 2 else {},
                    "measured": measured_against_plan(group, x),
                    "uneven": moe_uneven_worker.uneven_checks(group, world, rank),
                    "choice": choice_on_ranks(x, g) if world == 2 else None,
                    "inductor": inductor_on_ranks(group, x) if world == 2 else None,
                    "layer": moe_dist_worker.layer_checks(group, world, rank),
                    "custom_peak": [moe_peak_worker.run_shape(shape, group, world, rank)
                                    for shape in moe_peak_worker.RANK_SHAPES] if world == 2 else None,
                    "union": {"equal": union_collectives(make_model(group), x),
                              "uneven": union_collectives(moe_uneven_worker.make_model(group),
                                                          moe_uneven_worker.make_tokens("skewed", world, rank))}
                    if world == 2 else None},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
