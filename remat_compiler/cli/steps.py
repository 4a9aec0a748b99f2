"""What the commands run: the plan (or a saved one applied), and its table, JSON, DOT or timeline written."""
from __future__ import annotations

import click

from remat_compiler.api import PlannedGraph, analyze, analyze_sharded, plan_model
from remat_compiler.budget import human_bytes
from remat_compiler.cli.console import Console, timed
from remat_compiler.errors import PlanCheckError, PlanMismatchError
from remat_compiler.passes.costs import CostModel
from remat_compiler.passes.files import atomic_write_text
from remat_compiler.plan import Plan
from remat_compiler.solvers import get_solver, solve
from remat_compiler.sweep import format_pareto_table, strategy_points, sweep_budgets
from remat_compiler.viz import plan_to_dot, plot_pareto, plot_timeline
from remat_compiler.workload import Workload

__all__ = ["plan_workload", "report_steps", "apply_saved_plan", "render", "emit_text", "write_timeline",
           "sweep_workload"]


def plan_workload(console: Console, workload: Workload, budget: str | None, solver: str,
                  time_limit_s: float | None, *, hold_outputs: bool = True,
                  objective: str | None = None, plan_cache: str | None = None,
                  device: str | None = None, label: str | None = None, fsdp: int | None = None) -> PlannedGraph:
    """The pipeline on the workload's step, with progress (labelled ``label``, default the solver's
    name) and step timings (``device``: a :data:`remat_compiler.passes.costs.DEVICE_PRESETS` name for the runtime
    estimate)."""
    with console.progress(label or solver) as progress:
        opts = get_solver(solver).options_in({"time_limit_s": time_limit_s, "progress": progress,
                                              "objective": objective})
        planned = plan_model(workload.model, workload.args, workload.kwargs, budget, solver=solver,
                             hold_outputs=hold_outputs, plan_cache=plan_cache,
                             cost_model=CostModel.preset(device) if device else None, fsdp=fsdp, **opts)
    report_steps(console, planned)
    if plan_cache is not None:
        console.note(f"plan {'read from' if planned.source == 'cache' else 'solved and written to'} "
                     f"the plan cache {plan_cache}")
    return planned


def report_steps(console: Console, planned: PlannedGraph) -> None:
    """With ``--verbose``: the graph's summary and how long each pipeline step took."""
    console.detail(f"graph {planned.cg.fingerprint}: {planned.cg.summary()}")
    for step, seconds in planned.timings.items():
        console.detail(f"{step}: {seconds:.2f} s")


def apply_saved_plan(console: Console, workload: Workload, path: str, hold_outputs: bool = True
                     ) -> PlannedGraph:
    """Trace the model and re-apply a saved plan to it; a file that is not a valid plan for this
    model (corrupt, edited, or made for another graph) is a bad argument."""
    try:
        plan = Plan.load(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        # from_json raises ValueError for what it detects; the others are malformed documents
        raise click.BadParameter(f"{path} is not a valid plan file: {type(exc).__name__}: {exc}",
                                 param_hint="--load") from exc
    try:
        planned = plan_model(workload.model, workload.args, workload.kwargs, solver=plan.solver, plan=plan,
                             hold_outputs=hold_outputs)
    except PlanMismatchError as exc:
        raise click.BadParameter(f"{path}: {exc}", param_hint="--load") from exc
    except PlanCheckError as exc:  # the digest held, but the decisions do not: an edited file
        raise click.BadParameter(f"{path} is not a valid plan for this model: {exc}",
                                 param_hint="--load") from exc
    report_steps(console, planned)
    console.detail(f"re-applied plan {plan.digest()} to graph {planned.cg.fingerprint}")
    return planned


def render(planned: PlannedGraph, fmt: str, all_rows: bool) -> str:
    """The plan as a table (Plan.explain plus its digest), JSON (Plan.to_json) or DOT."""
    plan = planned.plan
    if fmt == "json":
        return plan.to_json() + "\n"
    if fmt == "dot":
        return plan_to_dot(planned.cg, plan)
    table = plan.explain(max_rows=len(plan.values) if all_rows else 40)
    return f"{table}\n\nplan {plan.digest()} for graph {plan.fingerprint}\n"


def emit_text(console: Console, text: str, output: str | None) -> None:
    """Print ``text``, or write it atomically to ``output``."""
    if output is None:
        click.echo(text, nl=False)
        return
    atomic_write_text(output, text)
    console.note(f"wrote {output}")


def write_timeline(planned: PlannedGraph, path: str) -> str:
    """Draw the plan's memory timeline beside save-all's; returns the absolute path written."""
    plan, cg = planned.plan, planned.cg
    budget = human_bytes(plan.budget_bytes) if plan.budget_bytes else "unlimited"
    plans = {f"{plan.solver} (budget {budget})": plan}
    if plan.solver != "save_all":
        plans["save_all (no recompute)"] = solve(cg, None, "save_all")
    return plot_timeline(cg, plans, plan.budget_bytes, path)


def sweep_workload(console: Console, workload: Workload, budgets: list[str], solver: str, strategies: list[str] | None,
                   png: str | None, device: str | None, hold_outputs: bool, time_limit_s: float | None,
                   fsdp: int | None = None) -> None:
    """The pareto table (``pareto``, ``plan --pareto``): ``solver`` at each budget, then the
    hand-picked strategies (not with ``fsdp``: they are for the unsharded model), and its picture
    at ``png``."""
    with timed(console, "trace and annotate"):
        if fsdp is not None:
            _, cg = analyze_sharded(workload.model, workload.args, workload.kwargs, fsdp=fsdp, solver=solver,
                                    hold_outputs=hold_outputs, cost_model=CostModel.preset(device) if device else None)
            strategies = []
        else:
            _, cg = analyze(workload.model, workload.args, workload.kwargs, solver=solver,
                            hold_outputs=hold_outputs, cost_model=CostModel.preset(device) if device else None)
    with timed(console, "budget sweep"):
        rows = sweep_budgets(cg, budgets, solver=solver, time_limit_s=time_limit_s,
                             progress=console.progress_callback)
    console.clear_progress()
    with timed(console, "hand-picked strategies"):
        rows += strategy_points(workload.model, workload.args, workload.kwargs, cg, strategies)
    click.echo(format_pareto_table(rows))
    if png is not None:
        console.note(f"wrote Pareto picture {plot_pareto(rows, png)}")
