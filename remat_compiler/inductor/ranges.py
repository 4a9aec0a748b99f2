"""The Inductor backend over a range of shapes (``compile(..., max_seq_len=, backend="inductor")``):
one plan, made at the bound (:mod:`remat_compiler.dynamic`), compiled by Inductor once over the
symbolic sizes, so that every length in the range runs the same code.

Inductor's wrappers then take the sizes as arguments and allocate ``empty_strided((s0, s1, 64), ...)``.
The walk of that code (:func:`~remat_compiler.inductor.walk.compiled_peak`) reads each size at the
bound, where every buffer is largest, and is held to the budget before anything runs: every size
expression Inductor allocates with must be provably non-decreasing in each symbol
(:func:`~remat_compiler.dynamic.monotone`), as the emitted graphs' values are, and Inductor's own
guards join the ShapeEnv's conditions, checked at the bound, at the first call and on every call.
The first real step is checked against the walk at its own sizes: a walk that missed bytes there
proves nothing at the bound, and the next call gives the range up.

Where the walk at the bound peaks above the budget, the range is planned again (its one capture
partitioned and compiled again, not traced again), as the backend does on one shape: first, where
its code had horizontal fusion in it, under the same budget compiled without that; then under a
budget lowered by the overshoot, or at the leanest plan's peak where that lower budget has no plan
(:data:`~remat_compiler.inductor.backend.INDUCTOR_REPLANS` times). Where that does
not get under it, where Inductor cannot compile the symbolic graphs or its code cannot be read, or a
size is not provably monotone, the range is given up (:class:`~remat_compiler.dynamic.DynamicShapeError`):
each shape is then planned and compiled on its own, with the one-shape backend's re-plans and fallback.
"""
from __future__ import annotations

import dataclasses

import torch

import remat_compiler.inductor as inductor
from remat_compiler.dynamic import DynamicShapeError, ShapeRange, monotone, trace_and_run_range
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.inductor.backend import (INDUCTOR_REPLANS, InductorState, first_step_report, fusing,
                                             in_order_next, inductor_facts, lowered, replan_after)
from remat_compiler.inductor import warm
from remat_compiler.inductor.compile import InductorCompilers
from remat_compiler.inductor.graph import CompiledOverBudget, UnreadableCodeError
from remat_compiler.inductor.walk import symbolic_sizes
from remat_compiler.pipeline import PlanSpec
from remat_compiler.runtime import distributed
from remat_compiler.trace import aot_logs_wanted
from remat_compiler.trace.again import aot_step_again

__all__ = ["first_call_range", "InductorRange"]


def first_call_range(module, entry, inputs: list[torch.Tensor]):
    """A compiled module's first call of a range entry under Inductor: trace once with symbolic
    sizes, plan at the bound, compile, and re-plan lower while the walk of the code at the bound
    peaks above the budget; the forward's outputs.

    Raises
    ------
    DynamicShapeError
        Where the range cannot be served by one compiled plan (see the module docstring); under
        torch.distributed (the ranks would decide apart: each shape is planned on its own, rank 0
        planning for all); after a first step of the range's code measured above the budget (this
        call is then the next one: the shape is planned on its own, lower).
    InfeasibleBudgetError, UntraceableModelError
        As on one shape: no plan fits the budget at the bound; the model cannot be traced.
    """
    from torch._inductor.exc import InductorError

    if distributed():
        raise DynamicShapeError("under torch.distributed the Inductor backend plans each shape on its own")
    if entry.inductor is not None and entry.inductor.over is not None:
        raise DynamicShapeError("the first step of Inductor's code for the range's plan measured above the "
                                "budget")
    warm.start()  # Inductor's probe of the CPU, beside the trace and the solve
    entry.inductor = entry.inductor or InductorState()
    try:
        return trace_and_run_range(module, entry, inputs, InductorRange())
    except (UnreadableCodeError, InductorError) as exc:
        raise DynamicShapeError(f"Inductor's code over symbolic sizes could not be made or read ({exc})") from exc


@dataclasses.dataclass
class InductorRange:
    """How :func:`~remat_compiler.dynamic.trace_and_run_range` plans, compiles and accepts a range's
    step under Inductor. ``planning_bytes``: the lower budget a re-plan plans under (None: the
    budget's own); the code is held to the budget's own either way. The step is captured once;
    where the walk of a plan's code at the bound peaks above the budget (or the lower budget has no
    plan), its joint graph is partitioned and compiled again (:func:`~remat_compiler.trace.again.aot_step_again`)
    under :func:`~remat_compiler.inductor.backend.replan_after`'s budget, up to
    :data:`~remat_compiler.inductor.backend.INDUCTOR_REPLANS` times."""

    planning_bytes: int | None = None
    compilers: InductorCompilers | None = None
    replans: int = 0
    over_at: int | None = None  # the lowest planning budget whose code peaked above the budget
    why: str = ""  # why the last try failed

    def planning(self, spec: PlanSpec) -> PlanSpec:
        """The spec to plan with: the fused recompute of the Inductor backend, lowered on a re-plan.
        A range plans on the graph as traced, not on Inductor's view of it: Inductor's code over
        symbolic sizes writes values the view has inlined (on the zoo Llama of
        tests/test_dynamic_lengths.py at 0.7, the first code walked 347,272 bytes at the bound
        against a 332,063-byte budget, and the range took three compiles instead of one)."""
        spec = fusing(spec, memory=False)
        return spec if self.planning_bytes is None else lowered(spec, self.planning_bytes)

    def step(self, entry, spec: PlanSpec, rng: ShapeRange, partition):
        """The step wrapped in AOTAutograd with Inductor's compilers, walked at the bound, partitioned
        and compiled again (not traced again) under a lower budget while its code peaks above the budget."""
        def facts():
            at, first = ({str(s): v for s, v in values.items()} for values in (rng.at_bound(), rng.first))
            return dataclasses.replace(inductor_facts(entry.planned, spec.budget), at=at, first_at=first)

        def attempt(in_order: bool = False) -> tuple:
            report = first_step_report(entry, spec, 0, walk_relied_on=True)
            self.compilers = InductorCompilers(facts, report, on_fakes=True, in_order=in_order)
            return partition, self.compilers.forward, self.compilers.backward

        first, fw_compiler, bw_compiler = attempt()
        return aot_step_again(entry.step, first, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                              decompositions=inductor.DECOMPOSITIONS, again=lambda exc: self.again(exc, attempt),
                              errors=(CompiledOverBudget, InfeasibleBudgetError), enable_log=aot_logs_wanted())

    def again(self, exc: CompiledOverBudget | InfeasibleBudgetError, attempt) -> tuple:
        """After a try whose code peaked above the budget (or whose lower budget had no plan): the
        next try's ``attempt()``: the first time code with horizontal fusion in it overshoots, planned
        under the same budget and compiled without Inductor's horizontal fusion
        (:func:`~remat_compiler.inductor.compile.in_plan_order`); then planning under the budget the
        re-plan rule gives.

        Raises
        ------
        DynamicShapeError
            After :data:`INDUCTOR_REPLANS` re-plans, or where no lower budget is left to try.
        InfeasibleBudgetError
            The user's own budget has no plan at the bound (re-raised)."""
        if in_order_next(exc, self.compilers):
            return attempt(in_order=True)
        self.planning_bytes, self.over_at, self.why = replan_after(exc, self.over_at)
        if self.planning_bytes is None or self.replans == INDUCTOR_REPLANS:
            raise DynamicShapeError(f"Inductor's code for the range's plan does not keep the budget at the "
                                    f"bound, after up to {INDUCTOR_REPLANS} re-plans: {self.why}") from exc
        self.replans += 1
        return attempt(in_order=self.compilers.in_order)

    def accept(self, entry, rng: ShapeRange) -> None:
        """Record the code on the entry once its sizes are non-decreasing in each symbol and the
        ShapeEnv's conditions, Inductor's guards among them, hold at the bound and at the first call."""
        fw, bw = self.compilers.fw, self.compilers.bw
        for graph in (fw, bw):
            for expr in symbolic_sizes(graph):
                if not monotone(expr):
                    raise DynamicShapeError(f"Inductor's code allocates a buffer of size {expr}, not provably "
                                            f"non-decreasing in the length")
        rng.require("Inductor's code for the plan")
        fw.on_fakes = None  # compiled: the calls from now on are real ones
        self.compilers.record(entry.planned)
