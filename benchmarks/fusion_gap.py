"""The Inductor backend against ``torch.compile`` at the peak ``torch.compile`` reaches, on one device
(issue 35's FLOP target against FSDP2 + ``torch.compile`` every layer, without the sharding): the test
Llama of ``benchmarks.fsdp_peers`` (hidden 128, 4 layers, batch 2 x 256) or the gpt2 workload of
``benchmarks.workloads`` (``--workload gpt2``), each layer compiled as torchtitan compiles it, at
``activation_memory_budget`` 0.5 and 0.3; then ``compile(..., backend="inductor", hold_outputs=False)``
at each measured peak, with every try of its first call: the plan's own peak (on the backend's view of
the graph, :func:`remat_compiler.fusion.inductor_view`), the walk of Inductor's code for it and where
that peaks, and what the accepted plan recomputes.

    python -m benchmarks.fusion_gap
    python -m benchmarks.fusion_gap --workload gpt2 --budgets 0.5

Peaks are the allocator's (:class:`remat_compiler.memory.AllocatorPeak`), one step after two warm
ones; the peer's recomputed FLOPs are counted on the twin of ``benchmarks.fsdp_peers`` (its
partitioner's graphs run op by op), ours are the plan's. FLOPs and bytes are exact; one torch thread.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch

__all__ = ["main"]


def _ids():
    from benchmarks.fsdp_peers import BATCH, SEQ, SIZES

    return torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _llama(backend=None):
    """The test Llama of ``benchmarks.fsdp_peers`` and its batch, each layer compiled with ``backend``."""
    import transformers

    from benchmarks.fsdp_peers import SIZES

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    ids = _ids()
    return _compiled(model, model.model.layers, backend), dict(input_ids=ids, labels=ids)


def _gpt2(backend=None):
    """The gpt2 workload of :mod:`benchmarks.workloads` and its batch, each block compiled with ``backend``."""
    from benchmarks.workloads import build_gpt2

    model, _, inputs = build_gpt2(False)
    return _compiled(model, model.transformer.h, backend), inputs


def _compiled(model, layers, backend):
    if backend is not None:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=backend)
    return model


WORKLOADS = {"llama": _llama, "gpt2": _gpt2}


def _step(model, inputs) -> None:
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def _peak(model, inputs) -> int:
    from remat_compiler.memory import AllocatorPeak

    _step(model, inputs)
    _step(model, inputs)
    model.zero_grad(set_to_none=True)
    with AllocatorPeak() as meter:
        model(**inputs).loss.backward()
    return meter.peak_bytes


def peer(build, budget: float) -> dict:
    """``torch.compile`` every layer at ``activation_memory_budget=budget``: its peak and recomputed FLOPs."""
    from benchmarks.fsdp_peers import recomputed_by_compile

    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget):
        peak = _peak(*build("inductor"))
    flops = recomputed_by_compile(lambda backend: functools.partial(_step, *build(backend)), budget)
    return {"peak": peak, "recompute_flops": flops}


def ours(build, budget_bytes: int, time_limit_s: float) -> dict:
    """The Inductor backend's first call at ``budget_bytes``: each try's plan peak and walk, the plan
    accepted, what it recomputes and its measured peak."""
    import remat_compiler as rc
    import remat_compiler.inductor.graph as graph
    from benchmarks.fsdp_peers import walked_peaks
    from remat_compiler.memory import AllocatorPeak

    plans, over = [], graph.CompiledOverBudget.__init__

    def overshot(self, peak, limit_bytes, plan_peak_bytes):
        plans.append(plan_peak_bytes)
        over(self, peak, limit_bytes, plan_peak_bytes)
    graph.CompiledOverBudget.__init__ = overshot
    try:
        with walked_peaks() as walks:
            model, inputs = build()
            m = rc.compile(model, memory_budget=budget_bytes, backend="inductor", hold_outputs=False,
                           time_limit_s=time_limit_s)
            m(**inputs).loss.backward()
    finally:
        graph.CompiledOverBudget.__init__ = over
    plans.append(m.plan.peak_bytes)
    tries = [{"walk": w.peak_bytes, "at": w.peak_node, "plan": plan} for w, plan in zip(walks, plans)]
    model.zero_grad(set_to_none=True)
    with AllocatorPeak() as meter:
        m(**inputs).loss.backward()
    return {"tries": tries, "recompute_flops": m.plan.recompute_flops, "measured": meter.peak_bytes,
            "runs_as": m.planned.backend}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="0.5,0.3", help="torch.compile's activation_memory_budget points")
    parser.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per solve")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    build = WORKLOADS[args.workload]
    print("| peer budget | peer peak | peer recomputed | try | our plan's peak | walk of its code (at) | "
          "ours recomputed | ours measured |")
    print("|---|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        p = peer(build, budget)
        o = ours(build, p["peak"], args.time_limit)
        for i, t in enumerate(o["tries"]):
            last = i == len(o["tries"]) - 1
            accepted = (f"{o['recompute_flops'] / 1e9:.3f} G | {o['measured']:,} ({o['runs_as']})" if last
                        else "- | -")
            print(f"| {budget} | {p['peak']:,} | {p['recompute_flops'] / 1e9:.3f} G | {i + 1} | {t.get('plan', 0):,} | "
                  f"{t['walk']:,} ({t['at']}) | {accepted} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
