"""``remat-compiler demo``: plan the built-in example, print the plan, draw its timeline."""
from __future__ import annotations

from pathlib import Path

import click

from remat_compiler import examples as remat_examples
from remat_compiler.cli.console import Console
from remat_compiler.cli.options import time_limit_option
from remat_compiler.cli.params import BUDGET, writable
from remat_compiler.cli.source import load_factory_workload
from remat_compiler.cli.steps import plan_workload, render, write_timeline

__all__ = ["demo", "EXAMPLES_DIR", "DEMO_FACTORY"]


EXAMPLES_DIR = Path(remat_examples.__file__).resolve().parent  # installed as remat_compiler.examples
DEMO_FACTORY = EXAMPLES_DIR / "demo.py"


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="remat_demo_timeline.png",
              callback=writable,
              show_default=True, help="Where to write the timeline picture.")
@click.option("--budget", type=BUDGET, default="0.5", show_default=True)
@time_limit_option
@click.pass_context
def demo(ctx: click.Context, output: str, budget: str, time_limit_s: float | None) -> None:
    """Plan the built-in example (an MLP chain whose activations dominate), print the plan, draw it."""
    console: Console = ctx.obj
    if not DEMO_FACTORY.is_file():
        raise click.ClickException(f"the demo model lives in {DEMO_FACTORY}, which this installation "
                                   "does not have; run from a source checkout")
    workload = load_factory_workload(f"{DEMO_FACTORY}:build", {}, console)
    planned = plan_workload(console, workload, budget, "cpsat", time_limit_s)
    click.echo(render(planned, "table", all_rows=False), nl=False)
    click.echo(f"\ntimeline picture written to {write_timeline(planned, output)}")
