"""The click options several commands share, and :func:`model_source` (MODULE:FACTORY or --hf-config)."""
from __future__ import annotations

import click

from remat_compiler.cli.params import factory_args
from remat_compiler.hf_config import DTYPES
from remat_compiler.passes.costs import DEVICE_PRESETS

__all__ = ["factory_argument", "factory_args_option", "time_limit_option", "drop_outputs_option", "hf_config_option",
           "batch_option", "seq_option", "dtype_option", "device_option", "fsdp_option",
           "model_source"]


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
    --dtype), and --fsdp; read them with :func:`~remat_compiler.cli.source.load_source`."""
    options = [click.argument("factory", metavar="[MODULE:FACTORY]", required=False), factory_args_option,
               hf_config_option, batch_option, seq_option, dtype_option, fsdp_option]
    for option in reversed(options):
        command = option(command)
    return command
