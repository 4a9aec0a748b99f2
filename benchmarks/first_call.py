"""The eager backend's first call against torch.compile's (issue 36, item 3): how long the first step
of ``remat_compiler.compile`` takes on the benchmark GPT-2, split into the compiler's parts, and the
plan's FLOPs against a longer solve's.

Two rows of remat_compiler: ``compile``'s defaults (its ``tolerance``, 1% of the step, and the
default time limit), then the reference, ``tolerance=0`` with the ``--long`` limit. Each: a fresh
copy of the model, compiled at ``--budget`` (a fraction of the no-recompute peak), one step timed
from the call to the end of backward; the parts are ``CompiledModule.planned.timings`` (annotate: passes and costing; solve;
check; emit; check emitted), the rest of the call is AOTAutograd's trace and the step itself. Then
``torch.compile`` of another copy, its first step timed the same way.

    python -m benchmarks.first_call                 # full size, about 2.5 minutes on 2 cores
    python -m benchmarks.first_call --quick --long 5
    python -m benchmarks.first_call --workload mixtral --backend inductor
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

from remat_compiler.workload import compute_loss

__all__ = ["first_call", "main"]


def first_call(model, args, kwargs, **compile_options) -> dict:
    """One compiled step of a copy of ``model`` from the call to the end of backward, with its parts."""
    import remat_compiler as rc

    net = copy.deepcopy(model)
    compiled = rc.compile(net, **compile_options)
    t0 = time.perf_counter()
    compute_loss(None, compiled(*args, **kwargs)).backward()
    total = time.perf_counter() - t0
    plan = compiled.plan
    return {"total_s": total, "parts": dict(compiled.planned.timings), "status": plan.status, "gap": plan.gap,
            "recompute_flops": plan.recompute_flops, "peak": plan.peak_bytes, "budget": plan.budget_bytes}


def main(argv=None) -> int:
    from benchmarks.workloads import WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_call", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=0.5, help="fraction of the no-recompute peak (0.5)")
    parser.add_argument("--long", type=float, default=60.0, help="the longer solve's time limit, s (60)")
    parser.add_argument("--quick", action="store_true", help="the workload's quick shape")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2", help="gpt2 (default)")
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager", help="eager (default)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, args, kwargs = WORKLOADS[opts.workload].build(quick=opts.quick)
    print(f"{WORKLOADS[opts.workload].description(opts.quick)}{' (--quick)' if opts.quick else ''}, backend={opts.backend!r}, "
          f"budget {opts.budget:g} of the no-recompute peak, torch {torch.__version__}, 1 torch thread.\n")
    print("| first call | total | trace, step (and Inductor) | annotate | solve | emit and checks | status (gap) "
          "| recompute FLOPs | peak / budget | other parts |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = (("remat_compiler, compile's defaults", {}),
            (f"remat_compiler, tolerance=0, {opts.long:g} s", {"time_limit_s": opts.long, "tolerance": 0}))
    for label, options in rows:
        r = first_call(model, args, kwargs, memory_budget=opts.budget, backend=opts.backend, **options)
        p = r["parts"]
        named = ("annotate", "solve", "emit", "check", "check emitted")
        rest = p.get("emit", 0) + p.get("check", 0) + p.get("check emitted", 0)
        other = ", ".join(f"{k} {v:.1f} s" for k, v in p.items() if k not in named)
        print(f"| {label} | {r['total_s']:.1f} s | {r['total_s'] - sum(p.values()):.1f} s | "
              f"{p.get('annotate', 0):.2f} s | {p.get('solve', 0):.1f} s | {rest:.2f} s | "
              f"{r['status']} ({r['gap']:.2%}) | {r['recompute_flops']:,} | {r['peak']:,} / {r['budget']:,} | "
              f"{other} |",
              flush=True)
    net = copy.deepcopy(model)
    t0 = time.perf_counter()
    compute_loss(None, torch.compile(net)(*args, **kwargs)).backward()
    print(f"| torch.compile | {time.perf_counter() - t0:.1f} s |  |  |  |  |  |  |  |  |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
