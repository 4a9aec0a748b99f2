"""Issue 14's GPT-2 point at the checkpoint-every-block peak: how fast the Inductor backend's step is
for plans made with each objective and time limit, timed in one process against eager and against
the plan without recomputation::

    python -m benchmarks.plan_speed                                  # 60.25 MiB, runtime:25 flops:25 flops:120
    python -m benchmarks.plan_speed --mib 60.25 --plans runtime:25 runtime:120 --rounds 15

One fresh copy of the gpt2 workload (same weights) per runner: ``eager`` (op by op), ``no recompute``
(``compile(model, None, backend="inductor")``) and one per ``objective:seconds`` in ``--plans``
(``compile(model, budget, backend="inductor", objective=..., time_limit_s=...)``; ``hold_outputs=False``
as in :mod:`benchmarks.inductor_peers`). Each is stepped twice, then all are stepped round-robin,
every other round in reverse order; the ratio is the median over rounds of a runner's step over
eager's in the same round. The plans' GFLOPs and proven gaps are printed with them: CP-SAT searches
on the wall clock, so a plan made again may differ. Runners of the same plan differ by a few percent
between processes (see RESULTS.md, session 15); compare plans within one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch


def main(argv=None) -> int:
    import remat_compiler as rc
    from benchmarks.measure import Runner, round_ratio, run_step, time_round_robin
    from benchmarks.workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=60.25, help="the budget, MiB (default: checkpoint every "
                        "block's peak in session 18's inductor_peers run)")
    parser.add_argument("--plans", nargs="+", default=["runtime:25", "flops:25", "flops:120"],
                        help="objective:seconds of each plan")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    budget = int(args.mib * 2 ** 20)

    specs = [("eager", None), ("no recompute", (None, {}))]  # label, (budget, solver options)
    for item in args.plans:
        objective, _, seconds = item.partition(":")
        specs.append((item, (budget, {"objective": objective, "time_limit_s": float(seconds or 25)})))
    runners, rows = [], []
    for label, options in specs:
        model, call_args, call_kwargs = WORKLOADS["gpt2"].build(False)
        module = model
        if options is not None:
            module = rc.compile(model, options[0], backend="inductor", hold_outputs=False, **options[1])
        runner = Runner("remat_compiler" if options else "eager", label, module, list(model.parameters()))
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_step(runner, call_args, call_kwargs)
        first_s = time.perf_counter() - t0
        run_step(runner, call_args, call_kwargs)
        plan = getattr(module, "plan", None)
        rows.append((label, plan, first_s, getattr(module, "planned", None)))
        runners.append(runner)
    times = time_round_robin(runners, call_args, call_kwargs, args.rounds)
    print(f"{WORKLOADS['gpt2'].description(False)}; budget {args.mib} MiB; {args.rounds} rounds; "
          f"torch {torch.__version__}, 2 threads")
    print("| runner | recomputed GFLOP | gap | walk of Inductor's code (MiB) | runs as | first call (s) "
          "| step (ms) | step-time ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for (label, plan, first_s, planned), ts in zip(rows, times):
        walk = planned.compiled.peak_bytes / 2 ** 20 if planned is not None and planned.backend == "inductor" else None
        print(f"| {label} | {'-' if plan is None else f'{plan.recompute_flops / 1e9:.2f}'} "
              f"| {'-' if plan is None else f'{plan.gap:.3f}'} | {'-' if walk is None else f'{walk:.2f}'} "
              f"| {'-' if planned is None else planned.backend} | {first_s:.1f} "
              f"| {statistics.median(ts) * 1e3:.1f} | {round_ratio(ts, times[0]):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
