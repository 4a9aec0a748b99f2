"""Run strategies for real and measure them: peak live storage, FLOPs, step time, gradient error.

Each strategy is trained through :func:`remat_compiler.compile`: its first step traces, plans and
compiles (an infeasible budget or a strategy that does not apply becomes a row there), then one step
under :class:`~remat_compiler.memory.LiveStorageTracker`, one under ``FlopCounterMode``, and
``steps`` timed steps. Parameter and input gradients are reset to None before every step, so the
step creates them as in ordinary training, and are compared with an eager step of the same model.

>>> ref = eager_reference(workload, steps=5)                                  # doctest: +SKIP
>>> run = run_strategy(workload, "cpsat", "0.5", steps=5, reference=ref)      # doctest: +SKIP
>>> print(format_compare_table([ref, run]))                                  # doctest: +SKIP
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

from remat_compiler.api import compile as compile_model
from remat_compiler.api import analyze
from remat_compiler.budget import human_bytes, parse_budget
from remat_compiler.errors import InfeasibleBudgetError, StrategyNotApplicableError
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.plan import Plan
from remat_compiler.solvers import get_solver, resolve_budget
from remat_compiler.tables import format_table, note_cell
from remat_compiler.workload import Workload

__all__ = ["max_abs_error", "StrategyRun", "common_budget_bytes", "eager_reference", "run_strategy", "format_compare_table"]


@dataclass
class StrategyRun:
    """What one strategy did on a real step.

    Attributes
    ----------
    strategy : str
        Solver name, or ``"eager"`` for the model without the compiler.
    status : str
        ``"ok"``, ``"infeasible"`` (no plan fits the budget) or ``"n/a"`` (the strategy does not
        apply to this model).
    note : str
        The reason when status is not ok.
    plan : Plan or None
    measured_peak_bytes, flops : int or None
        Peak live storage of one step above what was resident before it; FLOPs counted by
        ``torch.utils.flop_counter`` over one step.
    step_s : float or None
        Median wall time of a step.
    max_grad_error : float or None
        Largest absolute difference of any parameter or input gradient from the eager step.
    grads : list of tensors
        The gradients of the measured step (kept for the eager reference only).
    """

    strategy: str
    status: str = "ok"
    note: str = ""
    plan: Plan | None = None
    measured_peak_bytes: int | None = None
    flops: int | None = None
    step_s: float | None = None
    max_grad_error: float | None = None
    grads: list = field(default_factory=list, repr=False)


def _grad_leaves(workload: Workload) -> list[torch.Tensor]:
    params = [p for p in workload.model.parameters() if p.requires_grad]
    return params + workload.input_leaves()


def _reset_grads(workload: Workload) -> None:
    for t in _grad_leaves(workload):
        t.grad = None


def _step(workload: Workload, module: Callable) -> None:
    """One training step (forward, loss, backward), starting with no gradients."""
    _reset_grads(workload)
    loss = workload.loss(module(*workload.args, **workload.kwargs))
    loss.backward()


def _measure(run: StrategyRun, workload: Workload, module: Callable, steps: int, *,
             warm_up: bool = True) -> StrategyRun:
    if warm_up:
        _step(workload, module)  # traces and compiles once
    _reset_grads(workload)
    with LiveStorageTracker() as mem:
        _step(workload, module)
    run.measured_peak_bytes = mem.peak_bytes
    run.grads = [None if t.grad is None else t.grad.detach().clone() for t in _grad_leaves(workload)]
    with FlopCounterMode(display=False) as counter:
        _step(workload, module)
    run.flops = counter.get_total_flops()
    times = []
    for _ in range(steps):
        _reset_grads(workload)
        t0 = time.perf_counter()
        _step(workload, module)
        times.append(time.perf_counter() - t0)
    run.step_s = statistics.median(times)
    return run


def max_abs_error(grads: Sequence, reference: Sequence) -> float:
    """Largest absolute difference between two gradient lists (a missing gradient counts as zeros).

    Raises
    ------
    ValueError
        If the lists differ in length or a pair differs in shape (the runners' models differ).
    """
    if len(grads) != len(reference):
        raise ValueError(f"{len(grads)} gradients against {len(reference)} in the reference")
    worst = 0.0
    for g, r in zip(grads, reference, strict=True):
        if g is None and r is None:
            continue
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        if g.shape != r.shape:
            raise ValueError(f"gradient of shape {tuple(g.shape)} against {tuple(r.shape)}")
        if g.numel():
            worst = max(worst, (g.double() - r.double()).abs().max().item())
    return worst


def common_budget_bytes(workload: Workload, budget, *, hold_outputs: bool = True) -> int | None:
    """One budget in bytes for every strategy, so a fraction means the same bytes for all of them.

    A fraction is taken of the no-recompute peak of the model as traced (strategies that trace a
    prepared model, such as ``moe_custom``, would otherwise resolve it against their own graph).

    Parameters
    ----------
    workload : Workload
    budget : int | str | float | None
    hold_outputs : bool
        As :func:`remat_compiler.compile` takes it.

    Returns
    -------
    int or None
        None for no limit.

    Raises
    ------
    ValueError
        For a budget that does not parse.
    """
    parsed = parse_budget(budget)
    if parsed.fraction is None:
        return parsed.bytes
    _, cg = analyze(workload.model, workload.args, workload.kwargs, hold_outputs=hold_outputs)
    return resolve_budget(cg, parsed)


def eager_reference(workload: Workload, *, steps: int = 5) -> StrategyRun:
    """Measure the model as it is, without the compiler: the reference every strategy is compared to.

    Returns
    -------
    StrategyRun
        With ``grads`` set (the reference gradients) and ``max_grad_error`` 0.
    """
    run = _measure(StrategyRun("eager"), workload, workload.model, steps)
    run.max_grad_error = 0.0
    return run


def run_strategy(workload: Workload, strategy: str, budget, *, steps: int = 5,
                 reference: StrategyRun, time_limit_s: float | None = None,
                 progress: Callable | None = None, hold_outputs: bool = True) -> StrategyRun:
    """Plan ``strategy`` under ``budget``, train with it through ``remat_compiler.compile``, measure.

    Parameters
    ----------
    workload : Workload
    strategy : str
        A registered solver name.
    budget : int | str | float | None
        As :func:`remat_compiler.compile` takes it.
    steps : int
        Timed steps (the median is reported).
    reference : StrategyRun
        The eager run (its gradients are the reference).
    time_limit_s : float, optional
        For solvers that take it.
    progress : callable, optional
        Progress callback for solvers that take it.
    hold_outputs : bool
        As :func:`remat_compiler.compile` takes it.

    Returns
    -------
    StrategyRun
        Status ``"infeasible"`` or ``"n/a"`` (with the reason) when there is no plan.

    Raises
    ------
    RematError
        For anything but an infeasible budget or a strategy that does not apply (a mismatched or
        rejected plan is a bug and is not turned into a row).
    """
    opts = get_solver(strategy).options_in({"time_limit_s": time_limit_s, "progress": progress})
    compiled = compile_model(workload.model, budget, solver=strategy, hold_outputs=hold_outputs, **opts)
    try:
        _step(workload, compiled)  # the first step traces, plans and compiles, once
    except InfeasibleBudgetError as exc:
        return StrategyRun(strategy, "infeasible", exc.account(exact=True))
    except StrategyNotApplicableError as exc:
        return StrategyRun(strategy, "n/a", str(exc))
    run = _measure(StrategyRun(strategy, plan=compiled.plan), workload, compiled, steps, warm_up=False)
    run.max_grad_error = max_abs_error(run.grads, reference.grads)
    run.grads = []
    return run


def format_compare_table(runs: Sequence[StrategyRun]) -> str:
    """One row per run: predicted and measured peak, FLOPs and overhead, median step time, gradient error.

    Parameters
    ----------
    runs : sequence of StrategyRun
        The eager reference first, if present (FLOP overhead is relative to it). Whether the
        measured peak fits is judged against each plan's own budget.

    Returns
    -------
    str
        The table; reasons too long for a cell follow it as numbered notes.
    """
    base_flops = next((r.flops for r in runs if r.strategy == "eager"), None)
    header = ["strategy", "status", "predicted peak", "measured peak", "meas/pred", "fits budget",
              "FLOPs", "FLOP overhead", "median step", "max |grad err|"]
    body, notes = [], []
    for r in runs:
        if r.status != "ok":
            body.append([r.strategy, note_cell(f"{r.status}: {r.note}", notes), *["-"] * 8])
            continue
        plan = r.plan
        ratio = f"{r.measured_peak_bytes / plan.peak_bytes:.3f}" if plan and plan.peak_bytes else "-"
        fits = ("-" if plan is None or plan.budget_bytes is None
                else "yes" if r.measured_peak_bytes <= plan.budget_bytes else "NO")
        overhead = f"+{(r.flops - base_flops) / base_flops:.1%}" if base_flops else "-"
        body.append([r.strategy, "ok", human_bytes(plan.peak_bytes) if plan else "-",
                     human_bytes(r.measured_peak_bytes), ratio, fits, f"{r.flops:,}", overhead,
                     f"{r.step_s * 1e3:.2f} ms", f"{r.max_grad_error:.2e}"])
    return "\n".join([format_table(header, body), *notes])
