"""Do solves return within their time limit? A table of wall time against ``time_limit_s``.

For each model of the zoo (:mod:`examples.zoo`, default configs) and each budget (a fraction of the
no-recompute peak, and one byte, which is infeasible and so also times the search that names the
smallest feasible budget), the model is traced once and ``solve(cg, budget, "cpsat",
time_limit_s=T)`` is timed::

    python -m benchmarks.time_limits --families gpt2,t5,llama --time-limit 5

Columns: wall seconds of the solve call, its excess over the limit, and the outcome (plan status,
or the infeasible error's smallest budget and whether it is proven).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    import remat_compiler as rc
    from remat_compiler.examples.zoo import FAMILIES, build
    from remat_compiler.solvers import solve

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="gpt2,llama,t5,bert,resnet")
    parser.add_argument("--budgets", default="0.5,0.3,1B", help="fractions, or byte counts ending in B")
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = FAMILIES if args.families == "all" else args.families.split(",")
    print(f"time_limit_s = {args.time_limit}")
    print(f"{'model':10} {'budget':>8} {'wall s':>7} {'over s':>7}  outcome")
    worst = 0.0
    for name in names:
        model, inputs, _ = build(name)
        _, cg = rc.analyze(model, (), inputs)
        for b in args.budgets.split(","):
            budget = int(b[:-1]) if b.endswith("B") else float(b)
            t0 = time.perf_counter()
            try:
                plan = solve(cg, budget, "cpsat", time_limit_s=args.time_limit)
                outcome = f"{plan.status}, peak {plan.peak_bytes}"
            except rc.InfeasibleBudgetError as exc:
                proof = "proven" if exc.proven else "not proven"
                outcome = f"infeasible: smallest {exc.min_feasible_bytes} ({proof})"
            wall = time.perf_counter() - t0
            worst = max(worst, wall - args.time_limit)
            print(f"{name:10} {b:>8} {wall:7.2f} {wall - args.time_limit:+7.2f}  {outcome}", flush=True)
    print(f"largest excess over the limit: {worst:+.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
