"""The gloo workaround in emitted graphs: free a collective's inputs where the plan frees them.

A functional collective's work object (gloo runs it on a background thread) holds the collective's
inputs until that thread lets go of it, which can be a few ops after ``wait_tensor`` returns on a busy
machine. So that memory is the plan's, not the scheduler's, :func:`release_after_waits` follows each
``wait_tensor`` with :func:`release_collective_inputs`, which holds the inputs until the work has
dropped them; they are freed right there. A ``wait_tensor`` follows its collective directly and
allocates nothing, so the live bytes the plan predicts do not change; a saved collective result is
saved as waited for, so its wait (and the release) stay in the forward.

The generated code spins: :func:`release_collective_inputs` busy-waits (``time.sleep(0)`` between
polls of the reference counts) for at most :data:`RELEASE_TIMEOUT_S` after each wait, on CPU tensors
only.

>>> fw = release_after_waits(fw)                                    # doctest: +SKIP
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.fx as fx

from passes.c10d import is_wait

__all__ = ["release_after_waits", "release_collective_inputs", "use_counts", "as_library_ops", "RELEASE_TIMEOUT_S"]

#: The longest :func:`release_collective_inputs` spins for one collective's inputs, in seconds.
RELEASE_TIMEOUT_S = 0.2


def _refs(t: torch.Tensor) -> tuple[int, int]:
    """References to a tensor and to its storage (a work object may hold either)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def use_counts(*tensors: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """References to each tensor and its storage before a collective is issued on it (the graph's own)."""
    return tuple(_refs(t) for t in tensors)


def release_collective_inputs(counts: tuple[tuple[int, int], ...], *tensors: torch.Tensor) -> None:
    """Spin (busy-wait, at most RELEASE_TIMEOUT_S) until no collective work holds ``tensors`` any more:
    their reference counts are back to ``counts``, taken before the collective was issued.

    CPU tensors only (gloo); on an accelerator the caching allocator and stream order decide when
    memory is reused, and its backends keep work objects for their own bookkeeping.

    Warns
    -----
    RuntimeWarning
        If a reference is still held after RELEASE_TIMEOUT_S (then it returns; the step may peak above
        the plan). Under the default warning filter this shows once per calling line of generated code.
    """
    if any(t.device.type != "cpu" for t in tensors):
        return
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(r > c for t, cs in zip(tensors, counts, strict=True) for r, c in zip(_refs(t), cs)):
        if time.monotonic() > deadline:
            warnings.warn(f"a collective's input was still held {RELEASE_TIMEOUT_S} s after its wait; "
                          "the step may peak above the plan by that input's size", RuntimeWarning,
                          stacklevel=2)
            return
        time.sleep(0)


def release_after_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """After each ``wait_tensor`` of a collective, hold the collective's tensor inputs until its work
    has released them (see the module docstring). Rewrites ``gm`` in place and returns it."""
    changed = False
    for w in list(gm.graph.nodes):
        if not is_wait(w) or not isinstance(w.args[0], fx.Node):
            continue
        coll = w.args[0]
        inputs = [a for a in coll.all_input_nodes if a.op != "get_attr"]
        if coll.op != "call_function" or not inputs:
            continue
        with gm.graph.inserting_before(coll):
            counts = gm.graph.call_function(use_counts, tuple(inputs))
        with gm.graph.inserting_after(w):
            gm.graph.call_function(release_collective_inputs, (counts, *inputs))
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# The same two steps as operators, for a compiler that lowers only operators (Inductor runs them as
# fallback kernels, in place, with their tensors alive up to the release): the counts travel as an
# int64 tensor, and the release is declared to write its tensors so that it is neither dropped nor
# moved before the wait.
@torch.library.custom_op("remat::collective_refs", mutates_args=())
def _collective_refs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([_refs(t) for t in tensors], dtype=torch.int64).reshape(len(tensors), 2)


@_collective_refs.register_fake
def _(tensors):
    return torch.empty((len(tensors), 2), dtype=torch.int64)


@torch.library.custom_op("remat::release_collective_inputs", mutates_args=("tensors",))
def _release(counts: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    release_collective_inputs(tuple(tuple(int(c) for c in row) for row in counts.tolist()), *tensors)


def as_library_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace the :func:`use_counts` / :func:`release_collective_inputs` calls that
    :func:`release_after_waits` wrote in ``gm`` with the equivalent ``remat::`` operators (for
    Inductor). Rewrites ``gm`` in place and returns it."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (use_counts, release_collective_inputs):
            continue
        if n.target is use_counts:
            n.target, n.args = torch.ops.remat.collective_refs.default, (list(n.args),)
            fake = n.args[0][0].meta.get("val") if n.args[0] else None
            if fake is not None:
                with fake.fake_mode:
                    n.meta["val"] = torch.empty((len(n.args[0]), 2), dtype=torch.int64)
        else:
            n.target, n.args = torch.ops.remat.release_collective_inputs.default, (n.args[0], list(n.args[1:]))
            n.meta["val"] = None
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
