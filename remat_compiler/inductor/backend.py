"""The Inductor backend's first call of a compiled module: plan with fused recompute, compile, walk the
code, re-plan lower while the code peaks above the budget, and measure the first step it runs.

:func:`first_call` is what :class:`remat_compiler.module.CompiledModule` runs on its first call with
``backend="inductor"``; the plan is made by the same pipeline (:func:`remat_compiler.pipeline.plan_joint`)
with ``fused_recompute`` set (:func:`fusing`), and AOTAutograd's compilers are
:class:`~remat_compiler.inductor.compile.InductorCompilers`.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import remat_compiler.inductor as inductor
from remat_compiler.budget import Budget, parse_budget
from remat_compiler.emitted import EmittedPeak
from remat_compiler.errors import InfeasibleBudgetError
from remat_compiler.fusion import INDUCTOR_MEMORY
from remat_compiler.inductor.compile import InductorCompilers, StepFacts
from remat_compiler.inductor import warm
from remat_compiler.inductor.graph import CompiledOverBudget, UnreadableCodeError
from remat_compiler.pipeline import PlannedGraph, PlanSpec
from remat_compiler.runtime import distributed
from remat_compiler.solvers import resolve_budget
from remat_compiler.trace import aot_logs_wanted, run_traced
from remat_compiler.trace.again import aot_step_again

__all__ = ["first_call", "in_order_next", "in_plan_order_again", "fusing", "lowered", "replan_after", "inductor_facts",
           "first_step_report", "InductorState", "INDUCTOR_REPLANS", "MEASURED_REPLANS"]


#: How many times the Inductor backend re-plans under a lower budget when Inductor's code for a plan
#: peaks above the budget, before it runs the eager backend's plan instead.
INDUCTOR_REPLANS = 3
#: How many times it re-plans after a first step measured above the budget (the walk missed
#: something) before the next call runs the eager backend's plan instead.
MEASURED_REPLANS = 1


@dataclass
class InductorState:
    """What the backend keeps of one traced entry between its calls.

    Attributes
    ----------
    over : tuple, optional
        Set when the first step of its code measured above the budget: the next trace's (planning
        budget, walk margin, overshot plan peak); the compiled module then traces the signature again.
    replan : tuple, optional
        This trace's, from the entry it replaces (that entry's ``over``).
    measured_replans : int
        Re-plans made after a first step measured above the budget.
    """

    over: tuple | None = None
    replan: tuple | None = None
    measured_replans: int = 0

    @classmethod
    def after(cls, previous: "InductorState | None") -> "InductorState":
        """The state of a new trace of the step, after ``previous`` (None: the first trace)."""
        if previous is None:
            return cls()
        return cls(replan=previous.over, measured_replans=previous.measured_replans + 1)


def fusing(spec: PlanSpec, memory: bool = True) -> PlanSpec:
    """``spec`` for the Inductor backend: a searching solver's plans recompute the pointwise values
    Inductor fuses into their readers instead of saving them (``fused_recompute``,
    :func:`remat_compiler.pipeline.fuse_recompute`) and, with ``memory``, are made on the graph as
    Inductor's code allocates it (``inductor_memory``, :func:`remat_compiler.fusion.inductor_view`).
    A hand-picked strategy (whose saved set is its definition) plans on the graph as traced; a given
    plan on the graph it was made on (its ``memory_model``)."""
    if spec.plan is not None:
        made_for_inductor = spec.plan.extras.get("memory_model") == INDUCTOR_MEMORY
        return dataclasses.replace(spec, inductor_memory=made_for_inductor)
    if not spec.strategy.searching:
        return spec
    return dataclasses.replace(spec, fused_recompute=True, inductor_memory=memory)


def inductor_facts(planned: PlannedGraph, budget: Budget, margin_bytes: int = 0) -> StepFacts:
    """What :class:`remat_compiler.inductor.InductorCompilers` reads of the plan just made, and the
    budget the walk of its code must keep, in bytes: less ``margin_bytes``, what a walk was found to
    miss on this step."""
    cg = planned.cg
    limit = resolve_budget(cg, budget)
    return StepFacts(planned.bw, len(cg.fw_outputs), tuple(cg.g.graph.get("input_updates", ())),
                     cg.hold_outputs, planned.plan.peak_bytes,
                     None if limit is None else limit - margin_bytes, cg.allocator)


def first_call(entry, spec: PlanSpec, model: torch.nn.Module, inputs: list[torch.Tensor], *,
               partition: Callable[[PlanSpec], Callable], eager: Callable[[], Any]):
    """The Inductor backend's first call of a compiled module's entry: plan, compile, and where
    Inductor's code peaks above the budget compile the same plan without horizontal fusion
    (:func:`in_plan_order_again`), then re-plan under a lower budget while it still does; after
    :data:`INDUCTOR_REPLANS` re-plans, or when its code cannot be read, run the eager backend's plan
    instead, with a warning.

    Each re-plan lowers the planning budget by what Inductor's code overshot. Where that lower
    budget has no plan, the next try plans at the smallest peak the solve found instead (between
    the infeasible budget and the last one whose code overshot): Inductor's code for the leanest
    plan can still fit the budget even though the overshoot rule asked for less.

    The code accepted is measured on its first step (:func:`first_step_report`). Where that
    measured above the budget, this call is the next one (``entry.inductor.replan``): it plans under
    the budget lowered by the overshoot, holding the walk of the new code below the budget by what
    the old walk missed; after :data:`MEASURED_REPLANS` such re-plans it runs the eager backend's
    plan, with a warning.

    Parameters
    ----------
    entry : remat_compiler.module._Entry
        The entry traced: its step, and where its function, plan and backend state go.
    spec : PlanSpec
        The compiled module's spec (its budget is the one the code must keep).
    model : torch.nn.Module
        The model, run on ``inputs`` (its state tensors and the call's tensors).
    partition : callable
        ``partition(spec)``: AOTAutograd's partition function planning the entry under ``spec``.
    eager : callable
        Runs the eager backend's first call instead (the fallback).

    Returns
    -------
    The forward's outputs.
    """
    warm.start()  # Inductor's probe of the CPU, beside the trace and the solve
    state = entry.inductor = InductorState.after(entry.inductor)
    planning, why = fusing(spec), None
    over_at = None  # the lowest planning budget whose Inductor code peaked above the budget
    margin = 0  # bytes a walk of this step's code was found to miss (its first step measured)
    tries = INDUCTOR_REPLANS + 1
    if state.replan is not None:
        lower, margin, over_at = state.replan
        planning = lowered(planning, lower)
        if state.measured_replans > MEASURED_REPLANS:
            why, tries = "the first step of its re-planned code measured above the budget again", 0
    compilers: InductorCompilers | None = None  # the try's

    def attempt(planned_as: PlanSpec, in_order: bool = False) -> tuple:
        """The partition function and compilers of a try planning under ``planned_as`` (compiled
        without horizontal fusion ``in_order``)."""
        nonlocal compilers
        compilers = InductorCompilers(lambda: inductor_facts(entry.planned, spec.budget, margin),
                                      first_step_report(entry, spec, margin), in_order=in_order)
        return partition(planned_as), compilers.forward, compilers.backward

    def again(exc: CompiledOverBudget | InfeasibleBudgetError) -> tuple:
        """The next try, on the step traced once: the same plan compiled in its own order where its
        code overshot with Inductor's horizontal fusion in it, else planning lower by what it overshot
        (compiled in order from then on once a try was)."""
        nonlocal planning, over_at, why, tries
        if in_order_next(exc, compilers):
            return in_plan_order_again(entry, planning, lambda same: attempt(same, in_order=True))
        lower, over_at, why = replan_after(exc, over_at)
        tries -= 1
        if lower is None or tries <= 0:
            raise _GiveUp from exc
        planning = lowered(planning, lower)
        return attempt(planning, in_order=compilers.in_order)

    if tries > 0:
        partition_fn, fw_compiler, bw_compiler = attempt(planning)
        entry.fn = aot_step_again(entry.step, partition_fn, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                                  decompositions=inductor.DECOMPOSITIONS, again=again,
                                  errors=(CompiledOverBudget, InfeasibleBudgetError), enable_log=aot_logs_wanted())
        try:
            with spec.prepared(model):
                out = run_traced(entry.fn, model, inputs, entry.step)
        except _GiveUp:
            pass
        except UnreadableCodeError as exc:
            why = f"its generated code could not be read ({exc})"
        else:
            compilers.record(entry.planned)
            return out
    warnings.warn(f"backend='inductor' cannot keep this step under its budget: {why}. It runs the "
                  f"eager backend's plan instead (exact, slower)", RuntimeWarning, stacklevel=5)
    return eager()


def in_order_next(exc: Exception, compilers: InductorCompilers) -> bool:
    """Whether the try after ``exc`` (raised by the try ``compilers`` compiled) compiles under the same
    budget without Inductor's horizontal fusion: its code peaked above the budget, with horizontal
    fusion in it (:func:`remat_compiler.inductor.compile.in_plan_order`). Both of the backend's loops,
    one shape and a range of shapes, follow it."""
    return isinstance(exc, CompiledOverBudget) and not compilers.in_order and compilers.fused_horizontally


def in_plan_order_again(entry, planning: PlanSpec, attempt: Callable[[PlanSpec], tuple]) -> tuple:
    """The try after code that peaked above the budget with Inductor's horizontal fusion
    (:func:`in_order_next`): the plan just made (``entry.planned``), not solved again, compiled
    without horizontal fusion (``attempt`` makes the compilers so), its source kept. Where that code
    still peaks above the budget, the tries after it plan lower."""
    made = entry.planned
    partition_fn, fw_compiler, bw_compiler = attempt(dataclasses.replace(planning, plan=made.plan))

    def partition_again(*args, **kwargs):
        graphs = partition_fn(*args, **kwargs)
        entry.planned.source = made.source  # "given" by this try; made by the one before
        return graphs
    return partition_again, fw_compiler, bw_compiler


class _GiveUp(Exception):
    """No try is left, or no lower budget has a plan: the eager backend's plan runs instead."""


def replan_after(exc: CompiledOverBudget | InfeasibleBudgetError, over_at: int | None
                 ) -> tuple[int | None, int, str]:
    """The re-plan rule of the backend's loops (one shape, and a range of shapes): after code that
    peaks above the budget, the next planning budget is the lower of the budget and the plan's peak,
    less the overshoot; where that lower budget has no plan, the leanest plan's peak, unless that
    peaks where a plan's code already overshot (``over_at``, the lowest such planning budget).
    Returns (the next planning budget, None: stop; the new ``over_at``; why the last try failed).
    Re-raises an InfeasibleBudgetError of the user's own budget (no ``over_at`` yet): no plan at all."""
    if isinstance(exc, CompiledOverBudget):
        over_at = min(exc.limit_bytes, exc.plan_peak_bytes)
        return over_at - (exc.peak.peak_bytes - exc.limit_bytes), over_at, str(exc)
    if over_at is None:
        raise exc
    why = f"a plan under the lower budget its code needs does not exist ({exc})"
    return (None if exc.min_feasible_bytes >= over_at else exc.min_feasible_bytes), over_at, why


def lowered(spec: PlanSpec, budget_bytes: float) -> PlanSpec:
    """``spec`` re-planning under ``budget_bytes`` (1 byte at least), solved afresh (no given or cached plan)."""
    return dataclasses.replace(spec, budget=parse_budget(max(int(budget_bytes), 1)), plan=None, plan_cache=None)


def first_step_report(entry, spec: PlanSpec, margin: int, *, walk_relied_on: bool = False
                      ) -> Callable[[int, int, EmittedPeak], None]:
    """What to do with the measured peak of the first step of this entry's Inductor code
    (:class:`remat_compiler.inductor.FirstStepCheck`), given the walk of the code at that step's
    sizes: record it and, above ``spec``'s budget, warn and have the next call plan again under a
    budget lowered by the overshoot, with the walk of the new code held below the budget by what
    this walk missed (``entry.inductor.over``). With ``walk_relied_on`` (a range of shapes, whose
    other sizes the walk alone holds to the budget) a step within the budget that measured more than
    the walk, less the outputs the caller held, is re-planned too, lower by what the walk missed.
    Under torch.distributed the ranks measure apart and run one plan (rank 0's): every rank's
    overshoot is gathered (a collective, once, at the end of the first backward on every rank) and
    every rank re-plans by the largest, so that their next plans are rank 0's again. Where the
    caller held outputs through the backward that ``hold_outputs=False`` planned as freed (``held``
    bytes), the warning says so and what to do."""
    def report(measured: int, held: int, walked: EmittedPeak) -> None:
        planned = entry.planned
        planned.first_step_bytes = measured
        limit = resolve_budget(planned.cg, spec.budget)
        if limit is None:
            return
        missed = max(measured - walked.peak_bytes, 0)
        if measured > limit:
            lower = measured - limit
        elif walk_relied_on and missed > held:  # within the budget, but the walk the other sizes rely on missed
            lower = missed = missed - held
        else:
            lower = 0
        over_at = min(limit, planned.plan.peak_bytes)
        mine = (lower, missed, measured, walked.peak_bytes, held, limit, over_at)
        worst, rank = (_worst_over_ranks(mine) if distributed() else (mine, None))
        lower, missed, measured, walked_bytes, held, limit, over_at = worst
        if lower == 0:
            return
        where = "" if rank is None else f" on rank {rank}"
        at = f" (at {walked.peak_node})" if rank is None else ""
        if measured <= limit:
            said = (f"backend='inductor', max_seq_len: the first step of the range's code measured {measured} "
                    f"bytes{where} where the walk of its code at that step's sizes predicted {walked_bytes}{at}: "
                    f"it missed {lower} bytes, so its walk at the bound does not prove the budget")
        else:
            said = (f"backend='inductor': the first step of Inductor's code for this plan measured "
                    f"{measured} bytes{where}, above the budget of {limit} bytes; the walk of its code had "
                    f"predicted {walked_bytes} bytes{at}, so it missed {missed} bytes")
            if held:
                said += (f". The caller still held {held} bytes of the step's outputs through its backward, "
                         f"which hold_outputs=False plans as freed when the forward returns"
                         f"{' (that is all the walk missed)' if missed <= held else ''}: keep only the loss "
                         f"(loss = m(x, labels=y).loss; loss.backward()), or compile with hold_outputs=True so "
                         f"that the plan counts them")
        entry.inductor.over = (over_at - lower, margin + missed, over_at)
        also = "" if rank is None else " on every rank (rank 0 plans it for all)"
        warnings.warn(f"{said}. The next call plans this step again{also} under a budget lower by "
                      f"{lower} bytes", RuntimeWarning, stacklevel=2)
    return report


def _worst_over_ranks(mine: tuple) -> tuple[tuple, int]:
    """Every rank's ``(lower, ...)`` gathered; the one of the rank to lower the most (the first such
    rank), and that rank: the same on every rank."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        gathered = [torch.zeros(len(mine), dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64))
    rows = [tuple(int(x) for x in t.tolist()) for t in gathered]
    rank = max(range(len(rows)), key=lambda r: (rows[r][0], -r))
    return rows[rank], rank
