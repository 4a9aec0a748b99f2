"""Issue 14's targets: torch.compile (Inductor) against remat_compiler's ``backend="inductor"``, by resident-set peak.

Usage::

    python -m benchmarks.inductor_peers                               # gpt2 and mixtral, full size
    python -m benchmarks.inductor_peers --quick --workloads gpt2      # tiny sizes: a smoke run
    python -m benchmarks.inductor_peers --markdown /tmp/peers.md --json /tmp/peers.json

Rows, per workload (the models of :mod:`benchmarks.workloads`, built by its factories):

- ``eager`` (op by op, no recompute), ``checkpoint every block`` (``torch.utils.checkpoint``, eager);
- ``torch.compile`` with Inductor at each ``activation_memory_budget`` of
  :data:`~benchmarks.strategies.PYTORCH_BUDGETS`, and checkpoint every block under ``torch.compile``;
- ``remat_compiler`` with ``backend="inductor"`` and ``memory_budget`` = each of those compiled
  points' measured peak, eager's and checkpoint every block's; ``backend="eager"`` at checkpoint
  every block's peak, for reference.

Measurement. Each row runs in its own fresh process started with
:data:`~remat_compiler.memory.RSS_ENV` (:func:`benchmarks.rss_check.run_fresh`), with an empty Inductor
cache (so every compile time is a cold one) and the torch threads of :mod:`benchmarks.run`. There it
builds the row's model and an eager one, runs the row's first step (compiles; its time less a median
step is the compile time: trace + plan + Inductor for remat_compiler), a second step, two eager steps,
then one step of the row under :class:`~remat_compiler.memory.ResidentPeak` with every gradient None
(it first gives back the small buffers those steps left in malloc's heap), one under
:class:`~remat_compiler.memory.AllocatorPeak` (every tensor the step allocates, Inductor's buffers and
the temporaries kernels allocate inside themselves included), and for remat_compiler one more under a
:class:`~remat_compiler.memory.LiveStorageTracker` that :func:`remat_compiler.inductor.watch` lets see
Inductor's buffers ("tracked"). The measured peak, which sets the remat_compiler rows' budgets and
decides the targets, is the allocator's by default (``--measure allocator``): the budget bounds tensor
memory (``DESIGN.md``), and the resident set adds the process's other memory, Python objects and
malloc's bookkeeping among them (up to 1 MiB a step above the allocator's figure on these
workloads in session 21's runs, 1.8 MiB in session 20's; on some rows below it). ``--measure rss``
decides them by the resident set instead; both columns are always in the table.
Last, the row and eager are timed round-robin
(:func:`~benchmarks.measure.time_round_robin`, the order reversed every other round): the step-time
ratio is the median over rounds of the row's step over eager's in the same round. Before the timing,
:func:`~benchmarks.measure.keep_freed_memory` has malloc keep freed buffers, as a process started
without RSS_ENV does once its first steps have run: under RSS_ENV every step would also pay a page
fault for each 4 KiB page of every buffer it allocates (the benchmark GPT-2: about 49,000 a step,
535 ms a step against 416 ms without, in one scratch run). Ratios of different rows come from
different processes (the same machine, one after another). RSS counts allocations under 64 KiB imprecisely (glibc's
arenas), hence the benchmark's full sizes: ``--quick`` peaks are mostly that noise.

A remat_compiler point meets its target when its measured peak is at most the peer's and its step is
no slower than the peer's. The step times are compared in one process: each remat_compiler row builds
its peer again once its own peaks are measured, and times eager, itself and the peer round-robin; "vs
peer" is the median over rounds of its step over the peer's in the same round (the rows' ratios to
eager come from different processes, which on this machine differ by more than the targets do). Run time on a quiet 2-core machine: ``--quick`` about 10 minutes for both
workloads; full size about 40 minutes to an hour (15 processes per workload, 12 of them compiling
with a cold Inductor cache: a minute or two each on CPU).

>>> doc = bench_workload("gpt2", PeerOptions(quick=True))                 # doctest: +SKIP
>>> print(render_markdown([doc]))                                          # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

from benchmarks.measure import Runner, keep_freed_memory, max_abs_error, round_ratio, run_step, time_round_robin
from benchmarks.report import atomic_write_text
from benchmarks.rss_check import run_fresh
from benchmarks.run import code_version
from benchmarks.strategies import PYTORCH_BUDGETS, checkpoint_runner, eager_runner, planner_backend, pytorch_runner
from benchmarks.workloads import WORKLOADS, input_leaves

__all__ = ["NAMES", "PeerOptions", "measure_row", "bench_workload", "format_table", "check_targets",
           "render_markdown", "main"]

#: The workloads issue 14's targets are on.
NAMES = ("gpt2", "mixtral")
#: Issue 14: at checkpoint every block's peak, remat_compiler's Inductor step at most this ratio to eager.
CHECKPOINT_STEP_TARGET = {"gpt2": 0.85}
#: Issue 14: predicted peak within this fraction of measured on every Inductor row.
PREDICTION_TOLERANCE = 0.10
MIB = float(2 ** 20)


@dataclass
class PeerOptions:
    """How to run.

    Attributes
    ----------
    quick : bool
        The workloads' ``--quick`` sizes (smoke runs).
    rounds : int
        Interleaved timed steps of each row and eager.
    time_limit_s : float
        CP-SAT's time limit per remat_compiler solve.
    num_workers : int
        CP-SAT workers.
    objective : str, optional
        CP-SAT's recompute cost; None: compile's default (estimated runtime).
    threads : int
        torch threads in every row's process.
    row_timeout_s : float
        Seconds one row's process may take.
    budgets : tuple of float
        torch.compile's ``activation_memory_budget`` points.
    checkpoint : bool
        Also the checkpoint-every-block rows (eager and under torch.compile) and remat_compiler at
        their peaks; False re-measures just the budget points (a shorter run).
    measure : str
        Which peak is "measured" (sets the budgets, decides the targets): ``"allocator"``
        (:class:`~remat_compiler.memory.AllocatorPeak`) or ``"rss"``
        (:class:`~remat_compiler.memory.ResidentPeak`).
    """

    quick: bool = False
    rounds: int = 15
    time_limit_s: float = 25.0
    num_workers: int = 8
    objective: str | None = None
    threads: int = field(default_factory=lambda: max(1, min(2, os.cpu_count() or 1)))
    row_timeout_s: float = 1800.0
    budgets: tuple = PYTORCH_BUDGETS
    checkpoint: bool = True
    measure: str = "allocator"
    log: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr, flush=True), repr=False)


# ---------------------------------------------------------------------------- one row, in its own process

def _runner(task: dict) -> Runner:
    """The row's runner on a fresh model of the workload."""
    import remat_compiler

    spec, quick, kind = WORKLOADS[task["workload"]], task["quick"], task["kind"]
    if kind == "eager":
        return eager_runner(spec.build(quick)[0])
    if kind == "checkpoint":
        return checkpoint_runner(spec, quick)
    if kind == "torch.compile":
        return pytorch_runner(spec, quick, task["activation_budget"], backend="inductor")
    if kind == "torch.compile checkpoint":
        runner = checkpoint_runner(spec, quick)
        compiles = [0]
        runner.module = torch.compile(runner.module, backend=planner_backend(1.0, compiles, "inductor"))
        runner.strategy, runner.extras = "torch.compile", {"compiles": compiles}
        return runner
    if kind in ("remat inductor", "remat eager"):
        model = spec.build(quick)[0]
        opts = {"time_limit_s": task["time_limit_s"], "num_workers": task["num_workers"]}
        if task["objective"]:
            opts["objective"] = task["objective"]
        # the step (compute_loss(None, module(...)).backward()) keeps only the loss through backward
        m = remat_compiler.compile(model, task["budget_bytes"], backend=kind.split()[1], hold_outputs=False,
                                   **opts)
        return Runner("remat_compiler", task["setting"], m, eager_runner(model).params,
                      budget_bytes=task["budget_bytes"])
    raise ValueError(f"unknown row kind {kind!r}")


def _no_grads(runner: Runner, args: tuple, kwargs: dict) -> None:
    for t in (*runner.params, *input_leaves(args, kwargs)):
        t.grad = None


def _grads(runner: Runner, args: tuple, kwargs: dict) -> list:
    return [None if t.grad is None else t.grad.detach().clone()
            for t in (*runner.params, *input_leaves(args, kwargs))]


def measure_row(task: dict) -> dict:
    """Measure one row (runs in a fresh process started with RSS_ENV; see the module's docstring).

    Parameters
    ----------
    task : dict
        ``workload``, ``quick``, ``kind`` (``eager``, ``checkpoint``, ``torch.compile``,
        ``torch.compile checkpoint``, ``remat inductor``, ``remat eager``), ``setting``, ``threads``,
        ``rounds``, ``measure``; ``activation_budget`` (torch.compile); ``budget_bytes``,
        ``time_limit_s``, ``num_workers``, ``objective`` (remat_compiler).

    Returns
    -------
    dict
        ``task`` with ``status`` (``ok``, or ``infeasible`` and a ``note``), ``rss_peak_bytes``,
        ``allocator_peak_bytes`` and the op it peaked in (``allocator_peak_op``), ``peak_bytes`` (the
        one ``task["measure"]`` names), ``step_s``, ``eager_step_s``, ``step_ratio``, ``first_call_s``, ``compile_s``,
        ``max_grad_error``, ``recompiles``; remat_compiler rows also ``backend`` (what ran),
        ``predicted_peak_bytes`` (the walk of Inductor's code, or the plan's peak on the eager
        backend), ``plan_peak_bytes``, ``tracked_peak_bytes``, ``first_step_bytes`` (the Inductor
        backend's own measure of its code's first step), ``timings`` and the
        ``warnings`` it raised; where an Inductor row's tracked peak is not the walk's, ``mismatch``:
        the plan's JSON and both generated wrappers, to replay it.
    """
    import remat_compiler
    from remat_compiler.inductor import watch
    from remat_compiler.memory import AllocatorPeak, LiveStorageTracker, ResidentPeak

    torch.set_num_threads(task["threads"])
    model, args, kwargs = WORKLOADS[task["workload"]].build(task["quick"])
    eager = eager_runner(model)
    runner = _runner(task)
    result = dict(task, status="ok")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        t0 = time.perf_counter()
        try:
            run_step(runner, args, kwargs)
        except remat_compiler.InfeasibleBudgetError as exc:
            return dict(result, status="infeasible",
                        note=f"needs >= {remat_compiler.human_bytes(exc.min_feasible_bytes)}")
        result["first_call_s"] = time.perf_counter() - t0
    result["warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    compiles = runner.extras.get("compiles", [0])
    compiled_after_warmup = compiles[0]
    run_step(runner, args, kwargs)
    for _ in range(2):
        run_step(eager, args, kwargs)
    reference = _grads(eager, args, kwargs)

    _no_grads(runner, args, kwargs)
    with ResidentPeak() as rss:
        run_step(runner, args, kwargs)
    result["rss_peak_bytes"] = rss.peak_bytes
    result["max_grad_error"] = max_abs_error(_grads(runner, args, kwargs), reference)
    _no_grads(runner, args, kwargs)
    with AllocatorPeak() as allocator:
        run_step(runner, args, kwargs)
    result.update(allocator_peak_bytes=allocator.peak_bytes, allocator_peak_op=allocator.peak_op)
    result["peak_bytes"] = result[f"{task.get('measure', 'allocator')}_peak_bytes"]

    planned = getattr(runner.module, "planned", None)
    if planned is not None:
        inductor = planned.backend == "inductor"
        result.update(backend=planned.backend, plan_peak_bytes=planned.plan.peak_bytes,
                      recompute_flops=planned.plan.recompute_flops, plan_gap=planned.plan.gap,
                      predicted_peak_bytes=planned.compiled.peak_bytes if inductor else planned.plan.peak_bytes,
                      first_step_bytes=planned.first_step_bytes, timings=planned.timings)
        _no_grads(runner, args, kwargs)
        tracker = LiveStorageTracker()
        with tracker, (watch(tracker, planned.inductor) if inductor else contextlib.nullcontext()):
            run_step(runner, args, kwargs)
        result["tracked_peak_bytes"] = tracker.peak_bytes
        if inductor and tracker.peak_bytes != planned.compiled.peak_bytes:
            # the walk missed something: keep what replays it (compile(model, plan=Plan.from_json(...),
            # backend="inductor") writes the same code), since CP-SAT's wall-clock plans do not repeat
            result["mismatch"] = {"plan": planned.plan.to_json(), "forward_source": planned.inductor[0].source,
                                  "backward_source": planned.inductor[1].source,
                                  "walk_peak_at": planned.compiled.peak_node}

    # the timing below is a training loop's: freed buffers stay in malloc's heap (RSS_ENV, which the
    # peaks above needed, would add a page fault per 4 KiB of every buffer to every step)
    result["timed_without_page_faults"] = keep_freed_memory()
    runners = [eager, runner]
    if task.get("peer_task"):
        # the peer again, here, after every peak above was measured: both timed in the same rounds
        peer = _runner(task["peer_task"])
        for _ in range(2):
            run_step(peer, args, kwargs)
        runners.append(peer)
    times = time_round_robin(runners, args, kwargs, task["rounds"])
    result.update(step_s=statistics.median(times[1]), eager_step_s=statistics.median(times[0]),
                  step_ratio=round_ratio(times[1], times[0]), recompiles=compiles[0] - compiled_after_warmup)
    if len(times) == 3:
        result.update(peer_step_s=statistics.median(times[2]), vs_peer=round_ratio(times[1], times[2]))
    result["compile_s"] = result["first_call_s"] - result["step_s"]
    return result


# ---------------------------------------------------------------------------- one workload, row by row

def _task(name: str, opts: PeerOptions, kind: str, setting: str, **extra) -> dict:
    return {"workload": name, "quick": opts.quick, "kind": kind, "setting": setting, "threads": opts.threads,
            "rounds": opts.rounds, "time_limit_s": opts.time_limit_s, "num_workers": opts.num_workers,
            "objective": opts.objective, "measure": opts.measure, **extra}


def _run_row(task: dict, opts: PeerOptions) -> dict:
    """:func:`measure_row` in a fresh process with an empty Inductor cache; a failure becomes a row."""
    opts.log(f"[{task['workload']}] {task['kind']} {task['setting']}")
    with tempfile.TemporaryDirectory(prefix="inductor-peers-") as cache:
        try:
            row = run_fresh("benchmarks.inductor_peers:measure_row", task, opts.row_timeout_s,
                            env={"TORCHINDUCTOR_CACHE_DIR": cache})
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            opts.log(f"[{task['workload']}] FAILED: {exc}")
            return dict(task, status="failed", note=str(exc).strip().splitlines()[-1])
    for msg in row.get("warnings", ()):
        opts.log(f"[{task['workload']}]   warning: {msg}")
    return row


def _label(row: dict) -> str:
    return row["kind"] if row["setting"] in ("-", "") else f"{row['kind']} {row['setting']}"


def bench_workload(name: str, opts: PeerOptions) -> dict:
    """Every row of one workload (see the module's docstring), measured one process each.

    Returns
    -------
    dict
        ``workload``, ``description``, settings, ``runtime_s``, ``rows`` (:func:`measure_row`'s results,
        in table order; a row whose process failed has status ``failed`` and a ``note``).
    """
    t_start = time.perf_counter()
    run = lambda kind, setting, **extra: _run_row(_task(name, opts, kind, setting, **extra), opts)  # noqa: E731
    rows = [run("eager", "-")] + ([run("checkpoint", "every block")] if opts.checkpoint else [])
    peers = [run("torch.compile", f"budget {b}", activation_budget=b) for b in opts.budgets]
    if opts.checkpoint:
        peers.append(run("torch.compile checkpoint", "every block"))
    rows += peers
    for peer in (rows[0], *peers, *rows[1:2 if opts.checkpoint else 1]):
        setting = f"@ {_label(peer)} peak"
        peak = _peak(peer)
        if not peak or peak <= 0:
            rows.append(dict(_task(name, opts, "remat inductor", setting), peer=_label(peer), status="n/a",
                             note=f"{_label(peer)} has no positive measured peak"))
            continue
        peer_task = {k: peer[k] for k in ("workload", "quick", "kind", "setting", "activation_budget") if k in peer}
        rows.append(dict(run("remat inductor", setting, budget_bytes=peak, peer_task=peer_task), peer=_label(peer)))
    ckpt_peak = _peak(rows[1]) if opts.checkpoint else None
    if ckpt_peak and ckpt_peak > 0:
        rows.append(dict(run("remat eager", "@ checkpoint every block peak", budget_bytes=ckpt_peak),
                         peer=_label(rows[1])))
    return {"workload": name, "description": WORKLOADS[name].description(opts.quick), "quick": opts.quick,
            "threads": opts.threads, "rounds": opts.rounds, "time_limit_s": opts.time_limit_s,
            "objective": opts.objective or "runtime (compile's default)", "measure": opts.measure,
            "torch": torch.__version__,
            "runtime_s": time.perf_counter() - t_start, "rows": rows}


# ---------------------------------------------------------------------------- tables and targets

TABLE_HEADER = ("| runner | setting | budget (MiB) | measured peak (MiB) | RSS peak (MiB) | predicted (MiB) "
                "| predicted / measured | tracked (MiB) | step (ms) | step-time ratio | vs peer | compile (s) "
                "| runs as | recomputed GFLOP (gap) | max abs grad error | target |")


def _mib(n) -> str:
    if n is None:
        return "-"
    x = n / MIB
    return f"{x:.1f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 10 else f"{x:.3f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _peak(row: dict) -> int | None:
    """A row's measured peak: the one its run chose (``peak_bytes``), or, in rows written before
    there was a choice, the resident set's."""
    return row.get("peak_bytes", row.get("rss_peak_bytes"))


def _met(row: dict, peer: dict) -> tuple[bool, str]:
    """Whether ``row`` (remat_compiler) meets its target at ``peer``: measured peak and step-time ratio
    both at most the peer's. Returns the verdict and the figures.

    Example
    -------
    >>> _met({"status": "ok", "peak_bytes": 2**20, "step_ratio": 0.9},
    ...      {"status": "ok", "peak_bytes": 2**21, "step_ratio": 1.0})
    (True, '1.000 MiB at 0.90 (peer 2.000 MiB at 1.00)')
    >>> _met({"status": "ok", "peak_bytes": 2**20, "step_ratio": 0.9, "vs_peer": 1.02},
    ...      {"status": "ok", "peak_bytes": 2**21, "step_ratio": 1.0})[0]
    False
    """
    if row.get("status") != "ok" or peer.get("status") != "ok":
        return False, f"{row.get('status')}: {row.get('note', '')}".strip()
    if "vs_peer" in row:  # timed beside the peer, round by round, in one process
        ok = _peak(row) <= _peak(peer) and row["vs_peer"] <= 1.0
        return ok, (f"{_mib(_peak(row))} MiB (peer {_mib(_peak(peer))} MiB), step "
                    f"{row['vs_peer']:.2f} of the peer's in the same rounds")
    ok = _peak(row) <= _peak(peer) and row["step_ratio"] <= peer["step_ratio"]
    return ok, (f"{_mib(_peak(row))} MiB at {row['step_ratio']:.2f} "
                f"(peer {_mib(_peak(peer))} MiB at {peer['step_ratio']:.2f})")


def _plan_cost(row: dict) -> str:
    """What a remat_compiler row's plan recomputes, and CP-SAT's proven gap on it.

    >>> _plan_cost({"recompute_flops": 4_429_185_024, "plan_gap": 0.0456}), _plan_cost({})
    ('4.43 (0.05)', '-')
    """
    if row.get("recompute_flops") is None:
        return "-"
    return f"{row['recompute_flops'] / 1e9:.2f} ({row.get('plan_gap', 0.0):.2f})"


def format_table(doc: dict) -> str:
    """One workload's rows as a Markdown table under :data:`TABLE_HEADER`."""
    by_label = {_label(r): r for r in doc["rows"] if not r["kind"].startswith("remat")}
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count(" | ") + 1)]
    for r in doc["rows"]:
        runner = {"remat inductor": "remat_compiler inductor", "remat eager": "remat_compiler eager"
                  }.get(r["kind"], r["kind"])
        if r.get("status") != "ok":
            cells = [runner, r["setting"], _mib(r.get("budget_bytes"))] + ["-"] * 12 + \
                [f"{r['status']}: {r.get('note', '')}"]
        else:
            pred, measured = r.get("predicted_peak_bytes"), _peak(r)
            target = "-"
            if r["kind"] == "remat inductor" and r.get("peer") in by_label:
                target = "met" if _met(r, by_label[r["peer"]])[0] else "**not met**"
            cells = [runner, r["setting"], _mib(r.get("budget_bytes")), _mib(measured), _mib(r.get("rss_peak_bytes")),
                     _mib(pred), "-" if pred is None or measured <= 0 else f"{pred / measured:.3f}",
                     _mib(r.get("tracked_peak_bytes")),
                     f"{r['step_s'] * 1e3:.1f}", f"{r['step_ratio']:.2f}", _num(r.get("vs_peer"), ".2f"),
                     "-" if r["kind"] in ("eager", "checkpoint") else f"{r['compile_s']:.1f}",
                     r.get("backend", "-"), _plan_cost(r), _num(r.get("max_grad_error"), ".1e"), target]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def check_targets(doc: dict) -> list[str]:
    """Issue 14's targets on one workload's rows, one Markdown bullet each."""
    rows = doc["rows"]
    by_label = {_label(r): r for r in rows if not r["kind"].startswith("remat")}
    remat = [r for r in rows if r["kind"].startswith("remat") and r.get("status") == "ok"]
    out = []
    for r in rows:
        if r["kind"] != "remat inductor":
            continue
        peer = by_label.get(r.get("peer"), {})
        ok, figures = _met(r, peer)
        out.append(f"- at {r['peer']}'s peak: {'met' if ok else '**not met**'}, {figures}")
    target = CHECKPOINT_STEP_TARGET.get(doc["workload"])
    at_ckpt = next((r for r in rows if r["kind"] == "remat inductor" and r.get("peer") == "checkpoint every block"),
                   None)
    if target is not None and at_ckpt is not None:
        ok = at_ckpt.get("status") == "ok" and at_ckpt["step_ratio"] <= target
        got = f"{at_ckpt['step_ratio']:.2f}" if at_ckpt.get("status") == "ok" else at_ckpt.get("status")
        ckpt = by_label.get("checkpoint every block", {})
        out.append(f"- step-time ratio <= {target} at checkpoint every block's peak (issue target): "
                   f"{'met' if ok else '**not met**'}, {got} (checkpointing: {_num(ckpt.get('step_ratio'), '.2f')})")
    over = [r for r in remat if _peak(r) > r["budget_bytes"]]
    out.append("- measured <= budget on every remat_compiler row: " + (
        "met" if not over else "**not met**: " + "; ".join(
            f"{r['kind']} {r['setting']} {_mib(_peak(r))} > {_mib(r['budget_bytes'])} MiB"
            for r in over)))
    over_rss = [r for r in remat if r.get("rss_peak_bytes") is not None and r.get("peak_bytes") is not None
                and r["rss_peak_bytes"] != r["peak_bytes"] and r["rss_peak_bytes"] > r["budget_bytes"]]
    if over_rss:
        out.append("- resident set above the budget (the allocator's figure plus the process's other memory): " +
                   "; ".join(f"{r['kind']} {r['setting']} {_mib(r['rss_peak_bytes'])} > {_mib(r['budget_bytes'])} MiB"
                             for r in over_rss))
    ind = [r for r in remat if r.get("backend") == "inductor" and _peak(r) > 0]
    if ind:
        worst = max(ind, key=lambda r: abs(r["predicted_peak_bytes"] / _peak(r) - 1))
        err = worst["predicted_peak_bytes"] / _peak(worst) - 1
        out.append(f"- predicted within {PREDICTION_TOLERANCE:.0%} of measured on every Inductor row: "
                   f"{'met' if abs(err) <= PREDICTION_TOLERANCE else '**not met**'} "
                   f"(worst {err:+.1%}, {worst['setting']})")
    tracked = [r for r in remat if r.get("tracked_peak_bytes") is not None]
    if tracked:
        worst = max(tracked, key=lambda r: abs(r["tracked_peak_bytes"] - r["predicted_peak_bytes"]))
        diff = worst["tracked_peak_bytes"] - worst["predicted_peak_bytes"]
        out.append(f"- tracked peak = predicted on every remat_compiler row: {'met' if diff == 0 else '**not met**'}"
                   f" (largest difference {diff:+d} bytes, {worst['kind']} {worst['setting']})")
    fell_back = [r for r in rows if r["kind"] == "remat inductor" and r.get("status") == "ok"
                 and r.get("backend") != "inductor"]
    if fell_back:
        out.append("- ran the eager plan instead of Inductor's (warning): " +
                   "; ".join(r["setting"] for r in fell_back))
    tc = [r["compile_s"] for r in rows if r["kind"].startswith("torch.compile") and r.get("status") == "ok"]
    rc = [r["compile_s"] for r in rows if r["kind"] == "remat inductor" and r.get("status") == "ok"]
    if tc and rc:
        out.append(f"- compile time (first step less a step, cold cache): torch.compile median "
                   f"{statistics.median(tc):.1f} s, remat_compiler inductor median {statistics.median(rc):.1f} s "
                   f"(trace + plan + Inductor)")
    return out


def _malloc_when_timed(doc: dict) -> str:
    timed = [r.get("timed_without_page_faults") for r in doc["rows"] if r.get("status") == "ok"]
    if timed and all(timed):
        return "after malloc was set to keep freed buffers (as without RSS_ENV: no page faults a step)"
    return "with malloc as RSS_ENV set it in some rows (their steps include a page fault per 4 KiB allocated)"


def render_markdown(docs: Sequence[dict], command: str = "", version: str = "") -> str:
    """A section per workload: what was run, the table, the targets."""
    parts = []
    for d in docs:
        measure = d.get("measure", "rss")
        head = (f"{d['description']}{' (--quick)' if d['quick'] else ''}. torch {d['torch']}, {d['threads']} torch "
                f"thread(s). Each row in a fresh process. Measured peak: "
                + ("the allocator's (AllocatorPeak: every tensor allocation and free the profiler records, "
                   "Inductor's buffers and kernels' inner temporaries included), " if measure == "allocator" else
                   "the resident set's, ") +
                f"one step. RSS: resident-set growth over one step (MALLOC_MMAP_THRESHOLD_=65536; malloc's "
                f"free heap given back before the step); tracked: the live-storage tracker that sees "
                f"Inductor's buffers. "
                f"Step-time ratio: median over {d['rounds']} interleaved rounds (every other one in reverse "
                f"order) of the row's step over eager's, in the row's process, {_malloc_when_timed(d)}; vs "
                f"peer: over the peer's, timed in the same rounds in the remat_compiler row's process. Compile: "
                f"first step less a median step, cold Inductor cache. CP-SAT: "
                f"{d['time_limit_s']:g} s per solve, objective {d['objective']}. Wall time "
                f"{d['runtime_s'] / 60:.1f} min.")
        if command:
            head += f" Command: `{command}`" + (f"; code: {version}." if version else ".")
        parts.append(f"## {d['workload']}: Inductor peers\n\n{head}\n\n{format_table(d)}\n\nTargets:\n\n"
                     + "\n".join(check_targets(d)))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.inductor_peers", description=__doc__.splitlines()[0],
        epilog="Expected run time on a quiet 2-core machine: --quick about 10 min for both workloads; full "
               "size about 40-60 min (every row is a fresh process that compiles with a cold Inductor cache).")
    p.add_argument("--workloads", default=",".join(NAMES), help=f"comma-separated, from {','.join(NAMES)}")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 3 rounds, short solves (smoke run)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds per row (15; quick 3)")
    p.add_argument("--time-limit", type=float, default=None, help="CP-SAT seconds per solve (25; quick 5)")
    p.add_argument("--workers", type=int, default=8, help="CP-SAT workers (default 8)")
    p.add_argument("--objective", choices=("flops", "runtime"), default=None,
                   help="CP-SAT's recompute cost (default: compile's, estimated runtime)")
    p.add_argument("--budgets", default=",".join(map(str, PYTORCH_BUDGETS)),
                   help="torch.compile's activation_memory_budget points (default: the benchmark's, "
                        f"{','.join(map(str, PYTORCH_BUDGETS))})")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="leave out the checkpoint-every-block rows and the remat_compiler rows at their peaks")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in every row's process (default: 2 on this machine; 1 when other work "
                        "shares the cores, where two OpenMP threads wait on each other)")
    p.add_argument("--row-timeout", type=float, default=None, help="seconds per row's process (1800; quick 900)")
    p.add_argument("--measure", choices=("allocator", "rss"), default="allocator",
                   help="the peak that sets the budgets and decides the targets (default: allocator, the "
                        "tensor memory the budget bounds; rss: the process's resident set)")
    p.add_argument("--markdown", help="also write the tables and targets to this Markdown file")
    p.add_argument("--json", help="also write every row's raw result to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; known: {', '.join(NAMES)}")
    opts = PeerOptions(quick=args.quick, rounds=args.rounds or (3 if args.quick else 15),
                       time_limit_s=args.time_limit or (5.0 if args.quick else 25.0), num_workers=args.workers,
                       objective=args.objective, budgets=tuple(float(b) for b in args.budgets.split(",")),
                       row_timeout_s=args.row_timeout or (900.0 if args.quick else 1800.0),
                       checkpoint=not args.no_checkpoint, measure=args.measure,
                       **({"threads": args.threads} if args.threads else {}))
    command = "python -m benchmarks.inductor_peers " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    docs = []
    for name in names:
        docs.append(bench_workload(name, opts))
        print(render_markdown(docs[-1:]), flush=True)
    text = render_markdown(docs, command.strip(), code_version())
    if args.markdown:
        atomic_write_text(args.markdown, text)
    if args.json:
        atomic_write_text(args.json, json.dumps({"command": command.strip(), "code_version": code_version(),
                                                 "options": {k: v for k, v in asdict(opts).items() if k != "log"},
                                                 "workloads": docs}, indent=1) + "\n")
    return 1 if any(r.get("status") == "failed" for d in docs for r in d["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
