"""Graph passes: steps ``GraphModule -> GraphModule`` that talk only through ``meta["remat.*"]`` keys.

:data:`PASSES` is the whole list, in order. The first five rewrite the graph: dead code goes, repeated
index work is merged (:func:`merge_repeated_index_work`), then
:func:`remat_compiler.passes.rng.replayable_dropout` makes dropout replay its RNG state where it is recomputed, and
:func:`remat_compiler.passes.loss.fuse_cross_entropy_backward` rewrites cross-entropy's backward into one op (it
holds two logits-sized tensors instead of three), and :func:`remat_compiler.passes.strides.traced_layouts` gives an
op whose real kernel lays its output out otherwise than its traced (fake) value the traced layout,
where a traced ``view`` depends on it. The rest only annotate. Every key the passes write
or read, with its meaning and its writer, is in :mod:`remat_compiler.passes.keys`.

Each pass changes the GraphModule it is given, in place, and returns it.

>>> gm = run_passes(traced.joint, num_fwd_outputs=traced.num_fwd_outputs, dump_dir="passes")  # doctest: +SKIP
>>> sorted(os.listdir("passes"))[:2]                                                          # doctest: +SKIP
['00_eliminate_dead_code.txt', '01_merge_repeated_index_work.txt']
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.passes.blocks import annotate_blocks
from remat_compiler.passes.costs import CostModel, annotate_costs
from remat_compiler.passes.files import atomic_write_text
from remat_compiler.passes.keys import PREFIX, TRACE_MODULE
from remat_compiler.passes.loss import fuse_cross_entropy_backward
from remat_compiler.passes.moe import tag_moe_segments
from remat_compiler.passes.phases import annotate_phases, forward_nodes
from remat_compiler.passes.rng import replayable_dropout
from remat_compiler.passes.storage import annotate_storage, calibrate_scalar_storage
from remat_compiler.passes.strides import traced_layouts

__all__ = ["run_passes", "PASSES", "Pass", "CostModel", "eliminate_dead_code", "merge_repeated_index_work",
           "annotate_phases",
           "annotate_storage", "calibrate_scalar_storage", "annotate_costs", "annotate_blocks",
           "tag_moe_segments", "fuse_cross_entropy_backward", "replayable_dropout", "traced_layouts"]


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Remove nodes nobody reads (fx's rule: impure nodes, such as collectives, stay); recompile if any."""
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    return gm


def _merges(node: fx.Node) -> bool:
    """Whether a node may stand for its duplicates: a pure op (not impure by fx's rule, which counts
    mutations, side effects and random draws), not a collective, and not ``empty`` (uninitialized
    memory; ``fx_graph_cse`` leaves it too)."""
    if node.op != "call_function" or node.is_impure():
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return packet not in (torch.ops.aten.empty, torch.ops.aten.new_empty, torch.ops.aten.empty_like,
                          torch.ops.aten.empty_strided) and "c10d" not in getattr(node.target, "namespace", "")


def _index_work(gm: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """The forward's nodes computed from integer and boolean inputs and constants alone: positions,
    masks, indices: no gradient flows through them."""
    forward = forward_nodes(gm.graph, num_fwd_outputs)
    work: set[fx.Node] = set()
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor) and not (val.is_floating_point() or val.is_complex()):
                work.add(n)
        elif n in forward and _merges(n) and all(a in work for a in n.all_input_nodes):
            work.add(n)
    return work


def merge_repeated_index_work(gm: fx.GraphModule, *, num_fwd_outputs: int) -> fx.GraphModule:
    """Merge the forward's nodes that repeat index work (same op on the same integer-derived inputs)
    into their first occurrence; recompile if any went.

    A traced Hugging Face decoder builds its attention mask from index arithmetic that the trace
    repeats (two ``iota`` for one range of positions). Inductor writes a value that several kernels
    read only if computing it reads more than ``realize_reads_threshold`` (4) values; else every
    reader recomputes it. With the repeats GPT-2's mask counts 4 reads and is recomputed inside every
    layer's softmax kernel; merged, it counts 6 and is written once for all layers (GPT-2 at width
    256, sequence 256, 2 CPU threads: that kernel took 4.1 ms a layer against 1.0). Nodes the
    output returns are not merged (the caller gets separate tensors, as eager gives).

    AOTAutograd's own partitioner merges repeats over the whole joint graph (``fx_graph_cse``). This
    pass merges only what :func:`_index_work` selects, in the forward alone and within one module's
    call (the trace's ``remat.trace_module``), so a backward never comes to read a forward value it
    did not read before, and the passes that find repeated layers and MoE segments see each layer as
    traced (an MoE layer's ``arange`` is not merged into the previous layer's, which would keep it
    alive across both).
    """
    work = _index_work(gm, num_fwd_outputs)
    first: dict[tuple, fx.Node] = {}
    gone: set[StorageWeakRef] = set()
    merged = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n not in work or any(u.op == "output" for u in n.users):
            continue
        module = (n.meta.get("custom") or {}).get(TRACE_MODULE)
        key = (module, n.target, repr(fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)))
        if key in first:
            if isinstance(n.meta.get("val"), torch.Tensor):
                gone.add(StorageWeakRef(n.meta["val"].untyped_storage()))
            n.replace_all_uses_with(first[key])
            gm.graph.erase_node(n)
            merged = True
        else:
            first[key] = n
    if merged:  # a merged node's value may be no tensor (a tuple): then it leaves no storage behind
        _realias_views(gm, gone)
        gm.recompile()
    return gm


def _realias_views(gm: fx.GraphModule, gone: set[StorageWeakRef]) -> None:
    """Give the views of merged-away values the storage of the value that replaced them.

    :mod:`remat_compiler.passes.storage` reads aliasing from the FakeTensors' storages: a view of a merged-away
    value would still name that value's storage, and be charged as a storage of its own. Each such
    view's value is made again from its (already updated) inputs, in the graph's order, so that it
    shares its new base's storage."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op != "call_function" or not isinstance(val, torch.Tensor) \
                or StorageWeakRef(val.untyped_storage()) not in gone:
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            n.meta["val"] = n.target(*args, **kwargs)


@dataclass(frozen=True)
class Pass:
    """One step of :data:`PASSES`: :func:`run_passes` calls ``run(gm, **the options it names)``.

    Attributes
    ----------
    run : callable
        The pass; it takes the GraphModule first and the options named in ``options`` as keywords.
    options : tuple of str
        Which of :func:`run_passes`' options (``num_fwd_outputs``, ``cost_model``) it takes.
    """

    run: Callable[..., fx.GraphModule]
    options: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.run.__name__


#: The standard pass list, in the order :func:`run_passes` runs it.
PASSES: tuple[Pass, ...] = (
    Pass(eliminate_dead_code),
    Pass(merge_repeated_index_work, ("num_fwd_outputs",)),
    Pass(replayable_dropout),
    Pass(fuse_cross_entropy_backward),
    Pass(traced_layouts),
    Pass(annotate_phases, ("num_fwd_outputs",)),
    Pass(annotate_storage, ("cost_model",)),
    Pass(calibrate_scalar_storage),
    Pass(annotate_costs, ("cost_model",)),
    Pass(annotate_blocks),
    Pass(tag_moe_segments),
)


def run_passes(gm: fx.GraphModule, *, num_fwd_outputs: int, cost_model: CostModel | None = None,
               dump_dir: str | os.PathLike | None = None) -> fx.GraphModule:
    """Run :data:`PASSES` over a joint graph, in place, and return it.

    ``gm`` itself is changed: dead nodes are erased, dropout and cross-entropy's backward are
    rewritten (then ``gm`` is recompiled), and every node's ``meta`` and ``gm.meta`` get the
    :mod:`remat_compiler.passes.keys` annotations. Pass a copy to keep the traced graph as it was.

    Parameters
    ----------
    gm : fx.GraphModule
        The joint forward+backward graph from :func:`remat_compiler.trace.trace`.
    num_fwd_outputs : int
        How many of the joint graph's outputs are forward outputs.
    cost_model : CostModel, optional
        Compute rate, memory and link bandwidth for the runtime estimate.
    dump_dir : str or PathLike, optional
        If given (created if missing), the graph after each pass is written to
        ``dump_dir/NN_<pass name>.txt``: its code, then every node's and the graph's ``remat.*``
        metadata.

    Returns
    -------
    fx.GraphModule
        ``gm``, annotated.

    Raises
    ------
    OSError
        If ``dump_dir`` cannot be written.
    """
    options = {"num_fwd_outputs": num_fwd_outputs, "cost_model": cost_model or CostModel()}
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    for i, p in enumerate(PASSES):
        gm = p.run(gm, **{k: options[k] for k in p.options})
        if dump_dir is not None:
            atomic_write_text(os.path.join(dump_dir, f"{i:02d}_{p.name}.txt"), _describe(gm))
    return gm


def _describe(gm: fx.GraphModule) -> str:
    """The graph's code followed by its ``remat.*`` metadata, one line a node."""
    lines = [gm.print_readable(print_output=False), "", "# graph metadata"]
    lines += [f"{k} = {v!r}" for k, v in gm.meta.items() if k.startswith(PREFIX)]
    lines += ["", "# node metadata"]
    for n in gm.graph.nodes:
        ann = {k: v for k, v in n.meta.items() if k.startswith(PREFIX)}
        lines.append(f"{n.name}: {ann}")
    return "\n".join(lines) + "\n"


