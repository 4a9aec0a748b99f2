"""Benchmark one workload: every strategy measured, remat_compiler swept over the peers' peaks, timed together.

Steps, in order (the same on every rank of a multi-rank workload, so collectives line up):

1. eager (the reference), checkpoint every block, PyTorch's planner at each budget, and the MoE
   strategies on MoE workloads: each warmed up, then one step measured for peak, one for FLOPs;
2. remat_compiler: the step traced and analysed once; the smallest feasible budget found; one CP-SAT
   plan per budget of the sweep (each peer's measured peak, fractions of the no-recompute plan's
   peak, the smallest feasible budget), each compiled and measured the same way; on an MoELayer
   workload also at moe_fast's measured peak minus every layer's ``y`` (issue 16), where
   ``moe_cpsat`` (CP-SAT over the fused custom backward's graph) plans as well;
3. every runner timed round-robin (``rounds`` steps each, interleaved): the median step, and the
   median over rounds of its time over eager's time in the same round;
4. rows: one per strategy point (see :data:`ROW_FIELDS`), with ratios to eager.

>>> result = bench_workload(WORKLOADS["mlp"], BenchOptions(quick=True))      # doctest: +SKIP
>>> result["rows"][0]["strategy"]                                           # doctest: +SKIP
'eager'
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import remat_compiler
from remat_compiler.budget import human_bytes
from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak

from benchmarks.measure import Runner, max_abs_error, measure, round_ratio, time_round_robin
from benchmarks.strategies import (MOE_STRATEGIES, PYTORCH_BUDGETS, Comm, Skipped, checkpoint_runner,
                                   eager_runner, moe_cpsat_runner, moe_runner, moe_y_bytes, pytorch_runner,
                                   remat_runner)
from benchmarks.workloads import ISSUE_TARGETS, WorkloadSpec

__all__ = ["BenchOptions", "ROW_FIELDS", "FAST_LESS_Y", "bench_workload", "sweep_budgets"]

#: Setting of the issue-16 point: moe_fast's measured peak minus the bytes of every layer's y.
FAST_LESS_Y = "moe_fast peak - y"

#: Keys of every result row.
ROW_FIELDS = ("workload", "strategy", "setting", "budget_bytes", "measured_peak_bytes", "predicted_peak_bytes",
              "flops", "flop_ratio", "step_s", "step_ratio", "max_grad_error", "prepare_s", "status", "gap",
              "note")


@dataclass
class BenchOptions:
    """How to run.

    Attributes
    ----------
    quick : bool
        Shrunk workloads (smoke runs, tests).
    time_limit_s : float
        CP-SAT time limit per solve.
    num_workers : int
        CP-SAT workers.
    rounds : int
        Timed steps per runner (median reported).
    fractions : tuple of float
        Budgets as fractions of the no-recompute plan's predicted peak, besides the peers' peaks.
    objective : str
        CP-SAT's recompute cost: ``"flops"`` (what the table's FLOP ratio counts) or ``"runtime"``.
    """

    quick: bool = False
    time_limit_s: float = 25.0
    num_workers: int = 8
    rounds: int = 7
    fractions: tuple = (0.75, 0.5, 0.35)
    objective: str = "flops"
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True),
                                       repr=False)


@dataclass
class _Point:
    runner: Runner | None
    skipped: Skipped | None = None
    peak_bytes: int | None = None
    flops: int | None = None
    grad_error: float | None = None
    step_s: float | None = None
    step_ratio: float | None = None
    note: str = ""


def bench_workload(spec: WorkloadSpec, opts: BenchOptions, comm: Comm | None = None, group=None) -> dict:
    """Run every strategy on one workload and return its result document (JSON-serialisable).

    Parameters
    ----------
    spec : WorkloadSpec
    opts : BenchOptions
    comm : Comm, optional
        Rank agreement (default: one process).
    group : ProcessGroup, optional
        Expert-parallel group for the MoE stack on several ranks.

    Returns
    -------
    dict
        ``workload``, ``description``, settings, ``trace_s``, ``min_feasible``, ``runtime_s``, ``rows``.

    Raises
    ------
    RematError
        If remat_compiler fails for another reason than an infeasible budget (a bug, not a row).
    """
    comm = comm or Comm()
    t_start = time.perf_counter()
    log = opts.log if comm.rank == 0 else (lambda msg: None)
    model, args, kwargs = spec.build(opts.quick, group)
    points: list[_Point] = []
    reference: list = []  # the eager step's gradients

    def run(runner: Runner | Skipped) -> None:
        if isinstance(runner, Skipped):
            points.append(_Point(None, runner))
            return
        if points and not all(torch.equal(a, b) for a, b in zip(runner.params, points[0].runner.params,
                                                                  strict=True)):
            raise ValueError(f"{runner.label}: its model's weights differ from eager's (factory not seeded?)")
        log(f"[{spec.name}] measuring {runner.label}")
        m = measure(runner, args, kwargs)
        if not reference:
            reference.extend(m.grads)
        peaks = comm.gather(m.peak_bytes)
        point = _Point(runner, peak_bytes=max(peaks), flops=sum(comm.gather(m.flops)))
        notes = []
        if len(set(peaks)) > 1:
            notes.append("rank peaks " + " / ".join(human_bytes(b) for b in peaks))
        if m.recompiles:
            notes.append(f"recompiled {m.recompiles}x while measured")
        point.note = "; ".join(notes)
        point.grad_error = max(comm.gather(max_abs_error(m.grads, reference)))
        if runner.prepare_s is None and runner.strategy == "torch.compile":
            runner.prepare_s = m.first_call_s
        points.append(point)

    run(eager_runner(model))
    run(checkpoint_runner(spec, opts.quick, group))
    torch._dynamo.reset()  # nothing compiled before by Dynamo leaks into PyTorch's planner
    for budget in PYTORCH_BUDGETS:
        run(pytorch_runner(spec, opts.quick, budget, group))
    if spec.moe:
        for name in MOE_STRATEGIES:
            run(moe_runner(spec, opts.quick, name, group))
    peers = [(p.runner.label, p.peak_bytes) for p in points if p.runner is not None]

    remat_model, _, _ = spec.build(opts.quick, group)
    # the step (compute_loss(None, module(...)).backward()) keeps only the loss through backward
    (_gm, cg), trace_s = _timed(lambda: remat_compiler.analyze(remat_model, args, kwargs, hold_outputs=False))
    baseline = remat_compiler.solve(cg, None, "save_all").peak_bytes
    solver_opts = dict(time_limit_s=opts.time_limit_s, num_workers=opts.num_workers)
    memo = SolveMemo()  # one per graph: each budget starts from the plans found before it
    log(f"[{spec.name}] traced in {trace_s:.1f} s; finding the smallest feasible budget")
    (min_peak, proven), min_s = _timed(lambda: comm.on_rank0(
        lambda: min_feasible_peak(cg, memo=memo, **solver_opts)[:2]))
    target = ISSUE_TARGETS.get(spec.name, {}).get("flop_target_peak_mib")
    extra = [(f"issue target {target:g} MiB", int(target * 2 ** 20))] if target else []
    # issue 16: at moe_fast's measured peak minus every layer's y, a plan with no GEMM recomputed
    fast_less_y = _fast_less_y(points, moe_y_bytes(model, args)) if spec.moe else None
    if fast_less_y:
        extra.append((FAST_LESS_Y, fast_less_y))
    for setting, budget in sweep_budgets(peers, baseline, min_peak, opts.fractions, extra):
        if budget < min_peak:
            note = f"needs >= {human_bytes(min_peak)}" + ("" if proven else " (lowest found, not proven)")
            run(Skipped("remat_compiler", setting, "infeasible", note, budget))
            continue
        log(f"[{spec.name}] planning remat_compiler {setting} ({human_bytes(budget)})")
        run(remat_runner(remat_model, cg, budget, setting, comm, objective=opts.objective, memo=memo,
                         **solver_opts))
    if fast_less_y:
        log(f"[{spec.name}] planning moe_cpsat @ {FAST_LESS_Y} ({human_bytes(fast_less_y)})")
        run(moe_cpsat_runner(spec, opts.quick, fast_less_y, f"@ {FAST_LESS_Y}", group,
                             objective=opts.objective, **solver_opts))

    live = [p for p in points if p.runner is not None]
    log(f"[{spec.name}] timing {len(live)} runners x {opts.rounds} rounds, interleaved")
    compiles_before = [p.runner.extras.get("compiles", [0])[0] for p in live]
    times = time_round_robin([p.runner for p in live], args, kwargs, opts.rounds)
    # a distributed step takes as long as its slowest rank: the largest time of each round over ranks
    times = [[max(per_rank) for per_rank in zip(*ranks, strict=True)]
             for ranks in zip(*comm.gather(times), strict=True)]
    for p, ts, before in zip(live, times, compiles_before, strict=True):
        p.step_s = statistics.median(ts)
        p.step_ratio = round_ratio(ts, times[0])
        recompiled = p.runner.extras.get("compiles", [0])[0] - before
        if recompiled:
            p.note = "; ".join(filter(None, [p.note, f"recompiled {recompiled}x while timed"]))
    rows = [_row(spec.name, p, points[0]) for p in points]
    return {
        "workload": spec.name, "description": spec.description(opts.quick), "quick": opts.quick,
        "world_size": comm.world_size, "time_limit_s": opts.time_limit_s, "num_workers": opts.num_workers,
        "objective": opts.objective, "hold_outputs": False,
        "rounds": opts.rounds, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "trace_s": trace_s, "nodes": len(cg.order), "baseline_predicted_bytes": baseline,
        "min_feasible": {"bytes": min_peak, "proven": proven, "seconds": min_s},
        "runtime_s": time.perf_counter() - t_start, "rows": rows,
    }


def sweep_budgets(peers, baseline_bytes: int, min_feasible_bytes: int, fractions, extra=()
                  ) -> list[tuple[str, int]]:
    """remat_compiler's budgets, largest first: each peer's measured peak, fractions, ``extra``
    ``(label, bytes)`` points (an issue's target), the smallest feasible.

    Equal budgets are merged into one point whose setting names them all.

    Example
    -------
    >>> sweep_budgets([("eager", 100), ("a", 50), ("b", 50)], 120, 30, (0.5,))
    [('@ eager peak', 100), ('@ 0.5 x no-recompute', 60), ('@ a / b peak', 50), ('@ min feasible', 30)]
    >>> sweep_budgets([("eager", 100), ("a", 50)], 120, 50, ())
    [('@ eager peak', 100), ('@ a peak / min feasible', 50)]
    """
    named: dict[int, list[str]] = {}
    for label, peak in peers:
        named.setdefault(int(peak), []).append(label)
    points = {peak: f"@ {' / '.join(labels)} peak" for peak, labels in named.items()}
    for f in fractions:
        points.setdefault(int(f * baseline_bytes), f"@ {f} x no-recompute")
    for label, nbytes in extra:
        points.setdefault(int(nbytes), f"@ {label}")
    low = int(min_feasible_bytes)
    points[low] = f"{points[low]} / min feasible" if low in points else "@ min feasible"
    return sorted(((s, b) for b, s in points.items()), key=lambda sb: -sb[1])


def _fast_less_y(points: list[_Point], y_bytes: int) -> int | None:
    """moe_fast's measured peak minus ``y_bytes``, when moe_fast and moe_custom both ran (else None)."""
    ran = {p.runner.strategy: p.peak_bytes for p in points if p.runner is not None}
    if not y_bytes or "moe_fast" not in ran or "moe_custom" not in ran:
        return None
    return ran["moe_fast"] - y_bytes


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _row(workload: str, p: _Point, eager: _Point) -> dict:
    if p.runner is None:
        s = p.skipped
        return {**dict.fromkeys(ROW_FIELDS), "workload": workload, "strategy": s.strategy,
                "setting": s.setting, "budget_bytes": s.budget_bytes, "status": s.status, "note": s.note}
    r, plan = p.runner, p.runner.plan
    return {
        "workload": workload, "strategy": r.strategy, "setting": r.setting, "budget_bytes": r.budget_bytes,
        "measured_peak_bytes": p.peak_bytes, "predicted_peak_bytes": plan.peak_bytes if plan else None,
        "flops": p.flops, "flop_ratio": p.flops / eager.flops if eager.flops else None,
        "step_s": p.step_s, "step_ratio": p.step_ratio, "max_grad_error": p.grad_error,
        "prepare_s": r.prepare_s, "status": plan.status if plan else "ok", "gap": plan.gap if plan else None,
        "note": p.note,
    }

