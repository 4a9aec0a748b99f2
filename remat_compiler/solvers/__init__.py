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
from remat_compiler.moe.layer import fused_combine_mode
from remat_compiler.plan import Plan
from remat_compiler.schedule import no_recompute
from remat_compiler.solvers.baselines import solve_checkpoint_blocks, solve_save_all
from remat_compiler.solvers.cpsat import OPTIONS as CPSAT_OPTIONS, solve_cpsat
from remat_compiler.solvers.greedy import solve_greedy
from remat_compiler.solvers.moe import solve_moe_cpsat, solve_moe_custom, solve_moe_fast, solve_moe_origin

__all__ = ["Strategy", "SOLVERS", "solve", "get_solver", "resolve_budget", "solve_save_all",
           "solve_checkpoint_blocks", "solve_cpsat", "solve_greedy"]


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
    """A parsed budget in bytes for this graph (a fraction is of its no-recompute peak; of the graph
    as traced, for a view of it such as :func:`remat_compiler.fusion.inductor_view`)."""
    if budget.fraction is None:
        return budget.bytes
    return budget.resolve(cg.g.graph.get("fraction_base_bytes") or no_recompute(cg).peak_bytes)


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
