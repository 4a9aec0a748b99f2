"""``remat-compiler fit``: the largest batch and sequence a --hf-config model trains at under a budget."""
from __future__ import annotations

from typing import Callable

import click

from remat_compiler.api import PlannedGraph
from remat_compiler.budget import human_bytes, parse_budget
from remat_compiler.cli.console import Console
from remat_compiler.cli.exits import NothingFits
from remat_compiler.cli.options import (batch_option, device_option, drop_outputs_option, dtype_option, fsdp_option,
                                        seq_option, time_limit_option)
from remat_compiler.cli.params import BUDGET, writable
from remat_compiler.cli.source import (build_hf_model, check_seq_flag, given_flags, hold_outputs_for, load_hf_config,
                                       note_model)
from remat_compiler.cli.steps import emit_text, plan_workload, render
from remat_compiler.fit import Probe, describe_probe, fit_size, format_fit
from remat_compiler.hf_config import causal_lm_workload

__all__ = ["fit"]


@click.command()
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
    config = load_hf_config(hf_config)
    check_seq_flag(config, sizes[-1] if dim == "seq" else seq, "--seq-max" if dim == "seq" else "--seq")
    model = build_hf_model(console, hf_config, config, dtype)

    def shape(size: int) -> tuple[int, int]:
        """(batch, seq) at a size searched."""
        return (batch, size) if dim == "seq" else (size, seq)

    span = f"{sizes[0]}..{sizes[-1]}"
    note_model(console, config, model,
               f"batch {batch} x seq {span}" if dim == "seq" else f"batch {span} x seq {seq}")

    def plan_at(size: int) -> PlannedGraph:
        b, s = shape(size)
        return plan_workload(console, causal_lm_workload(config, batch=b, seq=s, model=model), budget, "cpsat",
                             time_limit_s, hold_outputs=hold_outputs_for(drop_outputs, hf_config), device=device,
                             label=f"{dim} {size}", fsdp=fsdp)

    result = fit_size(plan_at, sizes, on_probe=lambda probe: console.note(describe_probe(dim, probe)))
    step = sizes[0]  # the grid's step, the default resolved
    click.echo(format_fit(result, dim, step, parse_budget(budget).bytes))
    if result.best is None:
        raise NothingFits(_nothing_fits(budget, result.probes[0], shape, step))
    click.echo()
    emit_text(console, render(result.best.planned, fmt, all_rows), output)


def _fit_grid(ctx: click.Context, seq_max: int | None, batch_max: int | None, step: int | None,
              seq: int | None) -> tuple[str, list[int]]:
    """What fit searches (``"seq"`` or ``"batch"``) and the sizes it may try, the multiples of
    ``step``; a missing, doubled or contradicting option is a usage error."""
    if (seq_max is None) == (batch_max is None):
        raise click.UsageError("give --seq-max N (the longest sequence) or --batch-max N (the largest batch), "
                               "one of them")
    dim, size_max = ("seq", seq_max) if seq_max is not None else ("batch", batch_max)
    fixed = "--seq" if dim == "seq" else "--batch"
    if fixed in given_flags(ctx, {"seq": "--seq", "batch": "--batch"}):
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
