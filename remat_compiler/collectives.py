"""The gloo workaround in emitted graphs: free a collective's tensors where the plan frees them.

A functional collective's work object (gloo runs it on a background thread) holds the collective's
inputs and its result until that thread lets go of it, which can be a few ops after ``wait_tensor``
returns on a busy machine (on 2 gloo ranks the result was seen held after the inputs were let go of,
freed later by gloo's thread). So that memory is the plan's, not the scheduler's,
:func:`release_after_waits` follows each ``wait_tensor`` with :func:`release_collective_inputs`, which
holds the inputs and the result until the work has dropped them; each is then freed where the graph
drops it. A ``wait_tensor`` follows its collective directly and allocates nothing, so the live bytes
the plan predicts do not change; a saved collective result is saved as waited for, so its wait (and the
release) stay in the forward.

The generated code spins: :func:`release_collective_inputs` busy-waits (``time.sleep(0)`` between
polls of the reference counts) for at most :data:`RELEASE_TIMEOUT_S` after each wait, on CPU tensors
only. Where the work still holds a tensor as the release starts, it also waits for the last step of
gloo's release that needs Python: while a tensor has an owner besides its Python object, the tensor
holds a reference to that object (torch's PyObject preservation), and the owner that brings the
count back to one drops it, under the GIL. gloo's thread then waits for the GIL, so the counts read
"released" before it has; had the graph dropped the tensor in between, gloo's thread freed it at the
next GIL switch, later than planned (seen as an FSDP step that measured one gathered unit above its
plan in a few steps in a thousand: ``python -m benchmarks.gloo_release``). Where gloo's thread has
brought the count back to one before the release starts, the release cannot tell and returns.

>>> fw = release_after_waits(fw)                                    # doctest: +SKIP
"""
from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.fx as fx

from remat_compiler.passes.c10d import is_wait

__all__ = ["release_after_waits", "release_collective_inputs", "use_counts", "as_library_ops", "RELEASE_TIMEOUT_S"]

#: The longest :func:`release_collective_inputs` spins for one collective's inputs, in seconds.
RELEASE_TIMEOUT_S = 0.2


def _refs(t: torch.Tensor) -> tuple[int, int]:
    """References to a tensor and to its storage (a work object may hold either)."""
    return t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _python_refs(tensors) -> list[int]:
    """Python's reference counts of ``tensors`` (each read the same way, so two reads compare)."""
    return [sys.getrefcount(t) for t in tensors]


#: The references a collective's fresh result has once its work has let go, right after its wait (no
#: views of it yet): the graph's one tensor object, and for its storage that tensor and the storage
#: object :func:`_refs` looks through.
FRESH_RESULT = (1, 2)


def use_counts(*tensors: torch.Tensor, results: int = 0) -> tuple[tuple[int, int], ...]:
    """References to each tensor and its storage before a collective is issued on it (the graph's own),
    then :data:`FRESH_RESULT` for each of the ``results`` tensors the collective allocates."""
    return tuple(_refs(t) for t in tensors) + (FRESH_RESULT,) * results


def release_collective_inputs(counts: tuple[tuple[int, int], ...], *tensors: torch.Tensor) -> None:
    """Spin (busy-wait, at most RELEASE_TIMEOUT_S) until no collective work holds ``tensors`` any more:
    their reference counts are back to ``counts`` (:func:`use_counts`: taken before the collective was
    issued, and :data:`FRESH_RESULT` for a result the collective allocated).

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
    # a tensor the graph alone owned before (a count of one) that the work holds now: its Python object
    # carries one reference more until the work's last release has run under the GIL (the counts are
    # read first: the work may bring them down at any time, but that reference only under the GIL; a
    # switch of the GIL between the two reads, this thread descheduled for the switch interval, makes
    # the spin wait for a reference already dropped: it warns after RELEASE_TIMEOUT_S)
    lent = [cs[0] == 1 and t._use_count() > 1 for t, cs in zip(tensors, counts, strict=True)]
    settled = [p - 1 if held else p for p, held in zip(_python_refs(tensors), lent)]
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while (any(r > c for t, cs in zip(tensors, counts, strict=True) for r, c in zip(_refs(t), cs))
           or any(p > s for p, s in zip(_python_refs(tensors), settled))):
        if time.monotonic() > deadline:
            warnings.warn(f"a collective's tensor was still held {RELEASE_TIMEOUT_S} s after its wait; "
                          "the step may peak above the plan by that tensor's size", RuntimeWarning,
                          stacklevel=2)
            return
        time.sleep(0)


def _allocates_result(coll: fx.Node) -> bool:
    """True when the collective returns a tensor of its own (functional collectives), not one of its
    inputs written in place (whose count the inputs' already cover)."""
    schema = getattr(coll.target, "_schema", None)
    return (schema is not None and len(schema.returns) == 1 and schema.returns[0].alias_info is None
            and str(schema.returns[0].type) == "Tensor")


def release_after_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """After each ``wait_tensor`` of a collective, hold the collective's tensor inputs and its result
    until its work has released them (see the module docstring). Rewrites ``gm`` in place and returns it."""
    changed = False
    for w in list(gm.graph.nodes):
        if not is_wait(w) or not isinstance(w.args[0], fx.Node):
            continue
        coll = w.args[0]
        inputs = [a for a in coll.all_input_nodes if a.op != "get_attr"]
        if coll.op != "call_function" or not inputs:
            continue
        results = [w] if _allocates_result(coll) else []
        with gm.graph.inserting_before(coll):
            counts = gm.graph.call_function(use_counts, tuple(inputs), {"results": len(results)})
        with gm.graph.inserting_after(w):
            gm.graph.call_function(release_collective_inputs, (counts, *inputs, *results))
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# The same two steps as operators, for a compiler that lowers only operators (Inductor runs them as
# fallback kernels, in place, with their tensors alive up to the release). Both are declared to write
# their tensors, so that neither is dropped or moved across the collective and its wait, and so that a
# call of either holds the same references of its own to each tensor of its list (three in torch 2.13's
# grad mode): counts taken inside one compare with counts taken inside the other. The counts travel as
# an int64 tensor, first in the release's list; made by the first operator and held by one variable,
# it is also the measure of a fresh result (FRESH_RESULT's one tensor reference, plus the call's).
# The Python reference gloo's thread drops last (module docstring) is not waited for in this form:
# during the call each tensor has the call's references besides its Python object, so gloo's thread
# never brings a count back to one then; where it did so just before the call, the release cannot
# tell (not seen in the Inductor rows, whose allocator peaks equal the walk).
@torch.library.custom_op("remat::collective_refs", mutates_args=("tensors",))
def _collective_refs(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor(use_counts(*tensors), dtype=torch.int64).reshape(len(tensors), 2)


@_collective_refs.register_fake
def _(tensors):
    return torch.empty((len(tensors), 2), dtype=torch.int64)


@torch.library.custom_op("remat::release_collective_inputs", mutates_args=("tensors",))
def _release(tensors: list[torch.Tensor]) -> None:
    counts, held = tensors[0], tensors[1:]
    rows = tuple((c, s) for c, s in counts.tolist())
    fresh = (counts._use_count(), FRESH_RESULT[1])  # as FRESH_RESULT, with this call's references
    release_collective_inputs(rows + (fresh,) * (len(held) - len(rows)), *held)


def as_library_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace the :func:`use_counts` / :func:`release_collective_inputs` calls that
    :func:`release_after_waits` wrote in ``gm`` with the equivalent ``remat::`` operators (for
    Inductor). Rewrites ``gm`` in place and returns it."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (use_counts, release_collective_inputs):
            continue
        if n.target is use_counts:
            n.target, n.args, n.kwargs = torch.ops.remat.collective_refs.default, (list(n.args),), {}
            fake = n.args[0][0].meta.get("val") if n.args[0] else None
            if fake is not None:
                with fake.fake_mode:
                    n.meta["val"] = torch.empty((len(n.args[0]), 2), dtype=torch.int64)
        else:
            n.target, n.args = torch.ops.remat.release_collective_inputs.default, (list(n.args),)
            n.meta["val"] = None
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
