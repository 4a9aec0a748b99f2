"""Variants of the Inductor backend against torch.compile, timed in one process (issue 14's GPT-2
budget-1.0 point, the one where remat_compiler's step was long not below the peer's).

    python -m benchmarks.inductor_variants --rounds 11          # GPT-2 at 145.1 MiB, about 4 minutes

One fresh copy of the workload (same weights) per runner, each compiled on its first call:

- ``as built``: ``compile(model, budget, backend="inductor")``;
- ``joint passes``: the same, with Inductor's joint-graph passes (pattern rewrites, no-op removal;
  what ``torch.compile`` runs on the joint graph before its partitioner) run on the joint graph
  before it is planned, random ops left to eager's generator (``fallback_random``);
- ``no fused recompute``: the same, without :func:`remat_compiler.fusion.inductor_view` and
  :func:`remat_compiler.fusion.fusible_recompute` (the plan as CP-SAT makes it for the eager backend);
- ``unmerged index work``: the same, without :func:`remat_compiler.passes.merge_repeated_index_work` (the pass list
  as it was before session 16: GPT-2's mask is recomputed inside every layer's softmax kernel);
- ``unstored shared values``: the same, without :func:`remat_compiler.inductor.store_shared_values`
  (a pointwise value several layers read is computed again inside each layer's kernel, as before
  session 22); its gain shows where the plan saves such a value, e.g. ``--budget-bytes 71303168``;
- ``in plan order``: the same, every graph compiled without Inductor's horizontal fusion (one kernel
  for values of which neither reads the other; :func:`remat_compiler.inductor.compile.in_plan_order`),
  which the backend does only after code that walked above the budget;
- ``torch.compile``: Inductor with its own partitioner at ``activation_memory_budget``;
- with ``--above 2.5 5``: ``as built`` planned under the budget plus each of these MiB (the room the
  walk of Inductor's code leaves under the budget, given to the planner), marked where the walk of
  its code is above the budget itself.

Then all are stepped round-robin, every other round in reverse order (gradients reset before each
step, the loss alone held); each row gives the median step and the median over rounds of its step
over the peer's in the same round. The variants are made by swapping one step of the backend
(:mod:`remat_compiler.module`'s ``annotate_joint``, :mod:`remat_compiler.inductor.backend`'s ``fusing``,
:mod:`remat_compiler.inductor.compile`'s ``store_shared_values``), or the pass list, during the runner's
first call, so this is a
probe of the pipeline, not an option of it. Peaks are the walk of Inductor's code (= the backend's
first-step measure), not resident sets: see :mod:`benchmarks.inductor_peers` for those.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import remat_compiler
from benchmarks.measure import compute_loss
from benchmarks.strategies import pytorch_runner
from benchmarks.workloads import WORKLOADS

__all__ = ["VARIANTS", "variant", "main"]

#: torch.compile's measured step peak at activation_memory_budget 1.0 on the benchmark GPT-2
#: (RESULTS.md, "gpt2: the budget-1.0 point again", session 13): the budget remat_compiler gets there
GPT2_PEER_PEAK_BYTES = 152_166_400
VARIANTS = ("as built", "joint passes", "no fused recompute", "unmerged index work", "unstored shared values",
            "in plan order")


@contextlib.contextmanager
def variant(name: str):
    """The Inductor backend as ``name`` (one of :data:`VARIANTS`) while the block runs."""
    from torch._inductor import config
    from torch._inductor.compile_fx import _recursive_joint_graph_passes

    import remat_compiler.inductor.backend as backend
    import remat_compiler.inductor.compile as inductor_compile
    import remat_compiler.module as module
    from remat_compiler import passes

    annotate, fusing = module.annotate_joint, backend.fusing
    pass_list, store = passes.PASSES, inductor_compile.store_shared_values
    compile_graph = inductor_compile.compile_graph

    def with_joint_passes(joint, step):
        with config.patch(fallback_random=True):
            joint = _recursive_joint_graph_passes(joint, skip_invoke_subgraph=True,
                                                  input_device=torch.device("cpu"))
        return annotate(joint, step)

    if name == "joint passes":
        module.annotate_joint = with_joint_passes
    elif name == "no fused recompute":
        backend.fusing = lambda spec, memory=True: spec
    elif name == "unmerged index work":
        passes.PASSES = tuple(p for p in pass_list if p.run is not passes.merge_repeated_index_work)
    elif name == "unstored shared values":
        inductor_compile.store_shared_values = lambda gm: []
    elif name == "in plan order":
        inductor_compile.compile_graph = lambda *args, **kwargs: compile_graph(*args, **{**kwargs, "in_order": True})
    elif name != "as built":
        raise ValueError(f"unknown variant {name!r}; one of {', '.join(VARIANTS)}")
    try:
        yield
    finally:
        module.annotate_joint, backend.fusing, passes.PASSES = annotate, fusing, pass_list
        inductor_compile.store_shared_values, inductor_compile.compile_graph = store, compile_graph


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.inductor_variants",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="gpt2", choices=sorted(WORKLOADS))
    parser.add_argument("--budget-bytes", type=int, default=GPT2_PEER_PEAK_BYTES)
    parser.add_argument("--activation-budget", type=float, default=1.0, help="the torch.compile peer's")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--time-limit", type=float, default=25.0, help="CP-SAT seconds per solve")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which variants, comma-separated")
    parser.add_argument("--above", type=float, nargs="*", default=[],
                        help="also 'as built' planned under the budget plus each of these MiB")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = WORKLOADS[args.workload]
    model, call_args, call_kwargs = spec.build(False)
    state = model.state_dict()

    runners = {}
    chosen = [name for name in args.variants.split(",") if name]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; from {', '.join(VARIANTS)}")
    planned_under = {name: (name, args.budget_bytes) for name in chosen}  # runner -> (variant, budget)
    for mib in args.above:
        planned_under[f"as built, +{mib:g} MiB"] = ("as built", args.budget_bytes + round(mib * 2**20))
    for name, (_, budget) in planned_under.items():
        fresh = spec.build(False)[0]
        fresh.load_state_dict(state)
        runners[name] = (list(fresh.parameters()), remat_compiler.compile(
            fresh, budget, backend="inductor", hold_outputs=False, time_limit_s=args.time_limit))
    peer = pytorch_runner(spec, False, args.activation_budget, backend="inductor")
    runners["torch.compile"] = (peer.params, peer.module)

    def step(name: str) -> float:
        params, module = runners[name]
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        compute_loss(None, module(*call_args, **call_kwargs)).backward()
        return time.perf_counter() - t0

    compile_s = {}
    for name in runners:
        with variant(planned_under[name][0]) if name in planned_under else contextlib.nullcontext():
            compile_s[name] = step(name)
        step(name)
    times = {name: [] for name in runners}
    for k in range(args.rounds):  # every other round in reverse order, as benchmarks.measure.time_round_robin
        for name in (list(runners) if k % 2 == 0 else list(reversed(runners))):
            times[name].append(step(name))

    print(f"{args.workload}, budget {args.budget_bytes} bytes, torch.compile at activation_memory_budget "
          f"{args.activation_budget}, {args.rounds} rounds, {args.threads} torch threads\n")
    print("| runner | recomputed | fused recompute | plan peak (bytes) | walk = first step (bytes) | step (ms) "
          "| vs peer | first call (s) |")
    print("|---|---|---|---|---|---|---|---|")
    peer_times = times["torch.compile"]
    for name, (_, module) in runners.items():
        planned = getattr(module, "planned", None)
        if planned is None:
            cells = ["-", "-", "-", "-"]
        else:
            fused = len(planned.plan.extras.get("inductor_fused_recompute", []))
            walk = planned.compiled.peak_bytes if planned.compiled is not None else "-"
            first = planned.first_step_bytes
            cells = [str(len(planned.plan.recomputed)), str(fused), str(planned.plan.peak_bytes),
                     f"{walk}" if walk == first else f"{walk} / {first}"]
            if isinstance(walk, int) and walk > args.budget_bytes:
                cells[-1] += " (above the budget)"
        ratio = statistics.median(a / b for a, b in zip(times[name], peer_times))
        print(f"| {name} | {' | '.join(cells)} | {1000 * statistics.median(times[name]):.1f} | {ratio:.4f} "
              f"| {compile_s[name]:.1f} |")


if __name__ == "__main__":
    main()
