"""The first step of a plan's Inductor code, measured against the walk of it (:class:`FirstStepCheck`),
and the wrappers' own buffers shown to a tracker (:func:`watch`)."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.inductor.graph import InductorGraph, UnreadableCodeError
from remat_compiler.memory import LiveStorageTracker
from remat_compiler.passes.allocator import allocator_named

__all__ = ["FirstStepCheck", "watch"]


class FirstStepCheck:
    """Measure the first step a plan's Inductor code runs: the walk's prediction checked against
    what ran, so that code peaking above its budget is never run on silently.

    A :class:`~remat_compiler.memory.LiveStorageTracker`, shown the wrappers' own buffers by
    :func:`watch`, is active while the forward runs and again while the backward runs; between the
    two (the caller's code, the loss outside the model) it only sees frees. Its peak is the step's in
    the walk's accounting: the forward's allocations, the outputs the caller holds, the saved values,
    the gradients fed to the backward (counted as it starts, as the walk counts them) and all the
    backward allocates. A forward run again before any backward starts the measure again (the step
    measured is the last forward's and the first backward's); once a backward has run, the graphs
    run unmeasured. What it cannot see: tensors a fallback kernel makes and frees inside itself
    (the tracker sees the kernel's outputs, not its inner operations).

    Parameters
    ----------
    fw, bw : InductorGraph
        The plan's compiled forward and backward; the check attaches itself to both.
    num_fwd_outputs : int
        The forward's outputs that are the caller's (the rest are saved for the backward).
    report : callable
        Called once the first backward has run (inside autograd's backward: once it is over) with
        the measured peak and the bytes of the ``unheld`` outputs still alive then: those the caller
        held through the backward (0 where none).
    allocator : str
        The :mod:`remat_compiler.passes.allocator` model each storage is charged by, the walk's (the cost graph's).
    unheld : sequence of int
        Positions of the caller's outputs that the walk counts as freed once the forward returns
        (``hold_outputs=False``: all but the scalar ones). A caller that keeps one through the
        backward (``out = m(x); out.loss.backward()``) puts the step above the walk by its bytes.
    """

    def __init__(self, fw: InductorGraph, bw: InductorGraph, num_fwd_outputs: int,
                 report: Callable[[int, int], None], *, allocator: str = "exact", unheld: Sequence[int] = ()):
        self.tracker = None  # each forward's own
        self._allocator = allocator_named(allocator)
        self._fw, self._bw = fw, bw
        self._num_fwd_outputs = num_fwd_outputs
        self._report = report
        self._unheld = tuple(unheld)
        self._num_saved: int | None = None  # known once the forward has run
        self._outputs: dict[StorageWeakRef, int] = {}  # the last forward's unheld outputs: bytes
        fw.check = bw.check = self

    def run(self, graph: InductorGraph, args: tuple):
        if graph is self._fw:  # measured afresh until a backward follows: the step is the last forward's
            self.tracker = LiveStorageTracker(allocator=self._allocator)
            flat = args[0] if graph._boxed_call else args
            inputs = {StorageWeakRef(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
            with self.tracker, watch(self.tracker, [graph]):
                out = graph.fn(*args)
            self._num_saved = len(out) - self._num_fwd_outputs
            self._outputs = self._unheld_storages(out, inputs)
            return out
        if graph is not self._bw or self._num_saved is None:
            return graph.fn(*args)
        self._fw.check = self._bw.check = None
        flat = args[0] if graph._boxed_call else args
        for t in list(flat)[self._num_saved:]:  # the gradients fed to it: the walk's new storages
            if isinstance(t, torch.Tensor):
                self.tracker.adopt(t)
        with self.tracker, watch(self.tracker, [graph]):
            out = graph.fn(*args)
        peak, outputs, self._outputs = self.tracker.peak_bytes, self._outputs, {}

        def report():  # an unheld output alive once the backward is over is the caller's
            self._report(peak, sum(nbytes for ref, nbytes in outputs.items() if not ref.expired()))
        if torch._C._current_autograd_node() is not None:
            # inside autograd's backward: after it, when the values saved for it are released too
            torch.autograd.Variable._execution_engine.queue_callback(report)
        else:
            report()
        return out

    def _unheld_storages(self, out, inputs: set) -> dict:
        """The storages of the forward's ``unheld`` outputs (not those a held output or an input
        shares), weakly, with their bytes."""
        def ref(t):
            return StorageWeakRef(t.untyped_storage())

        kept = inputs | {ref(out[i]) for i in range(self._num_fwd_outputs)
                         if isinstance(out[i], torch.Tensor) and i not in self._unheld}
        return {ref(out[i]): out[i].untyped_storage().nbytes() for i in self._unheld
                if isinstance(out[i], torch.Tensor) and ref(out[i]) not in kept}


@contextlib.contextmanager
def watch(tracker, graphs: Sequence[InductorGraph]) -> Iterator[None]:
    """Make ``tracker`` (a :class:`~remat_compiler.memory.LiveStorageTracker`, entered separately) see
    the buffers ``graphs`` allocate outside the dispatcher, by wrapping their ``empty_strided*``."""
    patched = []
    for g in graphs:
        fn = getattr(g.fn, "current_callable", None)
        fn = getattr(fn, "__func__", fn)
        namespace = getattr(fn, "__globals__", None)
        if namespace is None:
            raise UnreadableCodeError("the compiled graph's wrapper module is not reachable")
        for key, original in list(namespace.items()):
            if key.startswith("empty_strided") and callable(original):
                namespace[key] = _adopting(tracker, original)
                patched.append((namespace, key, original))
    try:
        yield
    finally:
        for namespace, key, original in patched:
            namespace[key] = original


def _adopting(tracker, allocate: Callable) -> Callable:
    def allocate_and_adopt(*args, **kwargs):
        t = allocate(*args, **kwargs)
        tracker.adopt(t)
        return t
    return allocate_and_adopt
