"""Where each layer's nodes lie in a traced joint graph (:mod:`remat_compiler.stamp`).

A node's *tag* is the index of the layer it belongs to, or None for no layer: a placeholder's is
its parameter's (``primals_*`` follow ``named_parameters``), a node's its module path's
(``meta["custom"]["remat.trace_module"]``, ``model.layers.3.mlp`` -> 3), and a node without a path
(AOTAutograd's gradient accumulation) takes the tag of the node before it. The graph is then cut
into *segments*: runs of no layer, and *layer segments* that hold one run per layer in layer order
(placeholders, forward) or reverse order (backward).
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from remat_compiler.passes import keys

__all__ = ["StampError", "Layout", "Trace", "tensors"]


class StampError(Exception):
    """A trace is not regular enough to stamp (:func:`remat_compiler.stamp.trace_stamped` then
    returns None and the model is traced in full)."""


def tensors(v) -> list[torch.Tensor]:
    """The tensors in a node's ``meta["val"]`` (a tensor, a tuple of them, or none)."""
    return [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)]


class Layout:
    """Items (nodes, or output positions) cut into segments by their tags.

    ``segments[s]`` is ``("N", items)`` or ``("L", direction, layers)`` with ``layers[j]`` the
    items of layer ``j`` (direction +1: layer order, -1: reverse); ``place[item]`` is
    ``(s, layer or None, position in its run)``.

    Raises
    ------
    StampError
        If a layer's run is out of order, missing, or not as long as the other layers'.
    """

    def __init__(self, items: list, tags: list, k: int):
        self.k = k
        runs: list[list] = []
        for item, tag in zip(items, tags):
            if runs and runs[-1][0] == tag:
                runs[-1][1].append(item)
            else:
                runs.append([tag, [item]])
        raw: list = []
        for tag, run in runs:
            seg = raw[-1] if raw else None
            if tag is None:
                raw.append(("N", run))
            elif seg is not None and seg[0] == "L" and len(seg[2]) < k and \
                    tag == (len(seg[2]) if seg[1] > 0 else k - 1 - len(seg[2])):
                seg[2].append(run)
            elif tag in (0, k - 1):
                raw.append(("L", 1 if tag == 0 else -1, [run]))
            else:
                raise StampError(f"layer {tag}'s run starts a segment")
        self.segments: list[tuple] = []
        self.place: dict = {}
        for s, seg in enumerate(raw):
            if seg[0] == "N":
                self.segments.append(seg)
                self.place.update((n, (s, None, p)) for p, n in enumerate(seg[1]))
                continue
            layers = seg[2] if seg[1] > 0 else seg[2][::-1]
            if len(layers) != k or len({len(x) for x in layers}) != 1:
                raise StampError("a layer segment is incomplete or uneven")
            self.segments.append(("L", seg[1], layers))
            for layer, run in enumerate(layers):
                self.place.update((n, (s, layer, p)) for p, n in enumerate(run))

    def shape(self) -> list:
        """What two traces of different layer counts must share."""
        return [(seg[0], len(seg[1])) if seg[0] == "N" else ("L", seg[1], len(seg[2][0]))
                for seg in self.segments]

    def at(self, item, layer: int | None):
        """The item at ``item``'s place in ``layer`` (``item`` itself outside the layers)."""
        s, own, p = self.place[item]
        return item if own is None else self.segments[s][2][layer][p]


def _path_tag(n: fx.Node, prefix: str):
    """A node's layer from its module path: an int, None outside the layers, "?" without a path."""
    path = (n.meta.get("custom") or {}).get(keys.TRACE_MODULE)
    if path is None:
        return "?"
    if path.startswith(prefix):
        head = path[len(prefix):].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return None


def _name_tag(name: str, prefix: str) -> int | None:
    head = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
    return int(head) if head.isdigit() else None


class Trace:
    """A traced step of ``k`` layers: its nodes' tags and the layouts of its nodes and outputs.

    Raises
    ------
    StampError
        As :class:`Layout`.
    """

    def __init__(self, traced, prefix: str, k: int):
        self.traced, self.gm, self.k = traced, traced.joint, k
        self.nodes = [n for n in self.gm.graph.nodes if n.op != "output"]
        self.output = next(iter(self.gm.graph.find_nodes(op="output")))
        self.primals = [n for n in self.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
        primal_tags = {n: _name_tag(traced.step.flat_input_name(i), prefix) for i, n in enumerate(self.primals)}
        self.tags: dict = {}
        prev = None
        for n in self.nodes:
            if n.op == "placeholder":
                tag = primal_tags.get(n)
            else:
                tag = _path_tag(n, prefix)
                tag = prev if tag == "?" else tag
            self.tags[n] = prev = tag
        self.layout = Layout(self.nodes, [self.tags[n] for n in self.nodes], k)
        self.outs = list(self.output.args[0])
        num_fwd = traced.num_fwd_outputs
        out_tags = [self.tags[o] if isinstance(o, fx.Node) else
                    (self.tags[self.primals[i - num_fwd]] if i >= num_fwd else None)
                    for i, o in enumerate(self.outs)]
        if any(t is not None for t in out_tags[:num_fwd]):
            raise StampError("a forward output belongs to a layer")
        self.out_layout = Layout(list(range(len(self.outs))), out_tags, k)
