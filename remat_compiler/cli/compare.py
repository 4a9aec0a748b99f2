"""``remat-compiler compare``: run strategies under one budget and compare measured peaks and step times."""
from __future__ import annotations

import click

from remat_compiler.budget import human_bytes
from remat_compiler.cli.console import Console, timed
from remat_compiler.cli.exits import EXIT_INFEASIBLE, EXIT_USAGE, NoStrategyRan
from remat_compiler.cli.options import drop_outputs_option, factory_args_option, factory_argument, time_limit_option
from remat_compiler.cli.params import BUDGET, check_solver_list
from remat_compiler.cli.source import hold_outputs_for, load_factory_workload
from remat_compiler.compare import common_budget_bytes, eager_reference, format_compare_table, run_strategy

__all__ = ["compare"]


@click.command()
@factory_argument
@factory_args_option
@click.option("--strategies", required=True, callback=check_solver_list, metavar="A,B,...",
              help="Solvers / strategies to run, e.g. save_all,checkpoint_blocks,cpsat.")
@click.option("--budget", type=BUDGET, default=None, help="Budget every strategy is planned under.")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed steps per strategy (the median is reported).")
@drop_outputs_option
@time_limit_option
@click.pass_context
def compare(ctx: click.Context, factory: str, factory_kwargs: dict, strategies: list[str],
            budget: str | None, steps: int, drop_outputs: bool | None, time_limit_s: float | None) -> None:
    """Train with each strategy for real: measured peak, FLOPs, step time, gradient error vs eager.

    Strategies that are infeasible at the budget or do not apply are rows with the reason. The
    exit code is 0 if at least one strategy ran; otherwise 3 if one was infeasible, else 2.
    """
    console: Console = ctx.obj
    workload = load_factory_workload(factory, factory_kwargs, console)
    hold_outputs = hold_outputs_for(drop_outputs, None)
    budget_bytes = common_budget_bytes(workload, budget, hold_outputs=hold_outputs)
    if budget_bytes is not None:
        console.note(f"budget {budget} = {human_bytes(budget_bytes)} ({budget_bytes} bytes) for every "
                     "strategy")
    with timed(console, "eager reference"):
        runs = [eager_reference(workload, steps=steps)]
    for name in strategies:
        with console.progress(name) as progress, timed(console, f"{name}: plan, compile and measure"):
            runs.append(run_strategy(workload, name, budget_bytes, steps=steps, reference=runs[0],
                                     time_limit_s=time_limit_s, progress=progress,
                                     hold_outputs=hold_outputs))
    click.echo(format_compare_table(runs))
    if not any(r.status == "ok" for r in runs[1:]):
        infeasible = [r for r in runs[1:] if r.status == "infeasible"]
        message = "; ".join(f"{r.strategy}: {r.status}: {r.note}" for r in infeasible or runs[1:])
        raise NoStrategyRan(EXIT_INFEASIBLE if infeasible else EXIT_USAGE,
                            f"no strategy ran at budget {budget or 'unlimited'}: {message}")
