"""Causal language models from a transformers config file on disk, built on the meta device.

The CLI's ``--hf-config``: planning needs the graph's shapes and dtypes, not weights, so a model of
any size is built with ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")`` (nothing
is allocated, nothing is downloaded) and traced with meta token ids.

The step planned is ``model(input_ids=ids, labels=ids).loss.backward()``: the model computes its own
loss (so the loss and its backward are inside the plan), and a training loop that calls it keeps only
the loss, so plan it with ``hold_outputs=False``.

>>> config = load_config("config.json")                                   # doctest: +SKIP
>>> w = causal_lm_workload(config, batch=1, seq=4096, dtype="bfloat16")    # doctest: +SKIP
>>> plan_model(w.model, w.args, w.kwargs, "70GiB", hold_outputs=False)     # doctest: +SKIP
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from remat_compiler.workload import Workload

__all__ = ["ConfigError", "DTYPES", "load_config", "config_dtype", "max_positions", "check_seq",
           "build_causal_lm", "token_inputs", "causal_lm_workload"]

#: The ``--dtype`` names and their torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A file that is not a transformers config, or a config no causal language model is built from."""


def load_config(path: str | os.PathLike):
    """Read a transformers config from a ``config.json`` (or a folder holding one), offline.

    Parameters
    ----------
    path : str or PathLike

    Returns
    -------
    transformers.PretrainedConfig
        The config class its ``model_type`` names, with every field of the file.

    Raises
    ------
    ConfigError
        If the file does not exist, is not JSON, has no ``model_type`` or one this transformers does
        not know, or its fields do not make a config.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"{file} does not exist (give a transformers config.json, or a folder with one)")
    try:
        doc = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file} is not a JSON file ({exc}): give a transformers config.json") from exc
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ConfigError(f"{file} is not a transformers config: it has no \"model_type\" field (a model's "
                          "config.json names one, e.g. \"llama\"; config.save_pretrained(folder) writes it)")
    model_type = doc["model_type"]
    if model_type not in CONFIG_MAPPING:
        import transformers

        raise ConfigError(f"{file}: model_type {model_type!r} is not one transformers {transformers.__version__} "
                          "knows (a model whose code lives in its hub repository is not planned from a "
                          "config: build it in a MODULE:FACTORY)")
    try:
        return CONFIG_MAPPING[model_type].from_dict(doc)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{file} is not a valid {model_type} config: {type(exc).__name__}: {exc}") from exc


def config_dtype(config, name: str | None = None) -> torch.dtype:
    """The dtype to build the model in: ``name`` (a :data:`DTYPES` key) if given, else the config's own
    ``dtype`` (transformers reads an older file's ``torch_dtype`` into it) when it is one of them, else
    float32.

    Raises
    ------
    ConfigError
        For a name that is not a :data:`DTYPES` key.
    """
    if name is not None:
        if name not in DTYPES:
            raise ConfigError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
        return DTYPES[name]
    own = getattr(config, "dtype", None)
    own = str(own).removeprefix("torch.") if own is not None else None
    return DTYPES.get(own, torch.float32)


def max_positions(config) -> int | None:
    """The longest sequence the config declares (``max_position_embeddings``, GPT-2's ``n_positions``)."""
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) else None


def check_seq(config, seq: int) -> None:
    """Refuse a sequence longer than the config declares (a meta model would trace it, and the real
    one fail or run past its position embeddings).

    Raises
    ------
    ConfigError
    """
    limit = max_positions(config)
    if limit is not None and seq > limit:
        raise ConfigError(f"seq {seq} is above the config's max_position_embeddings ({limit}): raise it in "
                          "the config if the model takes longer sequences")


def build_causal_lm(config, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` on the meta device, in ``dtype``, in training mode.

    Raises
    ------
    ConfigError
        If transformers builds no causal language model from this config (an encoder, a model whose
        code is not in transformers), or the config's sizes do not make one.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"transformers has no causal language model (AutoModelForCausalLM) for model_type "
                          f"{config.model_type!r}: plan its model with a MODULE:FACTORY")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    except ValueError as exc:  # transformers' own refusal (inconsistent sizes, remote code)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"transformers builds no causal language model (AutoModelForCausalLM) from this "
                          f"{config.model_type} config: {first_line}") from exc
    return model.train()


def token_inputs(batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Meta token ids of shape ``batch x seq``, passed as ``input_ids`` and as ``labels``."""
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def causal_lm_workload(config, *, batch: int, seq: int, dtype: str | None = None,
                       model: torch.nn.Module | None = None) -> Workload:
    """The training step of a config's causal language model on ``batch x seq`` meta tokens.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        From :func:`load_config`.
    batch, seq : int
    dtype : str, optional
        A :data:`DTYPES` key; default: see :func:`config_dtype`.
    model : nn.Module, optional
        The model :func:`build_causal_lm` built from this config before (a search over sizes builds
        it once).

    Returns
    -------
    Workload
        Keyword inputs ``input_ids`` and ``labels``; its loss is the output's ``.loss``.

    Raises
    ------
    ConfigError
        For a sequence above the config's limit, an unknown dtype, or a config no causal LM is built from.
    """
    check_seq(config, seq)
    if model is None:
        model = build_causal_lm(config, config_dtype(config, dtype))
    return Workload(model, (), token_inputs(batch, seq), spec=f"{config.model_type} config")
