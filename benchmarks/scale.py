"""Plan time at scale: GPT-2 of the benchmark's width at 12 and 48 layers, planned (not run).

Issue 5's targets: 12 layers planned in <= 10 s and 48 layers in <= 30 s, each optimal or with a
proven gap <= 1%. For each depth the step is traced and analysed once, then CP-SAT plans two budgets:
half the no-recompute plan's peak, and the peak of the checkpoint-every-block plan (the point where a
plan has to beat checkpointing). CP-SAT's time limit is the target (it bounds the whole solve call).
Reported per solve: wall time, status, proven
gap, and the time at which the gap first reached 1% (from the solver's progress callback, which
reports the bound with every improving solution).

>>> doc = bench_plan_scale(BenchOptions(quick=True))        # doctest: +SKIP
"""
from __future__ import annotations

import time

import torch

import remat_compiler
from remat_compiler.budget import human_bytes
from remat_compiler.errors import InfeasibleBudgetError

from benchmarks.bench import BenchOptions
from benchmarks.workloads import WORKLOADS, build_gpt2

__all__ = ["SCALE_LAYERS", "bench_plan_scale"]

#: GPT-2 depths planned and their plan-time targets in seconds (full size, quick).
SCALE_LAYERS = {False: ((12, 10.0), (48, 30.0)), True: ((2, 5.0), (4, 5.0))}


def _solve(cg, budget: int, target_s: float, opts: BenchOptions) -> dict:
    events = []
    # cold: no memo, so each solve builds its block menu anew (a sweep passes one memo to reuse them)
    t0 = time.perf_counter()
    try:
        plan = remat_compiler.solve(cg, budget, "cpsat", time_limit_s=target_s, objective=opts.objective,
                                    num_workers=opts.num_workers, progress=events.append)
    except InfeasibleBudgetError as exc:
        return {"budget_bytes": budget, "status": "infeasible", "solve_s": time.perf_counter() - t0,
                "note": f"needs >= {human_bytes(exc.min_feasible_bytes)}"}
    within_1pct = next((e["elapsed_s"] for e in events if e["gap"] <= 0.01), None)
    if within_1pct is None and plan.status == "optimal":
        within_1pct = plan.solve_time_s  # proven at the end, with no new solution to report it
    return {"budget_bytes": budget, "status": plan.status, "gap": plan.gap, "solve_s": plan.solve_time_s,
            "to_1pct_s": within_1pct, "tiebreak_gap": plan.extras.get("tiebreak_gap"),
            "predicted_peak_bytes": plan.peak_bytes, "flop_overhead": plan.flop_overhead, "note": ""}


def bench_plan_scale(opts: BenchOptions) -> dict:
    """Trace, analyse and plan GPT-2 at each depth of :data:`SCALE_LAYERS`; the result document."""
    t_start = time.perf_counter()
    rows = []
    for layers, target_s in SCALE_LAYERS[opts.quick]:
        opts.log(f"[scale] GPT-2 with {layers} layers: tracing")
        model, args, kwargs = build_gpt2(opts.quick, n_layer=layers)
        model.train()
        t0 = time.perf_counter()
        _gm, cg = remat_compiler.analyze(model, args, kwargs, hold_outputs=False)
        trace_s = time.perf_counter() - t0
        baseline = remat_compiler.solve(cg, None, "save_all").peak_bytes
        blocks = remat_compiler.solve(cg, None, "checkpoint_blocks").peak_bytes
        for name, budget in (("0.5 x no-recompute", int(0.5 * baseline)), ("checkpoint-every-block peak", blocks)):
            opts.log(f"[scale] GPT-2 with {layers} layers: planning at {name}")
            rows.append({"layers": layers, "nodes": len(cg.order), "trace_s": trace_s, "budget_name": name,
                         "baseline_bytes": baseline, "target_s": target_s, "time_limit_s": target_s,
                         **_solve(cg, budget, target_s, opts)})
    return {"workload": "scale", "kind": "plan_scale", "quick": opts.quick,
            "description": f"GPT-2 as in gpt2 ({WORKLOADS['gpt2'].description(opts.quick)}) at "
                           f"{' and '.join(str(n) for n, _ in SCALE_LAYERS[opts.quick])} layers, planned only",
            "num_workers": opts.num_workers, "objective": opts.objective,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "runtime_s": time.perf_counter() - t_start, "rows": rows}
