"""What Inductor fuses away, in the plan for the Inductor backend: the values its code never writes
(:func:`inductor_view`), and no saved pointwise value whose readers are all pointwise
(:func:`fusible_recompute`).

Inductor inlines a pointwise value into the kernels of its readers when they are pointwise too (a
chain of them is one loop: GPT-2's ``gelu_new`` and its backward, a residual scaling), so its code
never allocates it. The unfused graph charges each such value its bytes while it lives, so a plan
made on it recomputes to make room for buffers Inductor's code never has. :func:`inductor_view` is
the graph as Inductor allocates it: those values cost no bytes and are no candidates (backward
recomputes them where it reads them, inlined into its own kernels, as Inductor's code does; saving
one would write it). The Inductor backend plans on that view; the walk of the code Inductor builds
for the plan (:func:`remat_compiler.inductor.compiled_peak`) still decides whether it keeps the
budget, and where the view is wrong the backend's loop re-plans lower.

The planner prices a plan on the unfused graph, where saving a value costs nothing and recomputing it
costs the bytes it moves. Under Inductor the opposite holds for a pointwise value whose every reader,
forward and backward, is pointwise (GPT-2's ``gelu_new`` chain, a residual scaling): in the forward
Inductor fuses it into its readers' kernel and never writes it, unless the plan saves it, which costs a
write there and a read in the backward; recomputed, it is fused into its backward readers' kernel
from inputs that kernel reads anyway. PyTorch's min-cut partitioner recomputes such values for that
reason (``torch/_functorch/partitioners.py``: fusible ops are recomputed, reductions are not by default).

:func:`fusible_recompute` moves such values from a plan's saved set to recomputation, one at a time,
keeping each move only where the recomputation it adds is pointwise alone (never a reduction, a
matmul or a random op) and the simulated peak stays within the budget. The result is a plan like any
other: simulated, checked and emitted exactly (:func:`remat_compiler.plan.make_plan`).

>>> saved = fusible_recompute(cg, plan.saved, budget_bytes)   # doctest: +SKIP
"""
from __future__ import annotations

import torch

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule, simulate

__all__ = ["fusible_recompute", "inductor_view", "inlined", "is_pointwise", "INDUCTOR_MEMORY"]

#: The ``memory_model`` graph attribute (and plan fact) of :func:`inductor_view`'s graphs.
INDUCTOR_MEMORY = "inductor"


def _overload(op: str):
    """The aten OpOverload a cost graph's ``op`` string names (``"aten.gelu.default"``), or None."""
    parts = op.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return None
    packet = getattr(torch.ops.aten, parts[1], None)
    return getattr(packet, parts[2], None) if packet is not None else None


def is_pointwise(cg: CostGraph, name: str) -> bool:
    """Whether a node is an aten op tagged pointwise (``torch.Tag.pointwise``: Inductor fuses chains
    of them into one kernel) that may be recomputed (not random, mutating or a collective)."""
    op = _overload(str(cg.attr(name, "op")))
    return op is not None and torch.Tag.pointwise in op.tags and not cg.attr(name, "never_recompute")


#: Inductor writes a pointwise value read by more than one op when computing it reads more than this
#: many buffers (``torch._inductor.config.realize_reads_threshold``), rather than inline it into each
REALIZE_READS_THRESHOLD = 4


def inlined(cg: CostGraph) -> dict[str, frozenset[str]]:
    """The values Inductor's code never writes, each with the written values its readers' kernels
    read in its place (its inputs, through the inlined values among them), in graph order.

    A value is inlined where it is pointwise (not a view, an output, or held by the caller) and every
    reader, forward and backward, is a pointwise op of its own storage; a reader of any other kind (a
    matmul, a reduction, a view, a collective) makes Inductor write it, as does saving it for backward
    and, for a value with several readers, computing it from more than
    :data:`REALIZE_READS_THRESHOLD` buffers (Inductor's ``mark_reuse``)."""
    outputs = {o for o in (*cg.fw_outputs, *cg.bw_outputs) if o is not None}
    read_only_in_fw: dict[str, list[str]] = {}
    for n, a in cg.g.nodes(data=True):
        for r in a.get("fw_only_reads") or ():
            read_only_in_fw.setdefault(r, []).append(n)

    def fused_reader(r: str) -> bool:
        return cg.storage(r) == r and is_pointwise(cg, r)

    found: dict[str, frozenset[str]] = {}
    for n in cg.order:
        a = cg.g.nodes[n]
        if a["phase"] not in ("fw", "bw") or a["bytes"] == 0 or cg.storage(n) != n or n in outputs \
                or n in cg.held_storages or not is_pointwise(cg, n):
            continue
        readers = [*cg.g.successors(n), *read_only_in_fw.get(n, ())]
        if not readers or not all(fused_reader(r) for r in readers):
            continue
        reads = frozenset(x for p in cg.preds(n) for x in found.get(p, (p,)))
        if len(readers) > 1 and len(reads) > REALIZE_READS_THRESHOLD:
            continue
        found[n] = reads
    return found


def inductor_view(cg: CostGraph) -> CostGraph:
    """``cg`` as Inductor's code allocates it: the :func:`inlined` values cost no bytes (so they are
    no candidates: a plan never saves them, and backward recomputes those it reads) and no time of
    their own (their arithmetic is a part of their readers' loops, which the roofline prices by the
    bytes they move), and each of their readers reads what they were computed from, as the kernel
    they are inlined into does (so those inputs live until it runs). The graph records
    ``memory_model`` ``"inductor"`` (in its fingerprint, so a plan made on it is refused by the
    eager backend, whose code writes every value) and, as ``fraction_base_bytes``, the no-recompute
    peak of ``cg`` itself: a fraction budget means what it means for the eager backend
    (:func:`remat_compiler.solvers.resolve_budget`)."""
    from remat_compiler.schedule import no_recompute

    g = cg.g.copy()
    found = inlined(cg)
    for n, reads in found.items():
        g.nodes[n].update(bytes=0, runtime_s=0.0)  # computed inside its readers' kernels: no write, no pass of its own
        for r in cg.g.successors(n):
            g.add_edges_from((x, r) for x in reads if x != r)
    g.graph.update(memory_model=INDUCTOR_MEMORY, inlined=len(found))
    g.graph["fraction_base_bytes"] = no_recompute(cg).peak_bytes
    view = CostGraph(g)
    g.graph["fingerprint"] = view._compute_fingerprint()
    return view


def fusible_recompute(cg: CostGraph, saved, budget_bytes: int | None) -> list[str]:
    """``saved`` less the pointwise values whose readers are all pointwise, where recomputing them adds
    only pointwise recomputation and keeps the simulated peak within ``budget_bytes`` (and within the
    plan's own peak when there is no budget).

    Parameters
    ----------
    cg : CostGraph
        The graph as the Inductor backend traces it.
    saved : iterable of str
        A plan's saved values.
    budget_bytes : int | None

    Returns
    -------
    list of str
        The saved values to keep, in ``saved``'s order (all of them where nothing moves).
    """
    saved = list(saved)
    base = build_schedule(cg, saved)
    limit = simulate(cg, base).peak_bytes if budget_bytes is None else budget_bytes
    recomputed = set(base.recomputed)
    keep = set(saved)
    movable = [v for v in saved if is_pointwise(cg, v) and all(is_pointwise(cg, u) for u in cg.g.successors(v))]
    for v in sorted(movable, key=lambda n: (-cg.attr(n, "bytes"), n)):  # the largest writes first
        trial = keep - {v}
        schedule = build_schedule(cg, trial)
        added = set(schedule.recomputed) - recomputed
        if not all(is_pointwise(cg, n) for n in added):
            continue
        if simulate(cg, schedule).peak_bytes > limit:
            continue
        keep, recomputed = trial, set(schedule.recomputed)
    return [v for v in saved if v in keep]
