"""What earlier solves on a graph found, kept for later solves by whoever owns the memo.

A sweep over budgets seeds each solve with every earlier plan that fits, so a larger budget never
starts from a worse plan than a smaller one's; the lowest-peak search reuses plans with reruns met
before; the block decomposition reuses its per-block menus, which do not depend on the budget.
Nothing here is process-wide: a :class:`SolveMemo` belongs to its owner (a ``CompiledModule``, a
sweep), and a solve given none starts from nothing, so its answer depends only on its arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat_compiler.graph import CostGraph

__all__ = ["SolveMemo"]


@dataclass
class SolveMemo:
    """Plans and block menus found on graphs, keyed by graph fingerprint, at most ``per_graph`` plans
    of each kind per graph.

    Attributes
    ----------
    plans : dict
        ``fingerprint -> [(saved set, simulated peak)]``: plans that recompute each value once.
    reruns : dict
        ``fingerprint -> [(saved set, reruns, simulated peak)]``: plans found below what CP-SAT's
        model reaches, recomputing some values more than once.
    menus : dict
        The block decomposition's per-block menus (:mod:`.blockbound`), by graph, objective and
        block.
    """

    per_graph: int = 32
    plans: dict[str, list[tuple[frozenset, int]]] = field(default_factory=dict)
    reruns: dict[str, list[tuple[frozenset, tuple, int]]] = field(default_factory=dict)
    menus: dict[tuple, object] = field(default_factory=dict)

    def remember(self, cg: CostGraph, saved, peak: int) -> None:
        """Keep a plan that recomputes each value once, with its simulated peak."""
        found = self.plans.setdefault(cg.fingerprint, [])
        found.append((frozenset(saved), peak))
        del found[:-self.per_graph]

    def remember_reruns(self, cg: CostGraph, saved, rerun, peak: int) -> None:
        """Keep a plan with reruns and its simulated peak."""
        found = self.reruns.setdefault(cg.fingerprint, [])
        found.append((frozenset(saved), tuple(rerun), peak))
        del found[:-self.per_graph]

    def fitting(self, cg: CostGraph, budget_bytes: int, complies) -> list[frozenset]:
        """Saved sets of earlier plans that peak within ``budget_bytes`` and satisfy ``complies``."""
        return [S for S, p in self.plans.get(cg.fingerprint, ()) if p <= budget_bytes and complies(S)]

    def lowest(self, cg: CostGraph, below: int, complies) -> tuple[int, frozenset] | None:
        """The lowest-peak earlier plan peaking below ``below``, as (peak, saved set), or None."""
        known = [(p, S) for S, p in self.plans.get(cg.fingerprint, ()) if p < below and complies(S)]
        return min(known, key=lambda k: k[0]) if known else None

    def rerun_plans(self, cg: CostGraph, complies, budget_bytes: int | None = None
                    ) -> list[tuple[int, frozenset, tuple]]:
        """Earlier plans with reruns as (peak, saved set, reruns), those within ``budget_bytes`` if
        given."""
        return [(p, S, R) for S, R, p in self.reruns.get(cg.fingerprint, ())
                if complies(S) and (budget_bytes is None or p <= budget_bytes)]
