"""Trace a model of many identical layers as a full trace would, from traces of 3 and 4 of them.

AOTAutograd traces a training step at about a third of a second per decoder layer on a 2-core
machine (fake-tensor dispatch, functionalization and proxying, per op), which was most of the time
it took to plan a 32- or 80-layer model built on the meta device. The joint graph of ``L`` identical
layers is regular: the placeholders, the forward and the backward each hold one run of nodes per
layer, in layer order (placeholders, forward) or reverse order (backward), between runs that belong
to no layer (embedding, head, loss). :func:`trace_stamped` traces the model with its layer container
cut to 3 and to 4 layers and builds the ``L``-layer graph from them (:mod:`.build`): layer 0 and the
last layer as traced, every layer between them a copy of the 4-layer trace's layer 1 whose inputs
are moved to its own neighbours.

The result is the graph a full trace gives, node for node: the same names, ops, arguments and
order, ``meta["val"]`` (FakeTensors of the traced sizes and strides, views of the copy's own
storages where the template's were views), module paths (``meta["custom"]``), ``seq_nr`` and
AOTAutograd's descriptors; so the same :meth:`~remat_compiler.graph.CostGraph.fingerprint`, costs
and plan. It is built only where the traces show the regularity it rests on; :func:`trace_stamped`
returns None (trace in full) otherwise:

- the container (the ``nn.ModuleList`` / ``nn.Sequential`` with the most children) holds layers of
  one class with the same parameter and buffer shapes and the same plain attributes (only
  ``layer_idx`` may differ: a sliding-window layer among full-attention ones is not a copy), and
  no parameter of the model is shared;
- in both traces every node belongs to one layer or to none, the layers' runs come in the order
  above, all layers have the same ops and values, the two middle layers read their inputs at the
  same offsets, a layer reads only itself, its neighbours and nodes of no layer, and nothing
  outside the layers reads a middle layer;
- the step mutates no input in place, and its forward outputs belong to no layer.

``fwd_nn_module_stack``, ``fwd_source_fn_stack`` and ``stack_trace`` are the template layer's
(module paths renamed to the copy's); none of the planner's passes reads them.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from remat_compiler.passes import keys
from remat_compiler.stamp.build import build
from remat_compiler.stamp.layout import StampError, Trace

__all__ = ["MIN_LAYERS", "TRACED_LAYERS", "repeated_layers", "trace_stamped", "StampError"]

#: The fewest layers stamped by default: two traces of 3 and 4 layers cost about what 8 in full do.
MIN_LAYERS = 12
#: The layer counts traced: 3 gives each counter's step per layer, 4 the template and its check.
TRACED_LAYERS = (3, 4)


def _signature(layer: torch.nn.Module) -> tuple:
    """What two layers share when one is a copy of the other: module classes, plain attributes
    (but ``layer_idx``), parameter and buffer shapes and dtypes."""
    sig = []
    for path, m in layer.named_modules():
        plain = tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in ("layer_idx", "training")
                             and not isinstance(v, (torch.nn.Module, torch.Tensor))))
        sig.append((path, type(m).__name__, plain))
    sig += [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in layer.named_parameters()]
    sig += [(n, tuple(t.shape), t.dtype) for n, t in layer.named_buffers()]
    return tuple(sig)


def repeated_layers(model: torch.nn.Module, min_layers: int = MIN_LAYERS
                    ) -> tuple[str, torch.nn.Module] | None:
    """The container of the model's identical layers, as ``(path, container)``, or None.

    It is the ``nn.ModuleList`` / ``nn.Sequential`` with the most children, at least
    ``min_layers`` and more than :data:`TRACED_LAYERS` traces, if they are all alike
    (:func:`_signature`) and no parameter of the model is shared between two places.

    >>> repeated_layers(model)  # doctest: +SKIP
    ('model.layers', ModuleList(...))
    """
    if len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.named_parameters())):
        return None
    best = None
    for path, m in model.named_modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) and \
                len(m) >= max(min_layers, TRACED_LAYERS[-1] + 1) and (best is None or len(m) > len(best[1])):
            best = (path, m)
    if best is None or len({_signature(layer) for layer in best[1]}) != 1:
        return None
    return best


@contextlib.contextmanager
def _cut(container: torch.nn.Module, k: int):
    """The container with only its first ``k`` children, for the duration."""
    full = container._modules
    container._modules = OrderedDict(list(full.items())[:k])
    try:
        yield
    finally:
        container._modules = full


def trace_stamped(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *,
                  hold_outputs: bool = True, device=None, min_layers: int | None = None,
                  strict: bool = False):
    """The :class:`~remat_compiler.trace.TracedStep` that :func:`~remat_compiler.trace.trace`
    gives for ``model``, built from traces of 3 and 4 of its layers; None where the model or its
    traces are not regular enough (module docstring), so that the caller traces it in full.

    Parameters
    ----------
    model, args, kwargs, hold_outputs, device :
        As :func:`~remat_compiler.trace.trace` takes them.
    min_layers : int, optional
        The fewest layers worth it (default :data:`MIN_LAYERS`).
    strict : bool
        Raise :class:`StampError` (why not) in place of returning None, where the model has the
        layers but its traces do not stamp (a model cut to 3 layers that does not trace is one).

    Returns
    -------
    TracedStep or None
        Its joint graph's ``gm.meta["remat.stamped"]`` says where it came from. Its ``step`` is
        the full model's, flattened but not run: its output structure is the one the 4-layer trace
        recorded. Planning reads only the joint graph.

    Raises
    ------
    UntraceableModelError
        As :func:`~remat_compiler.trace.trace`.
    """
    from remat_compiler.trace import TracedStep, flatten_step, trace

    found = repeated_layers(model, MIN_LAYERS if min_layers is None else min_layers)
    if found is None:
        return None
    path, container = found
    prefix = f"{path}." if path else ""
    try:
        traces = []
        for k in TRACED_LAYERS:
            with _cut(container, k):
                try:
                    traced = trace(model, args, kwargs, hold_outputs=hold_outputs, device=device)
                except Exception as exc:  # the full trace runs next and reports its own failure
                    raise StampError(f"the model cut to {k} layers does not trace: {exc}") from exc
            if traced.step.mutated_positions:
                raise StampError("the step mutates an input in place")
            traces.append(Trace(traced, prefix, k))
        joint, num_fwd = build(traces[0], traces[1], len(container), prefix)
        joint.meta[keys.STAMPED] = (path, len(container), TRACED_LAYERS)
    except StampError:
        if strict:
            raise
        return None
    step, _ = flatten_step(model, args, kwargs, hold_outputs=hold_outputs)
    done = traces[1].traced.step
    for attr in ("out_spec", "out_leaves", "out_tensor_positions", "no_grad_positions", "plans_for"):
        setattr(step, attr, getattr(done, attr))
    return TracedStep(joint=joint, num_fwd_outputs=num_fwd, step=step)
