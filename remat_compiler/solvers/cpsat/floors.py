"""The lowest-peak plans that infeasible-budget errors named, kept for the process (issue 33 item 8).

An :class:`~remat_compiler.errors.InfeasibleBudgetError` names the smallest feasible budget found in
its time limit. The plan that reached it was found by a time-limited search that a later search may
not find again (on a loaded machine, 16 of 1,947 random models were refused again at the budget their
first error named). So the plan is kept: the error carries it (``exc.plan``, which ``plan=`` applies),
and :data:`FOUND` keeps it by graph fingerprint, so that a later
:func:`~remat_compiler.solvers.cpsat.solve_cpsat` on the same graph starts from it (it enters the
solve's memo, whose plans the warm start and the floor search use): a budget at least its peak
always has a plan. A deterministic solve does not read it (its plan is of the arguments alone).

>>> try:                                                            # doctest: +SKIP
...     rc.compile(model, memory_budget=1)(x)
... except rc.InfeasibleBudgetError as exc:
...     m = rc.compile(model, memory_budget=exc.min_feasible_bytes)  # found again, from FOUND
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from remat_compiler.graph import CostGraph
from remat_compiler.solvers.cpsat.memo import SolveMemo

__all__ = ["FoundFloors", "FOUND"]


@dataclass
class FoundFloors:
    """Per graph fingerprint, the lowest-peak plans errors named: ``(saved, reruns, peak)``, at most
    ``per_graph`` each (the lowest kept), for at most ``graphs`` graphs (the least recently named
    dropped)."""

    graphs: int = 64
    per_graph: int = 4
    found: OrderedDict = field(default_factory=OrderedDict)

    def record(self, cg: CostGraph, saved, rerun, peak: int) -> None:
        """Keep a plan an error names."""
        plans = self.found.pop(cg.fingerprint, [])
        entry = (frozenset(saved), tuple(tuple(r) for r in rerun), int(peak))
        if entry not in plans:
            plans.append(entry)
        plans.sort(key=lambda e: e[2])
        self.found[cg.fingerprint] = plans[:self.per_graph]
        while len(self.found) > self.graphs:
            self.found.popitem(last=False)

    def offer(self, cg: CostGraph, memo: SolveMemo) -> None:
        """Put the plans kept for ``cg`` into a solve's memo (the memo's own rules then decide
        whether they fit its budget and constraints)."""
        for saved, rerun, peak in self.found.get(cg.fingerprint, ()):
            if rerun:
                memo.remember_reruns(cg, saved, list(rerun), peak)
            else:
                memo.remember(cg, saved, peak)


#: The process's kept floors.
FOUND = FoundFloors()
