"""Solvers: what ``solver=`` can name. Every one is a :class:`Strategy` whose ``solve`` is
``solve(cost_graph, budget_bytes, **options) -> Plan``.

Hand-picked strategies (``save_all``, ``checkpoint_blocks`` and the MoE strategies) are solvers too, so
they are compared with CP-SAT on the same footing and checked by the same :func:`check_plan`. The
table is fixed; a caller with a solver of its own passes it (a callable or a :class:`Strategy`) as
``solver=``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from remat_compiler.budget import Budget, parse_budget
from remat_compiler.graph import CostGraph
from remat_compiler.errors import PlanMismatchError
from remat_compiler.moe.layer import fused_combine_mode
from remat_compiler.moe.segments import segment_combines
from remat_compiler.plan import Plan, make_plan, moe_combine_of
from remat_compiler.schedule import build_schedule, no_recompute, simulate
from remat_compiler.solvers.baselines import solve_checkpoint_blocks, solve_save_all
from remat_compiler.solvers.cpsat import OPTIONS as CPSAT_OPTIONS, solve_cpsat
from remat_compiler.solvers.greedy import solve_greedy
from remat_compiler.solvers.moe import solve_moe_cpsat, solve_moe_custom, solve_moe_fast, solve_moe_origin

__all__ = ["Strategy", "SOLVERS", "solve", "get_solver", "resolve_budget", "solve_save_all",
           "solve_checkpoint_blocks", "solve_cpsat", "solve_greedy", "chosen_combines"]


@dataclass(frozen=True)
class Strategy:
    """A solver and what it declares about itself.

    Attributes
    ----------
    name : str
    solve : callable
        ``solve(cost_graph, budget_bytes, **options) -> Plan``.
    options : frozenset of str, or None
        The options ``solve`` takes; any other is refused (None: whatever ``solve`` accepts, for a
        caller's own callable).
    prepare : callable, optional
        ``prepare(model)``, a context manager active while the step is traced, for a strategy that
        needs a different traced graph (the MoE custom backward traces the fused combine).
    accepts_policy : bool
        Whether a policy (:mod:`remat_compiler.policies`) can constrain it (it takes
        ``forced_saved`` and ``forbidden_saved``).
    searching : bool
        True for a search under the budget, False for a fixed rule (a hand-picked strategy, which
        has its own peak).
    """

    name: str
    solve: Callable[..., Plan]
    options: frozenset[str] | None = frozenset()
    prepare: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None
    accepts_policy: bool = False
    searching: bool = False

    def check_options(self, options: Mapping) -> None:
        """Raise ValueError for an option this solver does not take, naming those it does."""
        if self.options is None:
            return
        unknown = sorted(set(options) - self.options)
        if unknown:
            takes = ", ".join(sorted(self.options)) or "none"
            raise ValueError(f"solver {self.name!r} takes no option {', '.join(unknown)} "
                             f"(its options: {takes})")

    def options_in(self, options: Mapping) -> dict:
        """The options of ``options`` this solver takes, None values left out: one command line's
        options for every solver of a comparison."""
        return {k: v for k, v in options.items()
                if v is not None and (self.options is None or k in self.options)}

    def prepared(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The model as this solver traces it (unchanged if it has no ``prepare``)."""
        return self.prepare(model) if self.prepare is not None else contextlib.nullcontext()


SOLVERS: Mapping[str, Strategy] = MappingProxyType({s.name: s for s in [
    Strategy("cpsat", solve_cpsat, CPSAT_OPTIONS, accepts_policy=True, searching=True),
    Strategy("greedy", solve_greedy, frozenset({"time_limit_s"}), searching=True),
    Strategy("save_all", solve_save_all),
    Strategy("checkpoint_blocks", solve_checkpoint_blocks),
    Strategy("moe_origin", solve_moe_origin),
    Strategy("moe_fast", solve_moe_fast),
    Strategy("moe_custom", solve_moe_custom, prepare=fused_combine_mode),
    Strategy("moe_cpsat", solve_moe_cpsat, CPSAT_OPTIONS, prepare=fused_combine_mode, accepts_policy=True,
             searching=True),
]})


def get_solver(solver: str | Callable[..., Plan] | Strategy) -> Strategy:
    """Look a solver up by name, or take a :class:`Strategy` or a callable with the solver signature.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    if isinstance(solver, Strategy):
        return solver
    if callable(solver):
        return Strategy(getattr(solver, "__name__", "custom"), solver, options=None)
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; known solvers: {', '.join(sorted(SOLVERS))}, "
                         f"or pass a callable solve(cost_graph, budget_bytes, **opts) -> Plan")
    return SOLVERS[solver]


def resolve_budget(cg: CostGraph, budget: Budget) -> int | None:
    """A parsed budget in bytes for this graph (a fraction is of its no-recompute peak)."""
    if budget.fraction is None:
        return budget.bytes
    return budget.resolve(no_recompute(cg).peak_bytes)


def solve(cg: CostGraph, budget, solver: str | Callable[..., Plan] | Strategy = "cpsat", **options) -> Plan:
    """Resolve the budget (bytes, unit string, fraction, None or a :class:`Budget`) and run a solver:
    the pipeline's ``solve`` step.

    Raises
    ------
    ValueError
        For a budget that does not parse, an unknown solver, or an option the solver does not take.
    """
    strategy = get_solver(solver)
    strategy.check_options(options)
    parsed = budget if isinstance(budget, Budget) else parse_budget(budget)
    return strategy.solve(cg, resolve_budget(cg, parsed), **options)


def chosen_combines(modes: dict[str, str], saved, *, status: str, solve_time_s: float,
                    model_peak_bytes: int, flipped_peak_bytes: dict[str, int], gap: float = 0.0,
                    fraction_base_bytes: int | None = None, not_chosen: dict[str, str] | None = None,
                    flipped_recompute_s: dict[str, float] | None = None,
                    on_plan: Callable[[Plan], None] | None = None) -> Strategy:
    """The ``cpsat`` strategy that applies a choice already made by one solve over both MoE combines
    (:func:`remat_compiler.solvers.cpsat.choice.solve_choice`): it traces every MoE segment with
    its chosen combine (``prepare``, :func:`remat_compiler.moe.segments.segment_combines`) and
    makes the plan of the chosen saved set on that graph.

    Parameters
    ----------
    modes : dict of str to str
        Each segment's combine: every segment of the graph, those that were no choice
        (``not_chosen``) with the combine the model traces them with (``"fused"`` for a user's
        ``combine="fused"`` MoELayer, else ``"autograd"``).
    saved : iterable of str
        The saved forward values.
    status, gap, solve_time_s, model_peak_bytes :
        As the solve found them (the plan records them; ``check_plan`` holds the simulated peak to
        ``model_peak_bytes``).
    flipped_peak_bytes : dict of str to int
        Per segment, the simulated peak of the saved set with that segment's combine switched:
        ``plan.explain()`` says why each combine was chosen against it and the plan's simulated peak
        (:func:`~remat_compiler.solvers.cpsat.choice.reasons`).
    flipped_recompute_s : dict of str to float, optional
        Per segment, the estimated recompute time of the saved set with that segment switched
        (explain() compares it with the plan's too).
    fraction_base_bytes : int, optional
        What a fraction budget was a fraction of: the no-recompute peak of the graph as the model
        is (every combine autograd), not of the chosen graph. The plan records it
        (``extras["fraction_base_bytes"]``) so that applying it under the same fraction resolves
        the same budget (:func:`remat_compiler.api.decide`).
    not_chosen : dict of str to str, optional
        The segments that were no choice (they keep their combine), with why:
        ``plan.explain()`` says it.
    on_plan : callable, optional
        Called with the plan once it is made (a plan cache stores it).

    Returns
    -------
    Strategy
        Its ``solve(cg, budget_bytes)`` raises PlanMismatchError on a graph whose segments were
        traced with other combines.
    """
    from remat_compiler.solvers.cpsat.choice import reasons

    saved = list(saved)

    def solve(cg: CostGraph, budget_bytes: int | None) -> Plan:
        combine = moe_combine_of(cg)
        if {seg: c["mode"] for seg, c in combine.items()} != modes:
            raise PlanMismatchError(f"the graph's MoE combines {combine} are not the ones chosen, {modes}")
        fixed = not_chosen or {}
        sim = simulate(cg, build_schedule(cg, saved))
        why = reasons({s: m for s, m in modes.items() if s not in fixed}, sim.peak_bytes, flipped_peak_bytes,
                      sim.recompute_s, flipped_recompute_s)
        why.update({seg: f"no choice: {w}" for seg, w in fixed.items()})
        for seg, c in combine.items():
            c["why"] = why[seg]
        plan = make_plan(cg, saved, budget_bytes=budget_bytes, solver="cpsat", status=status, gap=gap,
                         solve_time_s=solve_time_s, model_peak_bytes=model_peak_bytes,
                         extras={"moe_combine": combine, **({} if fraction_base_bytes is None else
                                                            {"fraction_base_bytes": fraction_base_bytes})})
        if on_plan is not None:
            on_plan(plan)
        return plan
    return Strategy("cpsat", solve, prepare=lambda model: segment_combines(model, modes), searching=True)
