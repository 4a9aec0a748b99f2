"""Plans a sharded step's solve starts from: FSDP2's own settings, as known plans in the solve's memo.

On a large sharded step (Mistral-70B on 8 ranks) CP-SAT's warm starts and its lowest-peak search
start from plans that keep every unit gathered, and within the time limit do not reach the plans
that gather units again; so a budget that only re-gathering meets was called infeasible. The plans
FSDP2 users run by hand are good starting points: every unit gathered again in backward
(``reshard_after_forward=True``), with and without activation checkpointing of every block.
:class:`FSDPSeeds` is a :class:`~remat_compiler.solvers.cpsat.memo.SolveMemo` that knows them for
each sharded graph it is asked about, so the solve's warm start (plans that fit) and its
lowest-peak search (the lowest plan known) see them beside their own; the solve decides the rest
(which units to keep after all, what to recompute), and every plan is checked as any other.

>>> memo = FSDPSeeds(unit_params=(9, 9, 3))                     # doctest: +SKIP
>>> remat_compiler.solve(cg, "70GiB", "cpsat", memo=memo)       # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat_compiler.fsdp.choices import unit_values
from remat_compiler.graph import CostGraph, block_boundary_set
from remat_compiler.schedule import peak_of, save_all_set
from remat_compiler.solvers.cpsat.memo import SolveMemo

__all__ = ["FSDPSeeds", "seed_sets"]


def seed_sets(cg: CostGraph, unit_params) -> list[frozenset]:
    """The saved sets of FSDP2's re-gathering settings on a sharded step's graph: every unit's
    parameter values freed after forward and gathered again, the activations all kept, and (where
    the model has repeated blocks) only the blocks' outputs kept (checkpointing every block)."""
    per_unit = unit_values(cg, list(unit_params))
    values = set().union(*(u["values"] for u in per_unit)) if per_unit else set()
    if not any(u["gather"] for u in per_unit):
        return []
    sets = [frozenset(v for v in save_all_set(cg) if v not in values)]
    blocks = block_boundary_set(cg)
    if blocks is not None:
        sets.append(frozenset(v for v in blocks if v not in values))
    return sets


@dataclass
class FSDPSeeds(SolveMemo):
    """A solve memo that also holds, for each sharded graph it is asked about, the plans of
    :func:`seed_sets` with their simulated peaks (``unit_params``: the number of shard inputs of
    each unit, in :class:`~remat_compiler.fsdp.step.ShardedStep`'s order)."""

    unit_params: tuple = ()
    seeded: set = field(default_factory=set)

    def _seed(self, cg: CostGraph) -> None:
        if cg.fingerprint in self.seeded or not self.unit_params:
            return
        self.seeded.add(cg.fingerprint)
        for saved in seed_sets(cg, self.unit_params):
            self.remember(cg, saved, peak_of(cg, saved))

    def fitting(self, cg: CostGraph, budget_bytes: int, complies) -> list[frozenset]:
        self._seed(cg)
        return super().fitting(cg, budget_bytes, complies)

    def lowest(self, cg: CostGraph, below: int, complies):
        self._seed(cg)
        return super().lowest(cg, below, complies)
