"""``remat-compiler pareto``: plan at several budgets and tabulate (and draw) the trade-off."""
from __future__ import annotations

import click

from remat_compiler.cli.console import Console
from remat_compiler.cli.options import device_option, drop_outputs_option, model_source, time_limit_option
from remat_compiler.cli.params import check_budget_list, check_solver, check_solver_list, writable
from remat_compiler.cli.source import hold_outputs_for, load_source
from remat_compiler.cli.steps import sweep_workload

__all__ = ["pareto"]


@click.command()
@model_source
@click.option("--budgets", required=True, callback=check_budget_list, metavar="B1,B2,...",
              help="Comma-separated budgets to sweep, e.g. 1.0,0.8,0.6,0.4.")
@click.option("--solver", default="cpsat", show_default=True, callback=check_solver)
@click.option("--strategies", default=None, callback=check_solver_list, metavar="A,B,...",
              help="Hand-picked strategies to mark. Default: save_all, checkpoint_blocks and every "
                   "registered MoE strategy; those that do not apply are listed as n/a.")
@click.option("--png", type=click.Path(dir_okay=False), default=None, callback=writable,
              help="Draw the points here.")
@device_option
@drop_outputs_option
@time_limit_option
@click.pass_context
def pareto(ctx: click.Context, budgets: list[str], solver: str, strategies: list[str] | None,
           png: str | None, device: str | None, drop_outputs: bool | None, time_limit_s: float | None,
           **source) -> None:
    """Sweep budgets: recompute overhead against predicted peak, next to the hand-picked strategies
    (for MODULE:FACTORY, or for --hf-config's model).

    Infeasible budgets and strategies that do not apply are rows with the reason; the exit code
    is 0 as long as the table is printed.
    """
    console: Console = ctx.obj
    sweep_workload(console, load_source(ctx, console, source), budgets, solver, strategies, png, device,
                   hold_outputs_for(drop_outputs, source["hf_config"]), time_limit_s, fsdp=source["fsdp"])
