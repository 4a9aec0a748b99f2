"""How long the block decomposition takes on the benchmark GPT-2 as the Inductor backend traces it,
with the menu's staircases of cost over W solved lazily (bands of W, the default) and exactly (every
step, ``w_granule=1``)::

    python -m benchmarks.menu_check                     # 60.25 and 56.57 MiB, runtime objective, ~3 min
    python -m benchmarks.menu_check --mib 60 70 --objective flops

The graph is the one ``compile(model, budget, backend="inductor", hold_outputs=False)`` plans (a
3 s solve, then Inductor compiles it once: about a minute). Each way runs the budgets in order with
one kept menu, as one compile's re-plans do. Columns: the budget, the bound (cost units), whether
its choice of block plans came back, the menu's size, the staircase solves of cost over W so far
and the seconds of the call. The bound must be the same both ways (the stand-ins change the work,
not the bound); the first budget's seconds are what fits, or not, in compile's 25 s default (the
decomposition gets 88% of 85% of it).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    import remat_compiler as rc
    from benchmarks.workloads import WORKLOADS
    from remat_compiler.clock import Deadline
    from remat_compiler.solvers.cpsat import cost_units
    from remat_compiler.solvers.cpsat.blockbound import block_bound

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[60.25, 56.57], help="budgets, MiB")
    parser.add_argument("--objective", default="runtime", choices=["runtime", "flops"])
    parser.add_argument("--deadline", type=float, default=300.0, help="each call's deadline, s")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)

    model, call_args, call_kwargs = WORKLOADS["gpt2"].build(False)
    m = rc.compile(model, int(args.mib[0] * 2 ** 20), backend="inductor", hold_outputs=False, time_limit_s=3)
    m(*call_args, **call_kwargs).loss.backward()
    cg = m.planned.cg
    print(f"{WORKLOADS['gpt2'].description(False)}; traced for Inductor; objective {args.objective}")
    print(f"{'W bands':>8} {'MiB':>7} {'bound':>10} {'plan':>5} {'menu':>5} {'solves':>6} {'s':>6}")
    bounds = {}
    for label, w_granule in (("lazy", None), ("exact", 1)):
        menus = {}
        for mib in args.mib:
            t0 = time.perf_counter()
            found = block_bound(cg, int(mib * 2 ** 20), lambda n: cost_units(cg, n, args.objective),
                                deadline=Deadline(args.deadline), menus=menus, cost_key=args.objective,
                                w_granule=w_granule)
            seconds = time.perf_counter() - t0
            if found is None:
                print(f"{label:>8} {mib:7.2f} {'-':>10}   (no decomposition: blocks differ, or not proven in time)")
                continue
            bounds.setdefault(mib, set()).add(found.bound)
            print(f"{label:>8} {mib:7.2f} {found.bound:>10.0f} {'yes' if found.saved is not None else 'no':>5} "
                  f"{found.menu_size:>5} {found.solves:>6} {seconds:6.1f}", flush=True)
    same = all(len(b) == 1 for b in bounds.values())
    print("bounds " + ("agree" if same else "DIFFER") + " between lazy and exact bands of W")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
