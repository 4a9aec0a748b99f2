"""The Inductor backend: a plan's forward and backward compiled by Inductor, and the peak of the code it wrote.

``compile(model, budget, backend="inductor")`` plans like the eager backend, on the joint graph traced
with Inductor's decompositions (:data:`DECOMPOSITIONS`), and hands the emitted forward and backward to
Inductor's inner compiler (``compile_fx_inner``) instead of running them op by op. The plan's decisions
hold exactly in what runs: the forward's outputs are the values the plan saves (a compiler cannot drop
a graph output), and the backward computes again what the plan recomputes. What Inductor changes is how:
it fuses pointwise chains (their intermediates never exist), reorders kernels and reuses buffers. One
thing it is not left to decide: a pointwise value read by several layers (a mask, a rotary table) is
computed once into a buffer (:func:`store_shared_values`), not again inside each layer's kernel.

So the planner's prediction, a simulation of the unfused graph, is checked against the code Inductor
wrote. :func:`compiled_peak` walks the two generated wrappers' ``call`` functions line by line under the
step's accounting conventions (those of :func:`remat_compiler.emitted.emitted_peak`): each
``empty_strided`` allocation, each fallback kernel's outputs (their bytes from the IR buffers Inductor
lowered, recorded by :func:`compile_graph`), each ``del``, each buffer handed on for reuse, what each
``return`` hands back. That walk is the Inductor path's predicted peak; the backend's first call
(:mod:`remat_compiler.inductor.backend`) re-plans (or falls back to the eager backend, warning) when it
exceeds the budget.

:func:`watch` measures the same thing at run time without reading the code: it registers every buffer
the wrappers allocate with a :class:`remat_compiler.memory.LiveStorageTracker` (which sees the fallback
kernels' outputs through the dispatcher), so a test can compare prediction and measurement to the byte.
:class:`FirstStepCheck` does so on the first step of every plan's code, for the backend: what the walk
missed is then reported, and re-planned for, rather than run on silently.

The package, a room per concern (each imports only those above it in this list):

- :mod:`.warm`: Inductor's probe of the CPU, begun when a first call begins, beside its trace and solve;
- :mod:`.graph`: one compiled graph and its generated source (:class:`InductorGraph`), the errors;
- :mod:`.walk`: the generated wrappers read line by line (:func:`compiled_peak`);
- :mod:`.first_step`: the first step measured against the walk (:class:`FirstStepCheck`, :func:`watch`);
- :mod:`.compile`: AOTAutograd's compilers under a plan (:func:`compile_graph`, :class:`InductorCompilers`);
- :mod:`.backend`: the compiled module's first call on this backend: fused recompute, compile, walk,
  re-plan lower, the first step's report (imported by :mod:`remat_compiler.module`, not here);
- :mod:`.ranges`: the same over a range of shapes (``max_seq_len=``): one compile over symbolic sizes,
  walked at the bound (imported by :mod:`remat_compiler.module`, not here).
"""
from __future__ import annotations

from remat_compiler.emitted import EmittedPeak
from remat_compiler.inductor.compile import InductorCompilers, StepFacts, compile_graph
from remat_compiler.inductor.first_step import FirstStepCheck, watch
from remat_compiler.inductor.graph import CompiledOverBudget, InductorGraph, UnreadableCodeError
from remat_compiler.inductor.walk import Storages, call_body, compiled_peak, walk_graph
from remat_compiler.passes.shared_values import store_shared_values

__all__ = ["DECOMPOSITIONS", "InductorGraph", "InductorCompilers", "StepFacts", "CompiledOverBudget",
           "FirstStepCheck", "UnreadableCodeError", "compile_graph", "compiled_peak", "store_shared_values", "watch",
           "Storages", "walk_graph", "call_body", "EmittedPeak"]


def _decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    from remat_compiler.passes.loss import WHOLE_LOSS_OPS

    # native_dropout stays whole: passes.rng rewrites it as a replayable remat::dropout_at, which
    # Inductor runs as a fallback kernel drawing eager's numbers. The loss head's ops become opaque
    # twins (passes.loss.WHOLE_LOSS_OPS): planned as what runs, and cross-entropy's backward fused
    table = {op: fn for op, fn in select_decomp_table().items() if not str(op).startswith("aten.native_dropout.")}
    table.update(WHOLE_LOSS_OPS)
    return table


#: Inductor's decomposition table, less ``aten.native_dropout`` (see :mod:`remat_compiler.passes.rng`), with the loss
#: head's ops mapped to opaque twins (:data:`remat_compiler.passes.loss.WHOLE_LOSS_OPS`).
DECOMPOSITIONS = _decompositions()
