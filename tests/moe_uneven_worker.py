"""Dropless expert parallelism (``MoELayer(splits="uneven")``) through the compiler, on one rank of a
gloo job: the checks :func:`uneven_checks` runs inside ``moe_compile_worker.run_rank`` (so the test
pays for no extra spawn), and the helpers tests/test_moe_compile.py uses to check them.

Every rank seeds torch alike and builds the same :class:`MoEStack` with ``splits="uneven"`` (keeping
its expert shards) and its loss ``(out ** 2).mean()`` inside, one for each entry of :data:`COMPILED`. The
routers are biased (:data:`ROUTER_BIAS`) so that the input's first feature steers tokens to the low
experts, which live on rank 0. :data:`ROUTINGS` are three inputs of the same shape: as drawn, shifted
(most tokens to rank 0's experts), and set so that every token of every rank picks experts 0 and 1,
each of which then receives ``world * T`` rows: exactly the capacity of layers built with
``capacity_factor = E / top_k``, more than layers built with less hold. Each compiled module is traced
and planned once, for the capacity bound, and stepped on every routing.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import remat_compiler
from helpers import token_peaks, token_step
from remat_compiler.errors import ExpertCapacityError
from remat_compiler.moe import MoEStack

__all__ = ["CONFIG", "ROUTINGS", "COMPILED", "make_model", "make_tokens", "uneven_checks",
           "single_process_reference"]

# 8 experts, top-2, 64 tokens a rank, float64. capacity_factor E / top_k makes C = T: each expert holds
# world * T rows and no routing overflows. SMALL_FACTOR (C = 7T / 8) holds the random and skewed
# routings (at most 73 % of world * T rows to one expert) but not one_rank (all of them).
CONFIG = dict(hidden_size=32, ffn_hidden_size=48, num_experts=8, top_k=2, tokens=64)
FULL_FACTOR = CONFIG["num_experts"] / CONFIG["top_k"]
SMALL_FACTOR = FULL_FACTOR * 7 / 8
ROUTER_BIAS = (3.0, 2.0, 1.0, 0.0, -1.0, -1.0, -1.0, -1.0)  # router weight on feature 0, by expert
ROUTINGS = {"random": None, "skewed": 0.75, "one_rank": 10.0}  # feature 0: as drawn, shifted, set
# What is compiled: name -> (model: make_model's arguments, compile's arguments); budgets are fractions
# of the no-recompute peak. "cpsat" is the default solver, which chooses each layer's combine on rank 0.
# CP-SAT on two layers too small for the one_rank routing, which must raise;
# moe_origin (its budget checked, not optimised for: one layer's peak is in its backward) with the fused
# combine, on one layer that one_rank fills exactly: it recomputes the dispatch in backward, the counts'
# all-gather, the route and the uneven all-to-all, and the fused backward runs three more of them.
COMPILED = {
    "cpsat": (dict(num_layers=2, combine="autograd", capacity_factor=SMALL_FACTOR),
              dict(solver="cpsat", memory_budget=0.7, time_limit_s=2, num_workers=1)),
    "origin_fused": (dict(num_layers=1, combine="fused", capacity_factor=FULL_FACTOR),
                     dict(solver="moe_origin", memory_budget=1.0)),
}
MEASURED_STEPS = 3  # the median of three is the prediction even if one step meets the gloo lag


def make_model(group=None, num_layers=2, splits="uneven", combine="autograd", capacity_factor=FULL_FACTOR):
    """The stack with its loss inside (float64, seed 0), every router biased by :data:`ROUTER_BIAS`."""
    from moe_compile_worker import MeanSquare  # here: moe_compile_worker imports this module

    torch.manual_seed(0)
    cfg = CONFIG
    stack = MoEStack(num_layers, cfg["hidden_size"], cfg["ffn_hidden_size"], cfg["num_experts"],
                     cfg["top_k"], group=group, capacity_factor=capacity_factor, combine=combine,
                     splits=splits)
    with torch.no_grad():
        for layer in stack.layers:
            layer.router.linear.weight[:, 0] = torch.tensor(ROUTER_BIAS)
    return MeanSquare(stack).double()


def make_tokens(routing: str, world: int = 1, rank: int | None = 0) -> torch.Tensor:
    """Rank ``rank``'s ``[T, H]`` rows of one global batch steered by :data:`ROUTINGS` (None: all rows)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * CONFIG["tokens"], CONFIG["hidden_size"], generator=gen, dtype=torch.float64)
    shift = ROUTINGS[routing]
    if routing == "one_rank":
        x[:, 0] = shift
    elif shift is not None:
        x[:, 0] += shift
    if rank is None:
        return x
    return x[rank * CONFIG["tokens"]:(rank + 1) * CONFIG["tokens"]].clone()


def _rows_sent(model, x, world: int) -> list[int]:
    """Rows these tokens send to each rank's experts in the first layer (its router run alone)."""
    with torch.no_grad():
        experts = model.inner.layers[0].router(x)[1]
    local = CONFIG["num_experts"] // world
    return torch.bincount(experts.reshape(-1) // local, minlength=world).tolist()


def uneven_checks(group, world: int, rank: int) -> dict:
    """Compile each of :data:`COMPILED` once; step every routing compiled and eagerly; gather the plans.

    Returns
    -------
    dict
        ``eager[name][routing]`` (the same model uncompiled) and ``compiled[name][routing]``: loss and
        gradients, or the message of the :class:`ExpertCapacityError` the step raised;
        ``peaks[name][routing]``: measured step peaks (absent where it raised); ``after_overflow``:
        a random-routing step of each compiled module after the routings; ``plans[name]``:
        ``(digest, json)`` of every rank (all-gathered); ``predicted`` / ``budget``: the plans'
        figures; ``sent_to[routing]``: rows this rank sends to each rank's experts in layer 0;
        ``seconds``: wall time of the whole check.
    """
    t0 = time.perf_counter()
    out = {key: {} for key in ("eager", "compiled", "peaks", "plans", "predicted", "budget", "sent_to",
                               "after_overflow")}
    for name, (spec, options) in COMPILED.items():
        model = make_model(group, **spec)
        compiled = remat_compiler.compile(make_model(group, **spec), **options)
        for routing in ROUTINGS:  # the first call traces and plans, once for every routing
            x = make_tokens(routing, world, rank)
            out["sent_to"][routing] = _rows_sent(model, x, world)
            out["eager"].setdefault(name, {})[routing] = _step_or_error(model, x)
            got = out["compiled"].setdefault(name, {})[routing] = _step_or_error(compiled, x)
            if not isinstance(got, str):
                out["peaks"].setdefault(name, {})[routing] = token_peaks(compiled, x, MEASURED_STEPS)
        out["after_overflow"][name] = token_step(compiled, make_tokens("random", world, rank))
        plans = [None] * world
        dist.all_gather_object(plans, (compiled.plan.digest(), compiled.plan.to_json()))
        out["plans"][name] = plans
        out["predicted"][name], out["budget"][name] = compiled.plan.peak_bytes, compiled.plan.budget_bytes
    out["seconds"] = time.perf_counter() - t0
    return out


def _step_or_error(model, x):
    try:
        return token_step(model, x)
    except ExpertCapacityError as exc:
        return str(exc)


def single_process_reference(world: int, routing: str, num_layers: int) -> dict:
    """What each rank's step must give, from one process holding every expert and every rank's tokens.

    The model is the same stack with equal splits and no group, dropless (``capacity_factor = E /
    top_k``), and its loss the sum of the ranks' losses. Returns ``{"loss": [per rank], "x": [per
    rank], name: gradient}``: a rank's W1 / W2 gradients are its slice of the experts, its router's
    gradients (replicated parameter) sum over the ranks to this one.
    """
    model = make_model(None, num_layers, splits="equal", capacity_factor=FULL_FACTOR)
    x = make_tokens(routing, world, None).requires_grad_(True)
    out = model.inner(x).view(world, CONFIG["tokens"], -1)
    losses = out.pow(2).mean((1, 2))
    losses.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss": list(losses.detach()), "x": list(x.grad.view(world, CONFIG["tokens"], -1)), **grads}
