"""The MoE combine choice as a record: what it decided, applied by name where the plan is made.

The default solver chooses each MoE segment's combine (autograd or fused) together with the saved set in
one CP-SAT solve over both traces (:func:`remat_compiler.solvers.cpsat.choice.solve_choice`, run by
:mod:`remat_compiler.combines` before the step is traced for its plan). What it decided is a
:class:`CombineChoice`, carried by the plan's spec (``PlanSpec.combines``) and applied by
:func:`remat_compiler.pipeline.decide`, one named step at a time:

- ``modes``: every segment is traced with its chosen combine (:meth:`CombineChoice.prepared`);
- ``saved``: the plan is the chosen saved set on that graph (:meth:`CombineChoice.plan`), no search;
  a rank other than 0 has the modes but not the saved set, and runs rank 0's plan;
- ``why``: where no choice was made (no segment could be chosen for, or the one solve found no plan),
  the model is planned as it traces and each segment's plan entry says why (:meth:`CombineChoice.explained`);
- ``store``: where a plan cache was given, the chosen plan is stored under the choice's key.

Nothing here wraps a solver's function: the record is data, and :func:`~remat_compiler.pipeline.decide`
reads it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from remat_compiler.errors import PlanMismatchError
from remat_compiler.graph import CostGraph
from remat_compiler.moe.segments import segment_combines
from remat_compiler.plan import Plan, make_plan, moe_combine_of
from remat_compiler.schedule import build_schedule, simulate
from remat_compiler.solvers.cpsat.choice.reasons import reasons

__all__ = ["CombineChoice"]


@dataclass(frozen=True)
class CombineChoice:
    """What the MoE combine choice decided for one step.

    Attributes
    ----------
    modes : mapping of str to str, optional
        Each segment's combine, every segment of the graph (those that were no choice with the combine
        the model traces them with). None: the model is traced as it is.
    saved : tuple of str, optional
        The chosen saved forward values. None with ``modes``: chosen on rank 0, whose plan this rank
        runs (it never plans itself).
    status, gap, solve_time_s, model_peak_bytes :
        As the solve found them (the plan records them; ``check_plan`` holds the simulated peak to
        ``model_peak_bytes``).
    flipped_peak_bytes : mapping of str to int
        Per segment, the simulated peak of the saved set with that segment's combine switched:
        ``plan.explain()`` says why each combine was chosen against it
        (:func:`~remat_compiler.solvers.cpsat.choice.reasons.reasons`).
    flipped_recompute_s : mapping of str to float, optional
        Per segment, the estimated recompute time of the saved set with that segment switched.
    not_chosen : mapping of str to str
        The segments that were no choice (they keep their combine), with why.
    fraction_base_bytes : int, optional
        What a fraction budget was a fraction of: the no-recompute peak of the graph as the model is
        (every combine autograd). The plan records it (``extras["fraction_base_bytes"]``) so that
        applying it under the same fraction resolves the same budget.
    why : str or mapping of str to str, optional
        Where no choice was made (the model is planned as it traces): why, for every segment or per
        segment; each plan entry of ``extras["moe_combine"]`` records it (explain() prints it).
    store : tuple, optional
        ``(plan_cache, key, fields)``: store the chosen plan there once it is made.
    tolerance : float
        The ``tolerance`` the choice's solve stopped within (the plan records it where above 0).

    Example
    -------
    >>> choice = CombineChoice(why="no choice: built with combine='fused'")   # doctest: +SKIP
    >>> plan = choice.explained(plan)                                          # doctest: +SKIP
    """

    modes: Mapping[str, str] | None = None
    saved: tuple[str, ...] | None = None
    status: str = ""
    gap: float = 0.0
    solve_time_s: float = 0.0
    model_peak_bytes: int | None = None
    flipped_peak_bytes: Mapping[str, int] = field(default_factory=dict)
    flipped_recompute_s: Mapping[str, float] | None = None
    not_chosen: Mapping[str, str] = field(default_factory=dict)
    fraction_base_bytes: int | None = None
    why: str | Mapping[str, str] | None = None
    store: tuple[Any, str, dict] | None = None
    tolerance: float = 0.0

    @property
    def chosen(self) -> bool:
        """Whether the combines were chosen (the plan is the choice's, on this rank or rank 0)."""
        return self.modes is not None

    def prepared(self, model: torch.nn.Module) -> contextlib.AbstractContextManager:
        """The model traced with the chosen combines (unchanged where none was chosen)."""
        if self.modes is None:
            return contextlib.nullcontext()
        return segment_combines(model, dict(self.modes))

    def plan(self, cg: CostGraph, budget_bytes: int | None) -> Plan:
        """The plan of the chosen saved set on ``cg``, the step traced with the chosen combines.

        Raises
        ------
        PlanMismatchError
            On a graph whose segments were traced with other combines.
        RuntimeError
            On a rank other than 0 (which runs rank 0's plan and never plans the choice itself).
        """
        if self.saved is None:
            raise RuntimeError("under torch.distributed only rank 0 plans the chosen combines")
        modes = dict(self.modes)
        combine = moe_combine_of(cg)
        if {seg: c["mode"] for seg, c in combine.items()} != modes:
            raise PlanMismatchError(f"the graph's MoE combines {combine} are not the ones chosen, {modes}")
        candidates = set(cg.candidates)  # on Inductor's view of the graph, what its code never writes is none
        saved = [v for v in self.saved if v in candidates]
        sim = simulate(cg, build_schedule(cg, saved))
        why = reasons({s: m for s, m in modes.items() if s not in self.not_chosen}, sim.peak_bytes,
                      dict(self.flipped_peak_bytes), sim.recompute_s,
                      None if self.flipped_recompute_s is None else dict(self.flipped_recompute_s))
        why.update({seg: f"no choice: {w}" for seg, w in self.not_chosen.items()})
        for seg, c in combine.items():
            c["why"] = why[seg]
        base = {} if self.fraction_base_bytes is None else {"fraction_base_bytes": self.fraction_base_bytes}
        if self.tolerance > 0:
            base["tolerance"] = self.tolerance
        return make_plan(cg, saved, budget_bytes=budget_bytes, solver="cpsat", status=self.status, gap=self.gap,
                         solve_time_s=self.solve_time_s, model_peak_bytes=self.model_peak_bytes,
                         extras={"moe_combine": combine, **base})

    def explained(self, plan: Plan) -> Plan:
        """``plan`` (of the model as it traces), each MoE segment's entry saying why its combine was not
        chosen (``extras["moe_combine"][seg]["why"]``, kept where the plan says already)."""
        if self.why is None:
            return plan
        for seg, c in plan.extras.get("moe_combine", {}).items():
            reason = self.why if isinstance(self.why, str) else self.why.get(seg)
            if reason is not None:
                c.setdefault("why", reason)
        return plan
