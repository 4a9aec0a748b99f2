"""``remat-compiler plan``: plan one step, print or write the plan, draw its timeline."""
from __future__ import annotations

import click

from remat_compiler.cli.console import Console
from remat_compiler.cli.options import device_option, drop_outputs_option, model_source, time_limit_option
from remat_compiler.cli.params import BUDGET, check_budget_list, check_solver, writable
from remat_compiler.cli.source import hold_outputs_for, load_source, refuse_flags
from remat_compiler.cli.steps import apply_saved_plan, emit_text, plan_workload, render, sweep_workload, write_timeline

__all__ = ["plan"]


@click.command()
@model_source
@click.option("--budget", type=BUDGET, default=None,
              help="Bytes, a unit string (1.5GiB, 512MB) or a fraction of the no-recompute peak (0.5). "
                   "Default: no limit.")
@click.option("--solver", default="cpsat", show_default=True, callback=check_solver,
              help="cpsat, greedy, save_all, checkpoint_blocks, or a registered MoE strategy.")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "dot"]), default="table",
              show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, callback=writable,
              help="Write the plan here (atomically) instead of stdout.")
@click.option("--timeline", type=click.Path(dir_okay=False), default=None, metavar="PNG", callback=writable,
              help="Also draw the memory timeline of the plan and of save-all.")
@click.option("--load", "load_path", type=click.Path(exists=True, dir_okay=False), default=None,
              metavar="PLAN.json", help="Re-apply a saved plan instead of solving.")
@click.option("--all", "all_rows", is_flag=True, help="Table: print every row.")
@click.option("--objective", type=click.Choice(["runtime", "flops"]), default=None,
              help="CP-SAT's recompute cost: estimated runtime (default) or counted FLOPs.")
@click.option("--plan-cache", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Reuse a plan from this folder for the same graph, budget, cost model and options "
                   "(a corrupt or mismatched file is re-planned); write new plans there.")
@click.option("--pareto", "pareto_budgets", default=None, callback=check_budget_list, metavar="B1,B2,...",
              help="Print the budget/overhead curve over these budgets instead of one plan (what the "
                   "pareto command prints; --timeline then names its picture).")
@device_option
@drop_outputs_option
@time_limit_option
@click.pass_context
def plan(ctx: click.Context, budget: str | None, solver: str, fmt: str, output: str | None,
         timeline: str | None, load_path: str | None, all_rows: bool, objective: str | None,
         plan_cache: str | None, pareto_budgets: list[str] | None, device: str | None,
         drop_outputs: bool | None, time_limit_s: float | None, **source) -> None:
    """Trace the training step of MODULE:FACTORY (or of --hf-config's model), plan it under --budget
    and print the plan (with --pareto, the curve over several budgets).

    The factory may build the model on the meta device (``with torch.device("meta"):``): planning
    needs shapes and dtypes only, and the plan is the one real weights give."""
    console: Console = ctx.obj
    if pareto_budgets is not None:
        refuse_flags(ctx, {"budget": "--budget", "load_path": "--load", "objective": "--objective",
                           "plan_cache": "--plan-cache", "output": "--output", "fmt": "--format",
                           "all_rows": "--all"},
                     "--pareto sweeps its own budgets into a table; {flags} cannot be used with it")
        sweep_workload(console, load_source(ctx, console, source), pareto_budgets, solver, None, timeline, device,
                       hold_outputs_for(drop_outputs, source["hf_config"]), time_limit_s, fsdp=source["fsdp"])
        return
    if load_path is not None:
        refuse_flags(ctx, {"budget": "--budget", "solver": "--solver", "time_limit_s": "--time-limit",
                           "objective": "--objective", "plan_cache": "--plan-cache", "device": "--device",
                           "fsdp": "--fsdp"},
                     "--load applies a saved plan; {flags} cannot be used with it")
    workload = load_source(ctx, console, source)
    hold_outputs = hold_outputs_for(drop_outputs, source["hf_config"])
    if load_path is not None:
        planned = apply_saved_plan(console, workload, load_path, hold_outputs=hold_outputs)
    else:
        planned = plan_workload(console, workload, budget, solver, time_limit_s, hold_outputs=hold_outputs,
                                objective=objective, plan_cache=plan_cache, device=device, fsdp=source["fsdp"])
    emit_text(console, render(planned, fmt, all_rows), output)
    if timeline is not None:
        console.note(f"wrote timeline picture {write_timeline(planned, timeline)}")
