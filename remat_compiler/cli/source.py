"""Loading the model a command plans: a ``MODULE:FACTORY`` workload or a ``--hf-config`` causal LM."""
from __future__ import annotations

import click

from remat_compiler.cli.console import Console, timed
from remat_compiler.hf_config import (ConfigError, build_causal_lm, causal_lm_workload, check_seq, config_dtype,
                                      load_config)
from remat_compiler.workload import FactoryError, Workload, load_workload

__all__ = ["load_factory_workload", "given_flags", "refuse_flags", "load_source", "load_hf_config",
           "check_seq_flag", "build_hf_model", "note_model", "hold_outputs_for"]


def load_factory_workload(spec: str, factory_kwargs: dict, console: Console) -> Workload:
    """Build the factory's workload; a spec that names nothing usable is a bad argument."""
    with timed(console, f"build {spec}"):
        try:
            return load_workload(spec, factory_kwargs)
        except FactoryError as exc:
            raise click.BadParameter(str(exc), param_hint="MODULE:FACTORY") from exc


def given_flags(ctx: click.Context, flags: dict[str, str]) -> list[str]:
    """The flags among ``{parameter: flag}`` given on the command line."""
    return [flag for name, flag in flags.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]


def refuse_flags(ctx: click.Context, flags: dict[str, str], message: str) -> None:
    """A usage error where any of ``flags`` was given: ``message`` with ``{flags}`` the given ones."""
    given = given_flags(ctx, flags)
    if given:
        raise click.UsageError(message.format(flags=", ".join(given)))


def load_source(ctx: click.Context, console: Console, source: dict) -> Workload:
    """The workload that :func:`model_source`'s options name; a missing, doubled or mismatched
    option, or a config that builds no model, is a bad argument."""
    factory, hf_config = source["factory"], source["hf_config"]
    if (factory is None) == (hf_config is None):
        raise click.UsageError("name the model with MODULE:FACTORY or with --hf-config CONFIG.json (one of "
                               "them)")
    if factory is not None:
        refuse_flags(ctx, {"batch": "--batch", "seq": "--seq", "dtype": "--dtype"},
                     "{flags}: only with --hf-config (pass a factory's sizes with --arg KEY=VALUE)")
        return load_factory_workload(factory, source["factory_kwargs"], console)
    if source["factory_kwargs"]:
        raise click.UsageError("--arg passes keyword arguments to a MODULE:FACTORY; the --hf-config "
                               "model's sizes are --batch, --seq and --dtype")
    if source["seq"] is None:
        raise click.UsageError("--hf-config needs --seq N (tokens per sequence)")
    config = load_hf_config(hf_config)
    check_seq_flag(config, source["seq"], "--seq")
    model = build_hf_model(console, hf_config, config, source["dtype"])
    note_model(console, config, model, f"batch {source['batch']} x seq {source['seq']}")
    return causal_lm_workload(config, batch=source["batch"], seq=source["seq"], model=model)


def load_hf_config(path: str):
    """The transformers config ``--hf-config`` names; one that does not load is a bad argument."""
    try:
        return load_config(path)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--hf-config") from exc


def check_seq_flag(config, seq: int, flag: str) -> None:
    """Refuse a sequence length (given as ``flag``) the config cannot run, as a bad argument."""
    try:
        check_seq(config, seq)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=flag) from exc


def build_hf_model(console: Console, path: str, config, dtype: str | None):
    """The config's causal LM on the meta device, in ``dtype`` (default: the config's); a config that
    builds no model is a bad argument."""
    with timed(console, f"build the model of {path} on the meta device"):
        try:
            return build_causal_lm(config, config_dtype(config, dtype))
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--hf-config") from exc


def note_model(console: Console, config, model, shape: str) -> None:
    """Note on stderr what was built: the model's class, parameters, dtype and the step's tokens."""
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    console.note(f"{type(model).__name__} from the {config.model_type} config: {params:,} parameters in "
                 f"{dtype} on the meta device, {shape} tokens")


def hold_outputs_for(drop_outputs: bool | None, hf_config: str | None) -> bool:
    """--drop-outputs / --hold-outputs, or the default: held, except for an --hf-config step."""
    return not drop_outputs if drop_outputs is not None else hf_config is None
