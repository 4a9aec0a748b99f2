"""``remat-compiler``: plan, inspect, draw and compare recomputation plans from the command line.

::

    remat-compiler demo                                   # built-in example: plan, table, timeline picture
    remat-compiler plan examples/gpt2.py:build --budget 1GiB --format table|json|dot [-o FILE]
    remat-compiler plan examples/gpt2.py:build --budget 0.4 --timeline timeline.png
    remat-compiler plan examples/gpt2.py:build --load plan.json      # re-apply a saved plan
    remat-compiler plan examples/gpt2.py:build --budget 0.5 --plan-cache ~/.cache/remat   # reuse plans
    remat-compiler pareto examples/gpt2.py:build --budgets 1.0,0.8,0.6,0.4,0.3 --png pareto.png
    remat-compiler compare examples/moe.py:build --strategies save_all,cpsat --budget 0.95
    remat-compiler plan --hf-config config.json --seq 8192 --dtype bfloat16 --device h100 --budget 60GiB
    remat-compiler pareto --hf-config config.json --seq 4096 --budgets 1.0,0.7,0.5
    remat-compiler fit --hf-config config.json --budget 70GiB --seq-max 32768 --device h100

``MODULE:FACTORY`` names a .py file or an importable module and a function returning
``(model, example_inputs, loss_fn)`` (see :mod:`remat_compiler.workload`); ``--arg KEY=VALUE``
passes keyword arguments to it. ``--hf-config`` names a transformers config file instead, whose
causal language model is built on the meta device (:mod:`remat_compiler.hf_config`).

Exit codes: 0 ok; 2 bad arguments (usage errors, a budget that does not parse, an unknown solver, a
bad ``MODULE:FACTORY``, ``--arg`` or ``--hf-config``, and a ``--load`` file that is not a valid plan
or was made for another graph: the file is an argument, and nothing is run with it); 3 infeasible
budget (the message names the smallest feasible budget; for ``fit``, at the smallest size); 1
anything else. Every failure prints one line ``remat-compiler: error: ...`` on stderr;
``--verbose`` adds the traceback.

The package holds one command a file (:mod:`.plan`, :mod:`.pareto`, :mod:`.compare`, :mod:`.demo`,
:mod:`.fit`), registered on the :func:`cli` group here, with what they share: the options
(:mod:`.options`, :mod:`.params`), the model source (:mod:`.source`), the steps they run
(:mod:`.steps`), the console (:mod:`.console`) and the exit codes (:mod:`.exits`).
"""
from __future__ import annotations

import sys
import traceback

import click

from remat_compiler.cli.compare import compare
from remat_compiler.cli.console import PROG, Console, format_progress
from remat_compiler.cli.demo import demo
from remat_compiler.cli.exits import EXIT_ERROR, EXIT_INFEASIBLE, EXIT_OK, EXIT_USAGE, classify, one_line
from remat_compiler.cli.fit import fit
from remat_compiler.cli.pareto import pareto
from remat_compiler.cli.plan import plan

__all__ = ["main", "cli", "format_progress", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INFEASIBLE"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-q", "--quiet", is_flag=True, help="No progress display and no notes on stderr.")
@click.option("-v", "--verbose", is_flag=True, help="Step timings, graph summary, tracebacks on errors.")
@click.option("--progress", "progress_lines", is_flag=True,
              help="Print the solver's progress as lines on stderr (elapsed time, best cost, bound, gap; at "
                   "most one a second per solve), also when stderr is not a terminal (a log). Default: "
                   "one line redrawn in place on a terminal, nothing otherwise.")
@click.pass_context
def cli(ctx: click.Context, quiet: bool, verbose: bool, progress_lines: bool) -> None:
    """Plan activation recomputation for PyTorch training under a memory budget."""
    if quiet and verbose:
        raise click.UsageError("--quiet and --verbose exclude each other")
    if quiet and progress_lines:
        raise click.UsageError("--quiet and --progress exclude each other")
    ctx.obj = Console(quiet=quiet, verbose=verbose, progress_lines=progress_lines)


for command in (plan, pareto, compare, demo, fit):
    cli.add_command(command)


def main(argv: list[str] | None = None, *, prog_name: str = PROG) -> int:
    """Run the CLI and return its exit code (the console script's entry point).

    Parameters
    ----------
    argv : list of str, optional
        Arguments without the program name; default ``sys.argv[1:]``.
    prog_name : str

    Returns
    -------
    int
        0 ok, 2 bad arguments, 3 infeasible budget, 1 other errors.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    verbose = False
    try:
        with cli.make_context(prog_name, args) as ctx:
            verbose = bool(ctx.params.get("verbose"))
            cli.invoke(ctx)
        return EXIT_OK
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.NoArgsIsHelpError as exc:  # bare ``remat-compiler``: the help, as click does
        click.echo(exc.format_message(), err=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        click.echo(f"{PROG}: error: interrupted", err=True)
        return 130
    except Exception as exc:  # translated to the documented exit codes, never dropped
        code, message = classify(exc)
        if verbose and not isinstance(exc, click.UsageError):  # a usage error's stack says nothing
            traceback.print_exc(file=sys.stderr)
        click.echo(f"{PROG}: error: {one_line(message)}", err=True)
        return code
