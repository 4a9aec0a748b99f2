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
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Callable

import click

from passes.costs import DEVICE_PRESETS, CostModel

from remat_compiler.api import PlannedGraph, analyze, plan_model
from remat_compiler.budget import human_bytes, parse_budget
from remat_compiler.cli_params import (BUDGET, check_budget_list, check_solver, check_solver_list, factory_args,
                                       writable)
from remat_compiler.console import PROG, Console, format_progress, timed
from remat_compiler.compare import common_budget_bytes, eager_reference, format_compare_table, run_strategy
from remat_compiler.errors import InfeasibleBudgetError, PlanCheckError, PlanMismatchError, RematError
from remat_compiler.fit import Probe, describe_probe, fit_size, format_fit
from remat_compiler.hf_config import (DTYPES, ConfigError, build_causal_lm, causal_lm_workload, check_seq,
                                      config_dtype, load_config)
from passes.files import atomic_write_text
from remat_compiler.plan import Plan
from remat_compiler.solvers import get_solver, solve
from remat_compiler.sweep import format_pareto_table, strategy_points, sweep_budgets
from remat_compiler.viz import plan_to_dot, plot_pareto, plot_timeline
from remat_compiler.workload import FactoryError, Workload, load_workload

__all__ = ["main", "cli", "format_progress", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INFEASIBLE"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INFEASIBLE = 0, 1, 2, 3
EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
DEMO_FACTORY = EXAMPLES_DIR / "demo.py"


def _load_workload(spec: str, factory_kwargs: dict, console: Console) -> Workload:
    """Build the factory's workload; a spec that names nothing usable is a bad argument."""
    with timed(console, f"build {spec}"):
        try:
            return load_workload(spec, factory_kwargs)
        except FactoryError as exc:
            raise click.BadParameter(str(exc), param_hint="MODULE:FACTORY") from exc


factory_argument = click.argument("factory", metavar="MODULE:FACTORY")
factory_args_option = click.option(
    "--arg", "factory_kwargs", multiple=True, metavar="KEY=VALUE", callback=factory_args,
    help="Keyword argument for the factory (repeatable); VALUE is a Python literal or a string.")
time_limit_option = click.option(
    "--time-limit", "time_limit_s", type=click.FloatRange(min=0, min_open=True), default=None,
    metavar="S", help="Time limit of each solve, in seconds, for solvers that take one: the whole solve "
                      "(warm start, searches, and for an infeasible budget the search for the smallest "
                      "feasible one); for plan's one plan by cpsat, from the model to the plan (the trace is "
                      "taken from it). "
                      "Default: the solver's (30 s for cpsat and greedy).")
drop_outputs_option = click.option(
    "--drop-outputs/--hold-outputs", default=None,
    help="--drop-outputs plans for a step that keeps only the scalar loss through backward "
         "(model(x).loss.backward()), which is the only output backward runs from; --hold-outputs for "
         "a caller that holds every output until backward ends. Default: held for MODULE:FACTORY, "
         "dropped for --hf-config.")
hf_config_option = click.option(
    "--hf-config", type=click.Path(exists=True), default=None, metavar="CONFIG.json",
    help="Plan a transformers config file (or a folder with config.json) instead of MODULE:FACTORY: its "
         "AutoModelForCausalLM is built on the meta device (no weights, nothing downloaded) and trains on "
         "--batch x --seq token ids passed as input_ids and as labels, so the model computes its loss "
         "inside the plan; the step keeps only that loss (model(**batch).loss.backward(), the logits "
         "let go: --drop-outputs is the default).")
batch_option = click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
                            help="With --hf-config: sequences per step.")
seq_option = click.option("--seq", type=click.IntRange(min=1), default=None,
                          help="With --hf-config: tokens per sequence (at most the config's "
                               "max_position_embeddings).")
dtype_option = click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
                            help="With --hf-config: the dtype of parameters and activations. Default: the "
                                 "config's dtype field if it is one of these, else float32.")
device_option = click.option(
    "--device", type=click.Choice(sorted(DEVICE_PRESETS)), default=None,
    help="Plan for this accelerator: runtimes from its vendor bf16 rate and bandwidth instead of this "
         "machine's CPU (it changes what recomputing costs, hence the plan), and a model built on the "
         "meta device (--hf-config, or a factory that builds on meta) is planned for CUDA, in the units "
         "of torch.cuda.max_memory_allocated() (512-byte allocator blocks). The plan file it writes is "
         "applied on the GPU with compile(model.cuda(), plan=Plan.load(path)).")


fsdp_option = click.option(
    "--fsdp", type=click.IntRange(min=2), default=None, metavar="N",
    help="Plan one rank of an N-way FSDP2 step: every block of the model's repeated layers and then the "
         "root sharded with fully_shard (as torchtitan does) over a fake process group, the rank's whole "
         "step planned, each unit kept or gathered again in backward (docs/fsdp.md). The budget is per rank.")


def model_source(command):
    """The options naming the model: MODULE:FACTORY (with --arg) or --hf-config (with --batch, --seq,
    --dtype), and --fsdp; read them with :func:`_load_source`."""
    options = [click.argument("factory", metavar="[MODULE:FACTORY]", required=False), factory_args_option,
               hf_config_option, batch_option, seq_option, dtype_option, fsdp_option]
    for option in reversed(options):
        command = option(command)
    return command


def _given(ctx: click.Context, flags: dict[str, str]) -> list[str]:
    """The flags among ``{parameter: flag}`` given on the command line."""
    return [flag for name, flag in flags.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]


def _load_source(ctx: click.Context, console: Console, source: dict) -> Workload:
    """The workload that :func:`model_source`'s options name; a missing, doubled or mismatched
    option, or a config that builds no model, is a bad argument."""
    factory, hf_config = source["factory"], source["hf_config"]
    if (factory is None) == (hf_config is None):
        raise click.UsageError("name the model with MODULE:FACTORY or with --hf-config CONFIG.json (one of "
                               "them)")
    if factory is not None:
        given = _given(ctx, {"batch": "--batch", "seq": "--seq", "dtype": "--dtype"})
        if given:
            raise click.UsageError(f"{', '.join(given)}: only with --hf-config (pass a factory's sizes with "
                                   "--arg KEY=VALUE)")
        return _load_workload(factory, source["factory_kwargs"], console)
    if source["factory_kwargs"]:
        raise click.UsageError("--arg passes keyword arguments to a MODULE:FACTORY; the --hf-config "
                               "model's sizes are --batch, --seq and --dtype")
    if source["seq"] is None:
        raise click.UsageError("--hf-config needs --seq N (tokens per sequence)")
    config = _load_config(hf_config)
    _check_seq(config, source["seq"], "--seq")
    model = _build_model(console, hf_config, config, source["dtype"])
    _note_model(console, config, model, f"batch {source['batch']} x seq {source['seq']}")
    return causal_lm_workload(config, batch=source["batch"], seq=source["seq"], model=model)


def _load_config(path: str):
    try:
        return load_config(path)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--hf-config") from exc


def _check_seq(config, seq: int, flag: str) -> None:
    try:
        check_seq(config, seq)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from exc


def _build_model(console: Console, path: str, config, dtype: str | None):
    with timed(console, f"build the model of {path} on the meta device"):
        try:
            return build_causal_lm(config, config_dtype(config, dtype))
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--hf-config") from exc


def _note_model(console: Console, config, model, shape: str) -> None:
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    console.note(f"{type(model).__name__} from the {config.model_type} config: {params:,} parameters in "
                 f"{dtype} on the meta device, {shape} tokens")


def _hold_outputs(drop_outputs: bool | None, hf_config: str | None) -> bool:
    """--drop-outputs / --hold-outputs, or the default: held, except for an --hf-config step."""
    return not drop_outputs if drop_outputs is not None else hf_config is None


# ---------------------------------------------------------------------------- pipeline helpers
def _solve(console: Console, workload: Workload, budget: str | None, solver: str,
           time_limit_s: float | None, *, hold_outputs: bool = True,
           objective: str | None = None, plan_cache: str | None = None,
           device: str | None = None, label: str | None = None, fsdp: int | None = None) -> PlannedGraph:
    """The pipeline on the workload's step, with progress (labelled ``label``, default the solver's
    name) and step timings (``device``: a :data:`passes.costs.DEVICE_PRESETS` name for the runtime
    estimate)."""
    with console.progress(label or solver) as progress:
        opts = get_solver(solver).options_in({"time_limit_s": time_limit_s, "progress": progress,
                                              "objective": objective})
        planned = plan_model(workload.model, workload.args, workload.kwargs, budget, solver=solver,
                             hold_outputs=hold_outputs, plan_cache=plan_cache,
                             cost_model=CostModel.preset(device) if device else None, fsdp=fsdp, **opts)
    _report_steps(console, planned)
    if plan_cache is not None:
        console.note(f"plan {'read from' if planned.source == 'cache' else 'solved and written to'} "
                     f"the plan cache {plan_cache}")
    return planned


def _report_steps(console: Console, planned: PlannedGraph) -> None:
    console.detail(f"graph {planned.cg.fingerprint}: {planned.cg.summary()}")
    for step, seconds in planned.timings.items():
        console.detail(f"{step}: {seconds:.2f} s")


def _apply_saved_plan(console: Console, workload: Workload, path: str, hold_outputs: bool = True
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
    _report_steps(console, planned)
    console.detail(f"re-applied plan {plan.digest()} to graph {planned.cg.fingerprint}")
    return planned


def _render(planned: PlannedGraph, fmt: str, all_rows: bool) -> str:
    """The plan as a table (Plan.explain plus its digest), JSON (Plan.to_json) or DOT."""
    plan = planned.plan
    if fmt == "json":
        return plan.to_json() + "\n"
    if fmt == "dot":
        return plan_to_dot(planned.cg, plan)
    table = plan.explain(max_rows=len(plan.values) if all_rows else 40)
    return f"{table}\n\nplan {plan.digest()} for graph {plan.fingerprint}\n"


def _emit_text(console: Console, text: str, output: str | None) -> None:
    """Print ``text``, or write it atomically to ``output``."""
    if output is None:
        click.echo(text, nl=False)
        return
    atomic_write_text(output, text)
    console.note(f"wrote {output}")


def _write_timeline(planned: PlannedGraph, path: str) -> str:
    """Draw the plan's memory timeline beside save-all's; returns the absolute path written."""
    plan, cg = planned.plan, planned.cg
    budget = human_bytes(plan.budget_bytes) if plan.budget_bytes else "unlimited"
    plans = {f"{plan.solver} (budget {budget})": plan}
    if plan.solver != "save_all":
        plans["save_all (no recompute)"] = solve(cg, None, "save_all")
    return plot_timeline(cg, plans, plan.budget_bytes, path)


# ---------------------------------------------------------------------------- commands
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


@cli.command()
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
        given = _given(ctx, {"budget": "--budget", "load_path": "--load", "objective": "--objective",
                             "plan_cache": "--plan-cache", "output": "--output", "fmt": "--format",
                             "all_rows": "--all"})
        if given:
            raise click.UsageError(f"--pareto sweeps its own budgets into a table; {', '.join(given)} "
                                   "cannot be used with it")
        _sweep(console, _load_source(ctx, console, source), pareto_budgets, solver, None, timeline, device,
               _hold_outputs(drop_outputs, source["hf_config"]), time_limit_s, fsdp=source["fsdp"])
        return
    if load_path is not None:
        given = _given(ctx, {"budget": "--budget", "solver": "--solver", "time_limit_s": "--time-limit",
                             "objective": "--objective", "plan_cache": "--plan-cache", "device": "--device",
                             "fsdp": "--fsdp"})
        if given:
            raise click.UsageError(f"--load applies a saved plan; {', '.join(given)} cannot be "
                                   "used with it")
    workload = _load_source(ctx, console, source)
    hold_outputs = _hold_outputs(drop_outputs, source["hf_config"])
    if load_path is not None:
        planned = _apply_saved_plan(console, workload, load_path, hold_outputs=hold_outputs)
    else:
        planned = _solve(console, workload, budget, solver, time_limit_s, hold_outputs=hold_outputs,
                         objective=objective, plan_cache=plan_cache, device=device, fsdp=source["fsdp"])
    _emit_text(console, _render(planned, fmt, all_rows), output)
    if timeline is not None:
        console.note(f"wrote timeline picture {_write_timeline(planned, timeline)}")


@cli.command()
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
    _sweep(console, _load_source(ctx, console, source), budgets, solver, strategies, png, device,
           _hold_outputs(drop_outputs, source["hf_config"]), time_limit_s, fsdp=source["fsdp"])


def _sweep(console: Console, workload: Workload, budgets: list[str], solver: str, strategies: list[str] | None,
           png: str | None, device: str | None, hold_outputs: bool, time_limit_s: float | None,
           fsdp: int | None = None) -> None:
    """The pareto table (``pareto``, ``plan --pareto``): ``solver`` at each budget, then the
    hand-picked strategies (not with ``fsdp``: they are for the unsharded model), and its picture
    at ``png``."""
    with timed(console, "trace and annotate"):
        if fsdp is not None:
            from remat_compiler.fsdp.planning import analyze_sharded
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


@cli.command()
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
    workload = _load_workload(factory, factory_kwargs, console)
    hold_outputs = _hold_outputs(drop_outputs, None)
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


@cli.command()
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
    workload = _load_workload(f"{DEMO_FACTORY}:build", {}, console)
    planned = _solve(console, workload, budget, "cpsat", time_limit_s)
    click.echo(_render(planned, "table", all_rows=False), nl=False)
    click.echo(f"\ntimeline picture written to {_write_timeline(planned, output)}")


@cli.command()
@click.option("--hf-config", type=click.Path(exists=True), required=True, metavar="CONFIG.json",
              help="A transformers config file (or a folder with config.json): its AutoModelForCausalLM, "
                   "built on the meta device, trains on token ids passed as input_ids and as labels (the "
                   "loss is inside the plan; the step keeps only the loss unless --hold-outputs).")
@click.option("--budget", type=BUDGET, required=True,
              help="Bytes or a unit string (70GiB): the step peak every size is planned under. A fraction "
                   "is refused: the no-recompute peak it is a fraction of changes with the size.")
@click.option("--seq-max", type=click.IntRange(min=1), default=None, metavar="N",
              help="Find the longest sequence, up to N, at --batch.")
@click.option("--batch-max", type=click.IntRange(min=1), default=None, metavar="N",
              help="Find the largest batch, up to N, at --seq.")
@click.option("--step", type=click.IntRange(min=1), default=None, metavar="K",
              help="The sizes tried are the multiples of K up to the maximum, bisected: the smallest, the "
                   "largest, then halving the range (about log2(max/K) plans). Default: 128 for --seq-max, "
                   "1 for --batch-max.")
@batch_option
@seq_option
@dtype_option
@device_option
@fsdp_option
@drop_outputs_option
@time_limit_option
@click.option("--format", "fmt", type=click.Choice(["table", "json", "dot"]), default="table",
              show_default=True, help="The plan at the answer; json and dot need -o (stdout has the search).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, callback=writable,
              help="Write the plan at the answer here (atomically) instead of stdout.")
@click.option("--all", "all_rows", is_flag=True, help="Table: print every row of the plan.")
@click.pass_context
def fit(ctx: click.Context, hf_config: str, budget: str, seq_max: int | None, batch_max: int | None,
        step: int | None, batch: int, seq: int | None, dtype: str | None, device: str | None,
        fsdp: int | None, drop_outputs: bool | None, time_limit_s: float | None, fmt: str, output: str | None,
        all_rows: bool) -> None:
    """The longest sequence (--seq-max) or largest batch (--batch-max) whose training step fits
    --budget, and the plan there: what it saves and recomputes.

    A size fits when CP-SAT finds a plan under the budget within --time-limit; one that does not is
    shown with the smallest feasible peak found. The peak is assumed to grow with the size, so the
    answer is a size that fits whose next multiple of --step was planned and does not.
    """
    console: Console = ctx.obj
    if parse_budget(budget).bytes is None:
        raise click.BadParameter("fit needs an absolute budget (bytes, or a unit string such as 70GiB): the "
                                 "no-recompute peak a fraction is taken of changes with the size searched",
                                 param_hint="--budget")
    if fmt != "table" and output is None:
        raise click.UsageError(f"--format {fmt} writes the plan to -o FILE (stdout carries the search)")
    dim, sizes = _fit_grid(ctx, seq_max, batch_max, step, seq)
    config = _load_config(hf_config)
    _check_seq(config, sizes[-1] if dim == "seq" else seq, "--seq-max" if dim == "seq" else "--seq")
    model = _build_model(console, hf_config, config, dtype)

    def shape(size: int) -> tuple[int, int]:
        """(batch, seq) at a size searched."""
        return (batch, size) if dim == "seq" else (size, seq)

    span = f"{sizes[0]}..{sizes[-1]}"
    _note_model(console, config, model,
                f"batch {batch} x seq {span}" if dim == "seq" else f"batch {span} x seq {seq}")

    def plan_at(size: int) -> PlannedGraph:
        b, s = shape(size)
        return _solve(console, causal_lm_workload(config, batch=b, seq=s, model=model), budget, "cpsat",
                      time_limit_s, hold_outputs=_hold_outputs(drop_outputs, hf_config), device=device,
                      label=f"{dim} {size}", fsdp=fsdp)

    result = fit_size(plan_at, sizes, on_probe=lambda probe: console.note(describe_probe(dim, probe)))
    step = sizes[0]  # the grid's step, the default resolved
    click.echo(format_fit(result, dim, step, parse_budget(budget).bytes))
    if result.best is None:
        raise NothingFits(_nothing_fits(budget, result.probes[0], shape, step))
    click.echo()
    _emit_text(console, _render(result.best.planned, fmt, all_rows), output)


def _fit_grid(ctx: click.Context, seq_max: int | None, batch_max: int | None, step: int | None,
              seq: int | None) -> tuple[str, list[int]]:
    """What fit searches (``"seq"`` or ``"batch"``) and the sizes it may try, the multiples of
    ``step``; a missing, doubled or contradicting option is a usage error."""
    if (seq_max is None) == (batch_max is None):
        raise click.UsageError("give --seq-max N (the longest sequence) or --batch-max N (the largest batch), "
                               "one of them")
    dim, size_max = ("seq", seq_max) if seq_max is not None else ("batch", batch_max)
    fixed = "--seq" if dim == "seq" else "--batch"
    if fixed in _given(ctx, {"seq": "--seq", "batch": "--batch"}):
        raise click.UsageError(f"{fixed} fixes what --{dim}-max searches: give one of them")
    if dim == "batch" and seq is None:
        raise click.UsageError("--batch-max needs --seq N (tokens per sequence)")
    step = step or (128 if dim == "seq" else 1)
    sizes = list(range(step, size_max + 1, step))
    if not sizes:
        raise click.BadParameter(f"{size_max} is below --step {step}", param_hint=f"--{dim}-max")
    return dim, sizes


def _nothing_fits(budget: str, probe: Probe, shape: Callable[[int], tuple[int, int]], step: int) -> str:
    """fit's message when even the smallest size does not fit: what that size needs."""
    batch, seq = shape(probe.size)
    needs = f"{probe.peak_bytes} bytes ({human_bytes(probe.peak_bytes)})"
    found = f"is {needs}" if probe.proven else f"found is {needs}, not proven minimal"
    smaller = ", or a smaller --step" if step > 1 else ""
    return (f"budget {budget} is too small for even batch {batch} x seq {seq}: its smallest feasible peak "
            f"{found}; pass --budget >= {probe.peak_bytes}{smaller}")


# ---------------------------------------------------------------------------- entry point
class NothingFits(click.ClickException):
    """fit: the budget is below the smallest feasible peak at the smallest size."""

    exit_code = EXIT_INFEASIBLE


class NoStrategyRan(click.ClickException):
    """compare: every named strategy was infeasible or did not apply."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def _classify(exc: BaseException) -> tuple[int, str]:
    """Map an exception to the documented exit code and its one-line message."""
    if isinstance(exc, click.UsageError):
        return EXIT_USAGE, exc.format_message()
    if isinstance(exc, click.ClickException):
        return exc.exit_code, exc.format_message()
    if isinstance(exc, InfeasibleBudgetError):
        return EXIT_INFEASIBLE, str(exc)
    if isinstance(exc, click.Abort):
        return EXIT_ERROR, "aborted"
    if isinstance(exc, RematError):
        return EXIT_ERROR, str(exc)
    return EXIT_ERROR, f"{type(exc).__name__}: {exc}"


def _one_line(message: str) -> str:
    return " ".join(str(message).split()) or "failed"


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
        code, message = _classify(exc)
        if verbose and not isinstance(exc, click.UsageError):  # a usage error's stack says nothing
            traceback.print_exc(file=sys.stderr)
        click.echo(f"{PROG}: error: {_one_line(message)}", err=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
