"""The largest size (sequence length, batch) whose training step fits a memory budget: the CLI's ``fit``.

A size fits when the solver finds a plan under the budget; when it does not, the
:class:`~remat_compiler.errors.InfeasibleBudgetError` it raises names the smallest feasible peak
found. The peak grows with the size, so the sizes are bisected: the smallest is tried first, then
the largest, then the middle of what is left, and the answer is a size that fits whose next size
was tried and does not.

>>> result = fit_size(lambda seq: plan_model(model, (), inputs(seq), "70GiB"), [128, 256, 384])  # doctest: +SKIP
>>> result.best.size, result.limit.size                                                        # doctest: +SKIP
(256, 384)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from remat_compiler.api import PlannedGraph
from remat_compiler.budget import human_bytes
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.plan import Plan
from remat_compiler.tables import format_table

__all__ = ["Probe", "FitResult", "fit_size", "describe_probe", "format_fit"]


@dataclass
class Probe:
    """One size tried.

    Attributes
    ----------
    size : int
    fits : bool
        Whether a plan under the budget was found.
    peak_bytes : int
        The plan's predicted peak if it fits, else the smallest feasible peak found.
    proven : bool
        When it does not fit: whether that smallest peak is proven minimal (else the solver ran out of
        time, and a plan may exist that it did not find).
    plan_time_s : float
        Tracing and planning, in seconds.
    plan : Plan or None
        The plan when it fits.
    planned : PlannedGraph or None
        The plan with its graphs, kept only for the largest size that fits (see :attr:`FitResult.best`).
    """

    size: int
    fits: bool
    peak_bytes: int
    proven: bool = True
    plan_time_s: float = 0.0
    plan: Plan | None = None
    planned: PlannedGraph | None = None


@dataclass
class FitResult:
    """The sizes tried, in the order tried, and the answer.

    Attributes
    ----------
    probes : list of Probe
    best : Probe or None
        The largest size that fits, with its plan; None if even the smallest does not.
    limit : Probe or None
        The next size after ``best``, which does not fit; None if ``best`` is the largest size (or
        nothing fits: then ``probes[0]`` says what the smallest size needs).
    """

    probes: list[Probe]
    best: Probe | None
    limit: Probe | None


def fit_size(plan_at: Callable[[int], PlannedGraph], sizes: Sequence[int], *,
             on_probe: Callable[[Probe], None] | None = None) -> FitResult:
    """Bisect ``sizes`` for the largest whose step ``plan_at`` plans under its budget.

    Parameters
    ----------
    plan_at : callable
        ``plan_at(size)`` returns the plan at that size, or raises :class:`InfeasibleBudgetError`.
    sizes : sequence of int
        Ascending; the step's peak is assumed not to fall as the size grows.
    on_probe : callable, optional
        Called with each :class:`Probe` as it is made (progress).

    Returns
    -------
    FitResult
        At most ``2 + ceil(log2(len(sizes)))`` sizes are planned.

    Raises
    ------
    ValueError
        If ``sizes`` is empty or not strictly ascending.
    """
    if not sizes or any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes must be a non-empty ascending sequence, got {list(sizes)}")
    probes: dict[int, Probe] = {}

    def probe(i: int) -> Probe:
        t0 = time.perf_counter()
        try:
            planned = plan_at(sizes[i])
            made = Probe(sizes[i], True, planned.plan.peak_bytes, plan=planned.plan, planned=planned)
        except InfeasibleBudgetError as exc:
            made = Probe(sizes[i], False, exc.min_feasible_bytes, proven=exc.proven)
        made.plan_time_s = time.perf_counter() - t0
        probes[i] = made
        if on_probe is not None:
            on_probe(made)
        return made

    lo, hi = 0, len(sizes)  # sizes[lo] fits; sizes[hi] does not (len(sizes): none is larger)
    if not probe(0).fits:
        return FitResult(list(probes.values()), None, None)
    while hi - lo > 1:
        mid = len(sizes) - 1 if hi == len(sizes) else (lo + hi) // 2  # the largest first
        if probe(mid).fits:
            probes[lo].planned = None  # one plan is kept: the largest size's that fits
            lo = mid
        else:
            hi = mid
    return FitResult(list(probes.values()), probes[lo], probes.get(hi))


def describe_probe(dim: str, probe: Probe) -> str:
    """One line saying whether a size fits (progress during a search).

    Example
    -------
    >>> describe_probe("seq", Probe(4096, False, 3 * 2**30, proven=False, plan_time_s=12.5))
    'seq 4096: does not fit: needs >= 3.00 GiB (the smallest peak found, not proven minimal), 12.5 s'
    """
    if probe.fits:
        return f"{dim} {probe.size}: fits: plan peaks at {human_bytes(probe.peak_bytes)}, {probe.plan_time_s:.1f} s"
    return f"{dim} {probe.size}: does not fit: needs >= {human_bytes(probe.peak_bytes)} ({_floor(probe)}), " \
           f"{probe.plan_time_s:.1f} s"


def _floor(probe: Probe) -> str:
    return "proven minimal" if probe.proven else "the smallest peak found, not proven minimal"


def format_fit(result: FitResult, dim: str, step: int, budget_bytes: int) -> str:
    """The answer in one sentence, then every size tried as a table row (ascending).

    Parameters
    ----------
    result : FitResult
    dim : str
        What was searched (``"seq"``, ``"batch"``).
    step : int
        The grid the sizes are multiples of.
    budget_bytes : int
    """
    budget = human_bytes(budget_bytes)
    best, limit = result.best, result.limit
    if best is None:
        first = result.probes[0]
        answer = (f"nothing fits {budget}: the smallest {dim} tried, {first.size}, needs >= "
                  f"{human_bytes(first.peak_bytes)} ({_floor(first)})")
    elif limit is None:
        answer = (f"{dim} {best.size} fits {budget}: the largest tried (raise the maximum to search "
                  "further)")
    else:
        answer = (f"the largest {dim} whose step fits {budget} is {best.size} (multiples of {step}); {dim} "
                  f"{limit.size} needs >= {human_bytes(limit.peak_bytes)} ({_floor(limit)})")
    header = [dim, "fits", "peak", "recompute FLOPs", "est. time", "status", "plan time"]
    rows = []
    for p in sorted(result.probes, key=lambda p: p.size):
        if p.plan is not None:
            status = p.plan.status + (f" (gap {p.plan.gap:.1%})" if p.plan.status != "optimal" else "")
            rows.append([p.size, "yes", human_bytes(p.peak_bytes), f"+{p.plan.flop_overhead:.1%}",
                         f"+{p.plan.runtime_overhead:.1%}", status, f"{p.plan_time_s:.1f} s"])
        else:
            rows.append([p.size, "no", f">= {human_bytes(p.peak_bytes)}", "-", "-", _floor(p),
                         f"{p.plan_time_s:.1f} s"])
    return f"fit: {answer}\n\n{format_table(header, rows)}"
