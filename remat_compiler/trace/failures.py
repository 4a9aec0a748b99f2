"""Why a trace failed, in one sentence a user can act on: the op, the user's line and module, and what
to do instead (:func:`describe_trace_failure`)."""
from __future__ import annotations

import traceback
from typing import Sequence

import torch

from remat_compiler.trace_sites import IndexSite, user_frame

__all__ = ["is_tracing_failure", "describe_trace_failure"]


def is_tracing_failure(exc: Exception) -> bool:
    """Whether ``exc`` (or an exception it chains) says the step has a data-dependent shape or value."""
    names = {type(e).__name__ for e in _exception_chain(exc)}
    markers = ("DataDependent", "GuardOnDataDependent", "Unsupported", "UnsupportedOperator",
               "DynamicOutputShape", "TraceError")
    text = " ".join(str(e) for e in _exception_chain(exc))
    return any(m in n for n in names for m in markers) or "data-dependent" in text.lower() \
        or "data dependent" in text.lower() or "_local_scalar_dense" in text or "nonzero" in text


def _exception_chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _module_hint(failed: tuple[str, torch.nn.Module] | None) -> tuple[str, str | None]:
    """(where: the module whose forward failed, why it has no static-shape graph and what to do
    instead, where that is known)."""
    if failed is None:
        return "", None
    path, module = failed
    where = f" in module {path or '(the model)'!r} ({type(module).__name__})"
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) == "eager" and hasattr(module, "_apply_gate"):
        # transformers' use_experts_implementation: "eager" is the original per-expert Python loop
        return where, ("transformers' experts_implementation='eager' loops in Python over the experts "
                       "that received tokens (nonzero of the routing mask, then torch.where for each "
                       "expert's tokens), so how many expert GEMMs run and how many rows each has depend "
                       "on the routing values: no static-shape graph exists. Build the model with "
                       "experts_implementation='grouped_mm' (transformers' default; or call "
                       "model.set_experts_implementation('grouped_mm')), whose grouped GEMMs over all "
                       "tokens x top-k routed rows have static shapes.")
    return where, None


def describe_trace_failure(exc: Exception, failed: tuple[str, torch.nn.Module] | None = None,
                           sites: Sequence[IndexSite] = (), advice: str | None = None) -> str:
    """The message: the failing op, the model line (or, for a failure in backward, the model's
    boolean-mask indexing lines, :func:`~remat_compiler.trace_sites.boolean_index_sites`), the
    module (``failed``: its path and module, where known), and what to do (the module's or the model
    family's advice where known)."""
    op = None
    for e in _exception_chain(exc):
        for token in str(e).replace("(", " ").replace(")", " ").replace(",", " ").split():
            if token.startswith("aten.") or token.startswith("torch.ops."):
                op = token.rstrip(".:")
                break
        if op:
            break
    frame = user_frame(traceback.extract_tb(exc.__traceback__))
    where = f" at {frame.filename}:{frame.lineno} ({frame.line!s})" if frame else ""
    if not frame and sites:
        where = (" in backward, from the boolean-mask indexing at " + "; ".join(map(str, sites))
                 + " (its backward indexes by the mask, a shape that depends on the data)")
    what = f"op {op}" if op else f"{type(exc).__name__}"
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    in_module, why = _module_hint(failed)
    if why is not None:
        return (f"could not trace the model's training step: {what}{where}{in_module} has a "
                f"data-dependent shape or value ({first_line}): {why}")
    advice = f"; {advice}" if advice else ""
    return (f"could not trace the model's training step: {what}{where}{in_module} has a data-dependent "
            f"shape or value ({first_line}). Make that part static (fixed shapes, no .item()/.nonzero() on "
            f"activations, no Python branching on tensor values) or run it outside the compiled module{advice}.")
