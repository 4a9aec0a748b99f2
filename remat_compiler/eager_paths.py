"""Trace the step eager runs: the paths a model takes only because it is told it is compiling are
switched back, and the model's own ``torch.utils.checkpoint`` is planned through (both kinds).

The trace tells models they are being compiled (``torch.compiler.is_compiling()`` is True, as under
``torch.compile``) so that they skip data-dependent fast-path checks. Some models also switch
*algorithms* on that flag: transformers' Mamba, Jamba, FalconMamba and Zamba mixers take an
associative scan instead of the sequential loop eager runs (their ``use_associative_scan``, True by
default), and that scan's no-recompute peak is 1.60x eager's on Mamba and 1.37x on Jamba. A user
compiles to save memory, not to switch kernels: while tracing, each module's switch in
:data:`COMPILE_ONLY_SWITCHES` is set to eager's value (and restored after), so the planned step is
the one eager runs.

``torch.utils.checkpoint`` inside the model: the non-reentrant form is traced through (the plan
decides recomputation itself); the reentrant form (``use_reentrant=True``, a common recipe in
transformers' ``gradient_checkpointing_kwargs``) runs its backward through ``torch.autograd.backward``,
which a joint trace cannot follow. While tracing, the reentrant form is planned through as the
non-reentrant one is: the checkpointed function runs in place, with gradients exactly as the
reentrant checkpoint gives them (none reach the function's parameters when no tensor input
requires grad, as there).

Every change is recorded as a note on the traced step (``gm.meta["remat.trace_notes"]``), carried
into the plan (``plan.extras["trace_notes"]``) and printed by ``plan.explain()``. A fraction budget
is a fraction of the no-recompute peak of the step as traced; where the model's checkpointing was
planned through, that is the step without it, and :func:`warn_fraction_of_uncheckpointed` says so.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["COMPILE_ONLY_SWITCHES", "as_eager_runs", "warn_fraction_of_uncheckpointed",
           "FractionOfUncheckpointedWarning", "CHECKPOINT_NOTE"]

#: Module attributes that select a compile-only path, and the value eager's path has.
COMPILE_ONLY_SWITCHES: dict[str, object] = {
    # transformers' Mamba-family mixers: the associative scan runs only under is_compiling()
    "use_associative_scan": False,
}

#: The start of the note recorded where the model's own checkpointing was planned through.
CHECKPOINT_NOTE = "the model's own torch.utils.checkpoint"


class FractionOfUncheckpointedWarning(UserWarning):
    """A fraction budget on a model whose own checkpointing the plan sees through: the fraction is
    of the no-recompute peak without that checkpointing, above the peak the model had with it."""


@contextlib.contextmanager
def as_eager_runs(model: torch.nn.Module) -> Iterator[list[str]]:
    """While the step is traced: compile-only switches set to eager's path, and the reentrant
    checkpoint planned through. Yields the list of notes, filled while tracing (and complete once
    the step has been traced forward and backward)."""
    notes: list[str] = []
    switched: list[tuple[torch.nn.Module, str, object]] = []
    for path, module in model.named_modules():
        for attr, eager_value in COMPILE_ONLY_SWITCHES.items():
            value = vars(module).get(attr)
            if isinstance(value, bool) and value != eager_value:
                switched.append((module, attr, value))
                setattr(module, attr, eager_value)
                notes.append(f"{path or '(model)'}: {attr}={eager_value!r} while tracing, the path eager runs "
                             f"({attr}={value!r} takes effect only under torch.compile)")
    kinds: set[str] = set()

    def seen(kind: str) -> None:  # noted at once: the joint graph is annotated before the trace ends
        if kind not in kinds:
            kinds.add(kind)
            notes.append(f"{CHECKPOINT_NOTE} ({kind}) planned through: the plan decides what is recomputed, "
                         "and its no-recompute peak is the step without that checkpointing")
    real_function, real_generator = torch_checkpoint.CheckpointFunction, \
        torch_checkpoint._checkpoint_without_reentrant_generator

    class _PlannedThrough:  # stands in for CheckpointFunction while tracing
        @staticmethod
        def apply(function, _preserve_rng_state, *args):
            seen("reentrant")
            if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return function(*args)
            with torch.no_grad():  # as the reentrant checkpoint: no gradient reaches the function
                return function(*args)

    def counted(*args, **kwargs):
        seen("non-reentrant")
        return real_generator(*args, **kwargs)

    torch_checkpoint.CheckpointFunction = _PlannedThrough
    torch_checkpoint._checkpoint_without_reentrant_generator = counted
    try:
        yield notes
    finally:
        torch_checkpoint.CheckpointFunction = real_function
        torch_checkpoint._checkpoint_without_reentrant_generator = real_generator
        for module, attr, value in switched:
            setattr(module, attr, value)


def warn_fraction_of_uncheckpointed(fraction: float | None, notes, baseline_peak_bytes: int) -> None:
    """Warn where a fraction budget meets a model whose own checkpointing was planned through."""
    if fraction is None or not any(n.startswith(CHECKPOINT_NOTE) for n in notes or ()):
        return
    from remat_compiler.budget import human_bytes

    warnings.warn(
        f"memory_budget={fraction} is a fraction of the no-recompute peak of the step without the model's own "
        f"checkpointing ({human_bytes(baseline_peak_bytes)}), which remat_compiler plans through; it is "
        "not a fraction of the peak the model had with its checkpointing. Pass the budget in bytes (e.g. "
        "'2GiB', or the peak you measured) to bound the step absolutely, or disable the model's "
        "checkpointing (e.g. gradient_checkpointing_disable()) since the plan recomputes what it needs.",
        FractionOfUncheckpointedWarning, stacklevel=3)
