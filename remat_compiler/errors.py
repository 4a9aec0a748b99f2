"""Errors raised by remat_compiler, each saying what is wrong and what to do."""
from __future__ import annotations

__all__ = ["RematError", "InfeasibleBudgetError", "StrategyOverBudgetError", "StrategyNotApplicableError",
           "UntraceableModelError", "PlanMismatchError", "PlanCheckError", "ExpertCapacityError",
           "UnsupportedShardingError"]


class RematError(Exception):
    """Base class of every error remat_compiler raises on purpose."""


class InfeasibleBudgetError(RematError, ValueError):
    """The memory budget is below the smallest peak any plan can reach.

    Attributes
    ----------
    budget_bytes : int
        The budget that was asked for.
    min_feasible_bytes : int
        The smallest step peak a plan reaches on this graph; a budget at least this large works.
    proven : bool
        Whether that smallest peak is proven minimal (else it is the best the solver found in time,
        and a smaller budget may still be feasible).
    plan : Plan or None
        The plan that reaches ``min_feasible_bytes``, where the solver found one:
        ``compile(model, memory_budget=exc.min_feasible_bytes, plan=exc.plan)`` applies it. A new
        time-limited search may not find that plan again (on a loaded machine, 16 of 1,947 random
        models were refused again at the budget their first error named), so the message advises
        it whenever the error has it.
    """

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, proven: bool = True,
                 advice: str = "or a larger time_limit_s to search further", plan=None):
        from remat_compiler.budget import human_bytes

        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        self.proven = bool(proven)
        self.plan = plan
        if proven:
            super().__init__(
                f"memory budget {budget_bytes} bytes ({human_bytes(budget_bytes)}) is infeasible: the "
                f"smallest feasible budget for this model and input is {min_feasible_bytes} bytes "
                f"({human_bytes(min_feasible_bytes)}); pass memory_budget >= {min_feasible_bytes}")
        else:
            super().__init__(
                f"no plan found under memory budget {budget_bytes} bytes ({human_bytes(budget_bytes)}) "
                f"within the time limit: the smallest feasible budget found is {min_feasible_bytes} "
                f"bytes ({human_bytes(min_feasible_bytes)}), not proven minimal; pass memory_budget >= "
                f"{min_feasible_bytes}, {advice}")
        if plan is not None:
            self.args = (self.args[0] + f"; the plan found at {min_feasible_bytes} bytes is the error's .plan: "
                         f"pass memory_budget={min_feasible_bytes}, plan=exc.plan to apply it (a new search may "
                         "not find it again in its time limit)",)

    def account(self, *, exact: bool = False) -> str:
        """``needs >= X`` where that is proven, else that no plan was found in the time limit, and the
        lowest peak found (not proven minimal: a smaller budget may still have a plan); ``exact`` adds
        the byte count to X."""
        from remat_compiler.budget import human_bytes

        need = human_bytes(self.min_feasible_bytes)
        if exact:
            need += f" ({self.min_feasible_bytes} bytes)"
        if self.proven:
            return f"needs >= {need}"
        return f"no plan found: the lowest peak found is {need}, not proven minimal"

    @property
    def summary(self) -> str:
        """A table cell's account: ``infeasible: needs >= X`` where that is proven, else :meth:`account`'s."""
        return f"infeasible: {self.account()}" if self.proven else self.account()


class StrategyOverBudgetError(InfeasibleBudgetError):
    """A hand-picked strategy's fixed plan peaks above the budget."""

    def __init__(self, name: str, budget_bytes: int, peak_bytes: int):
        super().__init__(budget_bytes, peak_bytes)
        self.args = (f"strategy {name} peaks at {peak_bytes} bytes, above the budget {budget_bytes}; "
                     f"its smallest feasible budget is {peak_bytes} bytes (use solver='cpsat' to "
                     f"search all plans)",)


class StrategyNotApplicableError(RematError, ValueError):
    """A hand-picked strategy's rule does not apply to this model (no repeated blocks, no MoE
    segment...); the message says which solver to use instead."""


class UntraceableModelError(RematError):
    """The model's forward and backward could not be captured as a graph."""


class PlanMismatchError(RematError, ValueError):
    """A saved plan was made for a different graph than the one it is applied to."""


class ExpertCapacityError(RematError, ValueError):
    """A dropless MoE step routed more rows to an expert than the capacity its buffers (and the plan
    made for them) hold. Raised on every rank alike, before any row is exchanged; the message names
    the expert, its rows, the capacity and the ``capacity_factor`` that fits."""


class PlanCheckError(RematError, AssertionError):
    """A plan disagrees with the liveness simulator, or the code emitted for it does not peak where
    it says (a solver, simulator or codegen bug, never a user error)."""


class UnsupportedShardingError(RematError, ValueError):
    """An FSDP2 model sharded in a way the compiled step does not reproduce (HSDP or a 2-D mesh,
    parameters outside every ``fully_shard`` unit, units over different process groups, CPU
    offload...), or compiled in the wrong order (``fully_shard(compile(m))``). The message names
    what is unsupported and what to do (:mod:`remat_compiler.fsdp`)."""
