"""Workloads named on the command line: ``MODULE:FACTORY`` specs that build a model and an example call.

A factory is a function returning ``(model, example_inputs, loss_fn)``: ``example_inputs`` is a tuple
of positional arguments or a dict of keyword arguments, and ``loss_fn(output) -> scalar`` may be None
(or left out) for models whose output is the loss (a scalar tensor, or an object with ``.loss``, as
HuggingFace models return when given labels).

>>> w = load_workload("examples/demo.py:build", {"batch": 64})        # doctest: +SKIP
>>> w.loss(w.model(*w.args, **w.kwargs)).backward()                    # doctest: +SKIP
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["Workload", "FactoryError", "load_factory", "load_workload", "parse_factory_args",
           "compute_loss"]


class FactoryError(ValueError):
    """A ``MODULE:FACTORY`` spec that names nothing usable, or a factory that breaks the contract."""


@dataclass
class Workload:
    """A model and one example training call, as a factory built them.

    Attributes
    ----------
    model : torch.nn.Module
    args : tuple
        Positional example inputs.
    kwargs : dict
        Keyword example inputs.
    loss_fn : callable or None
        ``loss_fn(output) -> scalar tensor``; None when the output is the loss.
    spec : str
        The ``MODULE:FACTORY`` it came from.
    """

    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    loss_fn: Callable[[Any], torch.Tensor] | None = None
    spec: str = ""

    def loss(self, output: Any) -> torch.Tensor:
        """The scalar loss of one model output (see :func:`compute_loss`)."""
        return compute_loss(self.loss_fn, output)

    def input_leaves(self) -> list[torch.Tensor]:
        """Example input tensors that require grad (their gradients are part of the step)."""
        leaves = [*self.args, *self.kwargs.values()]
        return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def compute_loss(loss_fn: Callable[[Any], torch.Tensor] | None, output: Any) -> torch.Tensor:
    """Apply ``loss_fn``, or take the output (or its ``.loss``) as the loss when there is none.

    Parameters
    ----------
    loss_fn : callable or None
    output : Any
        What the model returned.

    Returns
    -------
    torch.Tensor
        A one-element tensor.

    Raises
    ------
    ValueError
        If there is no loss_fn and the output is neither a one-element tensor nor has ``.loss``.
    """
    if loss_fn is not None:
        return loss_fn(output)
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"the factory gave no loss_fn and the model's output ({type(output).__name__}) "
                         "is not a scalar loss and has no .loss; return (model, inputs, loss_fn)")
    return loss


def parse_factory_args(pairs) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings into factory keyword arguments.

    Values are Python literals when they parse as one (``4``, ``0.5``, ``True``, ``'gelu'``),
    otherwise plain strings.

    Parameters
    ----------
    pairs : iterable of str

    Returns
    -------
    dict

    Raises
    ------
    FactoryError
        For an item without ``=`` or whose key is not an identifier.

    Example
    -------
    >>> parse_factory_args(["width=32", "act=gelu"])
    {'width': 32, 'act': 'gelu'}
    """
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise FactoryError(f"factory argument {item!r} is not KEY=VALUE with an identifier KEY")
        try:
            out[key] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key] = text.strip()
    return out


def _package_root(path: Path) -> tuple[Path, str]:
    """The folder to put on ``sys.path`` and the dotted module name of a .py file inside packages."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _import_file(path: Path):
    """Import a .py file; files inside packages are imported under their dotted name."""
    path = path.resolve()
    root, dotted = _package_root(path)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))  # as ``python FILE`` does, so the file's own imports work
    if "." in dotted:
        module = _import_module(dotted)
        if Path(module.__file__).resolve() != path.resolve():
            raise FactoryError(f"{path} is in package {dotted.rpartition('.')[0]!r}, but importing "
                               f"{dotted!r} gives {module.__file__}: another package shadows it")
        return module
    spec = importlib.util.spec_from_file_location(f"_remat_workload_{dotted}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_module(dotted: str):
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name and (dotted == exc.name or dotted.startswith(exc.name + ".")):
            raise FactoryError(f"no module named {dotted!r} (a MODULE:FACTORY names a .py file or an "
                               "importable module)") from exc
        raise  # the module exists but one of its own imports failed: not a spec problem


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``MODULE:FACTORY`` to the factory function.

    Parameters
    ----------
    spec : str
        ``path/to/file.py:NAME`` or ``dotted.module:NAME``.

    Returns
    -------
    callable

    Raises
    ------
    FactoryError
        If the spec has no ``:``, the file or module does not exist, or NAME is not a callable in it.
        Errors raised while the module itself runs are not caught.
    """
    module_part, sep, name = spec.rpartition(":")
    if not sep or not module_part or not name:
        raise FactoryError(f"{spec!r} is not MODULE:FACTORY (e.g. examples/gpt2.py:build)")
    looks_like_file = module_part.endswith(".py") or os.sep in module_part or "/" in module_part
    if looks_like_file:
        path = Path(module_part)
        if not path.is_file():
            raise FactoryError(f"file {module_part!r} does not exist")
        module = _import_file(path)
    else:
        module = _import_module(module_part)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise FactoryError(f"{module_part!r} has no function {name!r}")
    return factory


def load_workload(spec: str, factory_kwargs: dict[str, Any] | None = None) -> Workload:
    """Call the factory that ``spec`` names and check what it returns.

    Parameters
    ----------
    spec : str
        ``MODULE:FACTORY``.
    factory_kwargs : dict, optional
        Keyword arguments for the factory (the CLI's ``--arg KEY=VALUE``).

    Returns
    -------
    Workload

    Raises
    ------
    FactoryError
        For a bad spec, arguments the factory does not take, or a result that is not
        ``(nn.Module, tuple | dict[, loss_fn])``.
    """
    factory = load_factory(spec)
    kwargs = dict(factory_kwargs or {})
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise FactoryError(f"{spec} does not take arguments {sorted(kwargs)}: {exc}") from exc
    except ValueError:  # no signature to inspect (a builtin): let the call decide
        pass
    return _check_result(spec, factory(**kwargs))


def _check_result(spec: str, result: Any) -> Workload:
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise FactoryError(f"{spec} returned {type(result).__name__}, expected "
                           "(model, example_inputs, loss_fn)")
    model, inputs, loss_fn = (*result, None)[:3]
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"{spec} returned a {type(model).__name__} as the model, expected an nn.Module")
    if isinstance(inputs, dict):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise FactoryError(f"{spec}: example_inputs must be a tuple of positional arguments or a dict "
                           f"of keyword arguments, got {type(inputs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise FactoryError(f"{spec}: loss_fn must be callable or None, got {type(loss_fn).__name__}")
    return Workload(model=model, args=args, kwargs=kwargs, loss_fn=loss_fn, spec=spec)
