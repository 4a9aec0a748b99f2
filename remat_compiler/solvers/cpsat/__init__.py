"""The CP-SAT solver: the least recompute cost under the budget, as a recipe of named steps.

::

    job   = Job(graph, budget, objective, Deadline(time_limit_s), memo)     # one clock, one memo
    start = seed(job)                  # the no-recompute plan, heuristics, block methods  (warmstart)
    floor = floor_first(job)           # no warm start fits: the lowest peak first         (minpeak)
    rm    = formulate(job, start)      # the CP-SAT model, hinted, and its LP / block bound (model, lp)
    found = search(job, rm, start)     # least cost under the budget
    found = below_floor(job, ...)      # nothing found: lowest peak, reruns, or infeasible  (minpeak)
    found = peak_at_cost(job, found)   # least peak among plans of that cost
    plan  = finish(job, found)         # the Plan, status and gap                          (steps)

The model (:mod:`.model`) is exact for the simulator's node-level peak of plans that recompute each
value at most once; plans that recompute a value again (reruns, :mod:`.rerun`) are searched locally
below the lowest peak the model reaches. Every plan comes back through
:func:`~remat_compiler.plan.make_plan`, so it is simulated, and is checked again before it is emitted.
"""
from __future__ import annotations

from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.solvers.cpsat.costs import OBJECTIVES, check_tolerance, cost_units, flop_gap, plan_cost_units
from remat_compiler.solvers.cpsat.memo import SolveMemo
from remat_compiler.solvers.cpsat.minpeak import min_feasible_peak
from remat_compiler.solvers.cpsat.model import RematModel, build_model
from remat_compiler.solvers.cpsat.run import Job, Progress
from remat_compiler.solvers.cpsat.steps import (SHARES, NotFound, below_floor, finish, floor_first, formulate,
                                                peak_at_cost, search)
from remat_compiler.solvers.cpsat.warmstart import seed

__all__ = ["solve_cpsat", "OPTIONS", "SolveMemo", "min_feasible_peak", "cost_units", "plan_cost_units",
           "flop_gap", "RematModel", "build_model", "OBJECTIVES"]

#: The options :func:`solve_cpsat` takes (the solver registry refuses others).
OPTIONS = frozenset({"time_limit_s", "num_workers", "deterministic", "minimize_peak", "forced_saved",
                     "forbidden_saved", "progress", "warm_start", "block_reuse", "block_reuse_share",
                     "objective", "reruns", "memo", "deadline", "tolerance"})


def solve_cpsat(cg: CostGraph, budget_bytes: int | None, *, time_limit_s: float = 30.0,
                num_workers: int | None = None, deterministic: bool = False, minimize_peak: bool = True,
                forced_saved=(), forbidden_saved=(), progress=None, warm_start: bool = True,
                block_reuse: bool = True, block_reuse_share: float = 0.4, objective: str = "runtime",
                reruns: bool = True, memo: SolveMemo | None = None, solver_name: str = "cpsat",
                deadline: Deadline | None = None, tolerance: float = 0.0) -> Plan:
    """Minimise recompute cost subject to the simulated peak <= ``budget_bytes``.

    Parameters
    ----------
    cg : CostGraph
    budget_bytes : int | None
        Peak bound in bytes; None returns the no-recompute plan's cost (0) with the smallest peak.
    time_limit_s : float
        For the whole call: warm start, cost search, peak search and, for an infeasible budget,
        the lowest-peak search that names the smallest feasible budget, all on one clock. Each phase
        that finds the time spent still gets :data:`~remat_compiler.clock.MIN_SLICE_S`, and building
        models and plans is not interrupted, so the call returns within about ``time_limit_s + 1 s``
        on graphs of a few thousand nodes. With ``deterministic`` it is CP-SAT's deterministic time.
    num_workers : int, optional
        CP-SAT workers (default 8: CP-SAT's portfolio of strategies needs several, even on few cores).
    deterministic : bool
        Run on CP-SAT's deterministic time with interleaved search, so the same graph and budget give
        the same plan on every run and machine (slower in wall time: heuristics then run to their
        end). Refuses a ``memo``. Under torch.distributed the plan is made on rank 0 and broadcast, so
        ranks agree either way.
    minimize_peak : bool
        After the cost is found, minimise the peak among plans of that cost.
    warm_start : bool
        Hint CP-SAT with the no-recompute plan if it fits, else with the best of the heuristics and
        (``block_reuse``) the block methods' plans (:mod:`.warmstart`).
    block_reuse, block_reuse_share :
        Reuse identical repeated blocks (transformer layers): with 3 or more (no policy, not
        ``deterministic``), the block decomposition (:mod:`.blockbound`) gives a proven lower bound
        and, from its choice of per-block plans, a plan; when that plan meets the bound (up to the
        tie-break) no search follows. Otherwise per-block options composed under the budget
        (:mod:`.blockwise`), or the model where identical blocks make the same decisions (for this
        share of the time limit), seed the full model, which may then treat each block differently;
        both end by ``warmstart.SHARES["end"]`` of the time limit (or are skipped), so the search
        keeps its share.
    forced_saved, forbidden_saved :
        Candidate names that must / must not be saved (user policies).
    progress : callable, optional
        Called with ``{"elapsed_s", "objective", "bound", "gap"}`` on each improving solution.
    objective : "runtime" | "flops"
        The recompute cost minimised: estimated runtime (default; memory-bound ops cost their
        bytes moved) or counted FLOPs (what FLOP-overhead tables measure; see :func:`cost_units`;
        fewer recomputed ops break ties, a secondary criterion outside the status and gap).
    reruns : bool
        Below the lowest peak of plans that recompute each value once, look for plans that
        recompute some values again (:mod:`.rerun`).
    memo : SolveMemo, optional
        Plans and block menus of earlier solves on this graph, owned by the caller (a sweep over
        budgets, a compiled module), which seed this solve and receive its plans. Without one the
        plan depends only on the arguments (and, without ``deterministic``, the time available).
    deadline : Deadline, optional
        The clock to run on, in place of a new one of ``time_limit_s``: a caller that spent part of
        the time limit already (the combine choice, :func:`remat_compiler.combines.choose_combines`)
        hands over what is left.
    solver_name : str
        The name the plan records (``"moe_cpsat"`` when that strategy calls this one).
    tolerance : float
        Stop the cost search once the plan is proven within this fraction of the whole step's
        estimated cost (every op of forward and backward once, :func:`.costs.step_cost_units`) of
        the best plan, rather than at a proof of optimality or the time limit; the peak tie-break
        then runs no longer than the search did. 0 (default here): search to the proof.
        :func:`remat_compiler.compile` passes :data:`remat_compiler.pipeline.COMPILE_TOLERANCE`
        unless given one, so a first call does not wait out the time limit for a proof worth a
        fraction of a percent of the step. The plan's ``status`` stays "feasible" and its ``gap``
        the proven one unless the bound meets the cost.

    Returns
    -------
    Plan
        ``status`` "optimal", or "feasible" with the proven relative ``gap`` of the cost (under
        ``"flops"``, of the counted FLOPs; see :func:`~.costs.flops_status`).

    Raises
    ------
    InfeasibleBudgetError
        If no plan fits; it names the smallest feasible budget.
    ValueError
        For an unknown ``objective``, a ``tolerance`` outside [0, 1), or a ``memo`` with
        ``deterministic``.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    tolerance = check_tolerance(tolerance)
    if deterministic and memo is not None:
        raise ValueError("deterministic=True promises the plan of the arguments alone: pass no memo")
    if deadline is None:
        deadline = Deadline(time_limit_s, deterministic=deterministic)
    job = Job(cg, budget_bytes, objective, deadline,
              memo if memo is not None else SolveMemo(), tuple(forced_saved), tuple(forbidden_saved),
              num_workers, reruns, tolerance=tolerance)
    start = seed(job, heuristics=warm_start, block_reuse=block_reuse, block_reuse_share=block_reuse_share)
    floor = None
    if budget_bytes is not None and start.saved is None and warm_start:
        floor, start.saved = floor_first(job)
    rm, relaxed = formulate(job, start)
    report = Progress(progress, relaxed) if progress else None
    found = search(job, rm, start, relaxed, report, share=SHARES["search"] if minimize_peak else 1.0)
    if isinstance(found, NotFound):
        found = below_floor(job, rm, found, floor, relaxed, report)
    if minimize_peak and not found.final:
        found = peak_at_cost(job, found, 0.0 if deterministic else rm.build_s)
    return finish(job, found, solver_name)
