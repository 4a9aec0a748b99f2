"""The eager backend's first call against torch.compile's (issue 36, item 3): how long the first step
of ``remat_compiler.compile`` takes on the benchmark GPT-2, split into the compiler's parts, and the
plan's FLOPs against a longer solve's.

Two rows of remat_compiler: ``compile``'s defaults (its ``tolerance``, 1% of the step, and the
default time limit), then the reference, ``tolerance=0`` with the ``--long`` limit. Each: a fresh
copy of the model, compiled at ``--budget`` (a fraction of the no-recompute peak), one step timed
from the call to the end of backward; the parts are ``CompiledModule.planned.timings`` (annotate: passes and costing; solve;
check; emit; check emitted), the rest of the call is AOTAutograd's trace and the step itself. Then
``torch.compile`` of another copy, its first step timed the same way. Every row runs in a fresh
process with an empty Inductor cache of its own, as a user's first run would (``--rows`` picks them).

    python -m benchmarks.first_call                 # full size, about 2.5 minutes on 2 cores
    python -m benchmarks.first_call --quick --long 5
    python -m benchmarks.first_call --workload mixtral --backend inductor
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from remat_compiler.workload import compute_loss

__all__ = ["first_call", "main", "ROWS"]

#: The rows, each run by a fresh process.
ROWS = ("defaults", "long", "torch.compile")


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


def _budget(text: str) -> float | int:
    """``--budget``: a fraction (at most 1) of the no-recompute peak, or a number of bytes."""
    value = float(text)
    return value if value <= 1 else int(value)


def _said(budget: float | int) -> str:
    return f"{budget:g} of the no-recompute peak" if isinstance(budget, float) else f"{budget:,} bytes"


def _row(opts) -> dict:
    """One row's first call, in this process (a fresh one: see :func:`main`)."""
    from benchmarks.workloads import WORKLOADS

    torch.set_num_threads(1)
    model, args, kwargs = WORKLOADS[opts.workload].build(quick=opts.quick)
    if opts.row == "torch.compile":
        net = copy.deepcopy(model)
        t0 = time.perf_counter()
        compute_loss(None, torch.compile(net)(*args, **kwargs)).backward()
        return {"total_s": time.perf_counter() - t0}
    options = {} if opts.row == "defaults" else {"time_limit_s": opts.long, "tolerance": 0}
    return first_call(model, args, kwargs, memory_budget=opts.budget, backend=opts.backend, **options)


def _fresh(argv: list[str], row: str) -> dict:
    """``row`` run by a new Python process with an empty Inductor cache of its own: a first call as a
    user's first run sees it (Inductor's probe of the CPU's vector ISA, its compile workers, no kernel
    compiled before). Run in one process, each later row inherits what the earlier ones compiled and
    probed (at 849dafc the ``torch.compile`` row, run last, skipped a 15 s ISA probe and kernels the
    rows before had built)."""
    with tempfile.TemporaryDirectory(prefix="first_call_inductor_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=os.getcwd())
        out = subprocess.run([sys.executable, "-m", "benchmarks.first_call", *argv, "--row", row],
                             env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {row!r} row failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from benchmarks.workloads import WORKLOADS

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_call", description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=_budget, default=0.5,
                        help="a fraction of the no-recompute peak (0.5), or bytes (a peer's measured peak)")
    parser.add_argument("--long", type=float, default=60.0, help="the longer solve's time limit, s (60)")
    parser.add_argument("--quick", action="store_true", help="the workload's quick shape")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2", help="gpt2 (default)")
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager", help="eager (default)")
    parser.add_argument("--rows", default="defaults,long,torch.compile",
                        help="which rows, in order (defaults,long,torch.compile)")
    parser.add_argument("--row", choices=ROWS, help=argparse.SUPPRESS)  # one row, in this process
    opts = parser.parse_args(argv)
    if opts.row is not None:
        print(json.dumps(_row(opts)))
        return 0
    rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
    if unknown := [r for r in rows if r not in ROWS]:
        parser.error(f"unknown rows {unknown}: choose from {ROWS}")
    print(f"{WORKLOADS[opts.workload].description(opts.quick)}{' (--quick)' if opts.quick else ''}, backend={opts.backend!r}, "
          f"budget {_said(opts.budget)}, torch {torch.__version__}, 1 torch thread; "
          f"each row a fresh process with an empty Inductor cache.\n")
    print("| first call | total | trace, step (and Inductor) | annotate | solve | emit and checks | status (gap) "
          "| recompute FLOPs | peak / budget | other parts |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    labels = {"defaults": "remat_compiler, compile's defaults",
              "long": f"remat_compiler, tolerance=0, {opts.long:g} s", "torch.compile": "torch.compile"}
    for row in rows:
        r = _fresh(argv, row)
        if row == "torch.compile":
            print(f"| torch.compile | {r['total_s']:.1f} s |  |  |  |  |  |  |  |  |", flush=True)
            continue
        p = r["parts"]
        named = ("annotate", "solve", "emit", "check", "check emitted")
        rest = p.get("emit", 0) + p.get("check", 0) + p.get("check emitted", 0)
        other = ", ".join(f"{k} {v:.1f} s" for k, v in p.items() if k not in named)
        print(f"| {labels[row]} | {r['total_s']:.1f} s | {r['total_s'] - sum(p.values()):.1f} s | "
              f"{p.get('annotate', 0):.2f} s | {p.get('solve', 0):.1f} s | {rest:.2f} s | "
              f"{r['status']} ({r['gap']:.2%}) | {r['recompute_flops']:,} | {r['peak']:,} / {r['budget']:,} | "
              f"{other} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
