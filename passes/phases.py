"""Pass: which part of the training step each joint-graph node belongs to (``meta["remat.phase"]``).

- "input": parameters, buffers and inputs (``primals_*``), resident before the step; so are the
  graph's constants (``get_attr``: a ``torch.tensor(...)`` made in forward is traced as one, and
  the graph module holds it like a buffer);
- "tangent": gradients of the outputs (``tangents_*``), created by the step;
- "fw": nodes the forward must run to produce its outputs (and the other outputs of multi-output
  forward ops, such as a dropout mask);
- "bw": everything else, run in backward. Nodes AOTAutograd tags as forward but that only backward
  uses (``detach`` of an activation, a transposed weight) are "bw": they are computed once, where needed.
- "output": the output node.

It also writes ``gm.meta["remat.input_updates"]``: the positions among the forward's outputs of the
new values of inputs the step mutates in place (BatchNorm's running statistics and
``num_batches_tracked``). AOTAutograd's runtime copies them into those inputs when the forward returns
and drops them, so unlike the model's own outputs the caller never holds them.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from remat_compiler.passes.keys import INPUT_UPDATES, MUTATED_INPUT, NUM_FWD_OUTPUTS, PHASE

__all__ = ["annotate_phases", "forward_nodes"]


def _input_update_positions(graph: fx.Graph, output: fx.Node, num_fwd_outputs: int) -> list[int]:
    """Positions among the forward's outputs that are updated values of inputs mutated in place: the
    output descriptors AOTAutograd writes (``InputMutationAOTOutput``); without them, the first
    outputs, one per placeholder marked ``remat.mutated_input`` (AOTAutograd returns them first)."""
    descs = output.meta.get("desc")
    if descs is not None:
        return [i for i, d in enumerate(descs[:num_fwd_outputs])
                if type(d).__name__ == "InputMutationAOTOutput"]
    mutated = sum(1 for p in graph.find_nodes(op="placeholder") if p.meta.get(MUTATED_INPUT))
    return list(range(min(mutated, num_fwd_outputs)))


def forward_nodes(graph: fx.Graph, num_fwd_outputs: int) -> set[fx.Node]:
    """The nodes the forward must run to produce its outputs (the joint graph's first
    ``num_fwd_outputs``), with the other outputs of its multi-output ops: the "fw" phase."""
    output = next(iter(graph.find_nodes(op="output")))
    fw_outputs = [o for o in list(output.args[0])[:num_fwd_outputs] if isinstance(o, fx.Node)]
    needed: set[fx.Node] = set()
    stack = list(fw_outputs)
    while stack:
        n = stack.pop()
        if n in needed or n.op == "placeholder":
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    for n in list(needed):
        if n.users and all(u.target is operator.getitem for u in n.users):
            needed.update(n.users)
    return needed


def annotate_phases(gm: fx.GraphModule, *, num_fwd_outputs: int) -> fx.GraphModule:
    """Write ``meta["remat.phase"]`` on every node; also sets ``gm.meta["remat.num_fwd_outputs"]`` and
    ``gm.meta["remat.input_updates"]``."""
    graph = gm.graph
    output = next(iter(graph.find_nodes(op="output")))
    needed = forward_nodes(graph, num_fwd_outputs)
    for n in graph.nodes:
        if n.op == "placeholder":
            n.meta[PHASE] = "tangent" if n.name.startswith("tangents") else "input"
        elif n.op == "get_attr":  # a constant of the graph (``torch.tensor([])`` made in forward)
            n.meta[PHASE] = "input"
        elif n.op == "output":
            n.meta[PHASE] = "output"
        else:
            n.meta[PHASE] = "fw" if n in needed else "bw"
    gm.meta[NUM_FWD_OUTPUTS] = num_fwd_outputs
    gm.meta[INPUT_UPDATES] = _input_update_positions(graph, output, num_fwd_outputs)
    return gm
