"""Running CP-SAT: the one clock of a solve, solver settings, Ctrl-C, and the context every step reads.

A :class:`~remat_compiler.clock.Deadline` is made once per
:func:`~remat_compiler.solvers.cpsat.solve_cpsat` call from its ``time_limit_s`` and handed down in
the :class:`Job`; every phase takes its time as a slice of what is left.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from remat_compiler.clock import Deadline
from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule
from remat_compiler.solvers.cpsat.costs import cost_units, tolerance_units
from remat_compiler.solvers.cpsat.memo import SolveMemo
from remat_compiler.solvers.cpsat.model import RematModel, build_model

__all__ = ["Job", "new_solver", "make_solver", "run_solver", "Progress", "default_workers", "WORKERS_ENV"]

#: The environment variable that sets how many CP-SAT workers a solve runs where ``num_workers`` is not
#: given (8 otherwise): e.g. 2 on a 2-core CI machine that runs two processes, where eight search
#: threads of each solve would take the other process's core.
WORKERS_ENV = "REMAT_COMPILER_CPSAT_WORKERS"


def default_workers() -> int:
    """The CP-SAT workers of a solve given no ``num_workers``: ``$REMAT_COMPILER_CPSAT_WORKERS`` or 8."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if not value:
        return 8
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{WORKERS_ENV}={value!r}: expected a whole number of CP-SAT workers, 1 or more "
                         f"(or unset it for the default, 8)")
    return int(value)


def new_solver() -> cp_model.CpSolver:
    """A CP-SAT solver that leaves Ctrl-C to Python (see :func:`run_solver`): by default CP-SAT
    catches SIGINT, only ends its search early (an interrupted solve returned a plan as if nothing
    happened) and leaves SIGINT at the system default afterwards."""
    solver = cp_model.CpSolver()
    solver.parameters.catch_sigint_signal = False
    return solver


def make_solver(seconds: float, num_workers: int | None, deterministic: bool, seed: int = 0, *,
                absolute_gap: float = 0.0, relative_gap: float = 0.0) -> cp_model.CpSolver:
    """A solver for a search of ``seconds`` (deterministic time with ``deterministic``, when the
    wall-clock limit is four times that, a guard only), stopping early once its objective is proven
    within ``absolute_gap`` (the model's units) or ``relative_gap`` of the best, where given: CP-SAT
    then says OPTIMAL, so compare the bound with the objective to know whether it is proven."""
    solver = new_solver()
    if absolute_gap > 0:
        solver.parameters.absolute_gap_limit = float(absolute_gap)
    if relative_gap > 0:
        solver.parameters.relative_gap_limit = float(relative_gap)
    workers = num_workers if num_workers is not None else default_workers()
    solver.parameters.num_workers = workers
    if deterministic:
        solver.parameters.max_deterministic_time = float(seconds)
        solver.parameters.interleave_search = workers > 1
    solver.parameters.max_time_in_seconds = float(seconds) * (4 if deterministic else 1)
    solver.parameters.random_seed = seed
    return solver


def run_solver(solver: cp_model.CpSolver, model: cp_model.CpModel, callback=None,
               deadline: Deadline | None = None) -> int:
    """``solver.solve(model, callback)``, interruptible, and charged to ``deadline``.

    On the main thread the solve runs on a worker thread while the main thread waits, so Ctrl-C
    raises ``KeyboardInterrupt`` at once; the search is stopped and joined first (nothing keeps
    running behind the exception).
    """
    if threading.current_thread() is not threading.main_thread():
        status = solver.solve(model, callback)
    else:
        status = _solve_interruptibly(solver, model, callback)
    if deadline is not None:
        deadline.charge(solver.response_proto.deterministic_time)
    return status


def _solve_interruptibly(solver: cp_model.CpSolver, model: cp_model.CpModel, callback) -> int:
    result: dict = {}

    def work():
        try:
            result["status"] = solver.solve(model, callback)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread below
            result["error"] = exc

    worker = threading.Thread(target=work, name="cp-sat", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        solver.stop_search()
        worker.join()
        raise
    if "error" in result:
        raise result["error"]
    return result["status"]


class Progress(cp_model.CpSolverSolutionCallback):
    """Reports elapsed time, best cost and bound to a callback as solutions arrive."""

    def __init__(self, report, floor: float | None = None):
        super().__init__()
        self._report = report
        self._t0 = time.perf_counter()
        self._floor = floor or 0.0  # a bound known from elsewhere (the LP relaxation)

    def on_solution_callback(self) -> None:
        self.report(self.objective_value, max(self.best_objective_bound, self._floor))

    def report(self, objective: float, bound: float) -> None:
        """Report a solution of cost ``objective`` with a lower bound ``bound`` (model units)."""
        gap = 0.0 if objective == 0 else max(0.0, objective - bound) / max(abs(objective), 1e-9)
        self._report({"elapsed_s": time.perf_counter() - self._t0, "objective": objective,
                      "bound": bound, "gap": gap})


@dataclass
class Job:
    """One CP-SAT solve: the graph, the budget, the options, the clock and the memo every step reads.

    Attributes
    ----------
    cg : CostGraph
    budget_bytes : int | None
    objective : "runtime" | "flops"
    deadline : Deadline
    memo : SolveMemo
        Plans met earlier on this graph (a fresh one per call unless the caller owns one).
    forced_saved, forbidden_saved : tuple of str
        A policy's hard decisions.
    num_workers : int | None
    reruns : bool
        Whether plans may recompute a value more than once.
    tolerance : float
        The cost searches stop once the plan is proven within this fraction of the whole step's
        estimated cost of the best plan (0: proven optimal, or the time limit).
    models : dict
        The models built for this job (see :meth:`cost_model`), shared by its phases' copies.
    """

    cg: CostGraph
    budget_bytes: int | None
    objective: str
    deadline: Deadline
    memo: SolveMemo = field(default_factory=SolveMemo)
    forced_saved: tuple = ()
    forbidden_saved: tuple = ()
    num_workers: int | None = None
    reruns: bool = True
    tolerance: float = 0.0
    models: dict = field(default_factory=dict, repr=False)

    @property
    def deterministic(self) -> bool:
        return self.deadline.deterministic

    def with_deadline(self, deadline: Deadline) -> "Job":
        """The same job on another clock (a phase's part of this one's)."""
        return replace(self, deadline=deadline)

    def cost_model(self) -> RematModel:
        """The model of this job's budget, policy and objective, minimising the cost, built once
        (the tied-blocks warm start searches a copy of it, the cost search the model itself)."""
        if "cost" not in self.models:
            self.models["cost"] = build_model(self.cg, self.budget_bytes, forced_saved=self.forced_saved,
                                              forbidden_saved=self.forbidden_saved, objective=self.objective)
        return self.models["cost"]

    def cost_of(self, n: str) -> int:
        """A node's recompute cost in the objective's integer units."""
        return cost_units(self.cg, n, self.objective)

    def cost(self, saved, rerun=()) -> int:
        """The objective value of the plan that saves ``saved`` (and reruns ``rerun``)."""
        return sum(self.cost_of(n) for n in self.recomputed(saved, rerun))

    def recomputed(self, saved, rerun=()) -> list[str]:
        """What the plan that saves ``saved`` (and reruns ``rerun``) recomputes."""
        return build_schedule(self.cg, saved, rerun).recomputed

    def gap_units(self, cost_gcd: int = 1) -> int:
        """The absolute gap at which a cost search stops, in a model's units (costs over ``cost_gcd``):
        :attr:`tolerance` of the step's estimated cost."""
        return tolerance_units(self.cg, self.objective, self.tolerance) // cost_gcd

    def meets(self, cost: float, bound: float, cost_gcd: int = 1) -> bool:
        """Whether a plan of ``cost`` is as good as proven by ``bound`` (both in a model's units, costs
        over ``cost_gcd``): within the search's tolerance (:meth:`gap_units`) or a few tie-break units,
        so that no search from it could improve it meaningfully."""
        return cost <= bound + max(1.0, 1e-5 * cost, self.gap_units(cost_gcd))

    def complies(self, saved) -> bool:
        """Whether a saved set honours the policy's forced and forbidden saves."""
        saved = set(saved)
        return set(self.forced_saved) <= saved and not saved & set(self.forbidden_saved)

    def solve(self, model: cp_model.CpModel, seconds: float, *, callback=None, seed: int = 0,
              deadline: Deadline | None = None, gap_units: int = 0, relative_gap: float = 0.0
              ) -> tuple[int, cp_model.CpSolver]:
        """Search ``model`` for ``seconds`` (charged to ``deadline``, default the job's), stopping
        early once the objective is proven within ``gap_units`` or ``relative_gap``
        (:func:`make_solver`); returns (status, solver)."""
        solver = make_solver(seconds, self.num_workers, self.deterministic, seed, absolute_gap=gap_units,
                             relative_gap=relative_gap)
        status = run_solver(solver, model, callback, deadline or self.deadline)
        if status == cp_model.MODEL_INVALID:
            raise RuntimeError(f"CP-SAT model invalid: {model.validate()}")
        return status, solver
