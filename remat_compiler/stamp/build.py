"""Build the joint graph of ``L`` layers from traces of 3 (``a``) and 4 (``b``) layers.

Layer 0 and the last layer are ``b``'s first and last; layers 1 to ``L - 2`` are copies of ``b``'s
layer 1 (the *template*). In a copy, an input from layer ``j + d`` of ``b`` (``d`` in -1, 0, 1) is
the copy's ``d`` neighbour, and an input from no layer is that node itself. Names are numbered as
fx numbers them, one counter per op name: a number is ``b``'s, plus its step per extra layer
(``b``'s number less ``a``'s, which counts the names a layer uses up, those of nodes erased after
tracing included), plus for the ``c``-th copy of the template ``c - 1`` times the step between
``b``'s layers 1 and 2. Autograd's ``seq_nr`` is counted the same way.
"""
from __future__ import annotations

import copy as copy_module
import dataclasses
import re
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.stamp.layout import Layout, StampError, Trace, tensors

__all__ = ["build", "check_layers_alike"]

_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")  # fx's Namespace regex


def _count(name: str) -> tuple[str, int]:
    """A name's base and number: fx's ``base_<n>`` (``base`` alone for 0), or a base that ends in
    its number (``_tensor_constant<n>``, the attributes of constants), kept as ``base#``."""
    base, num = _NAME.match(name).group(1, 2)
    if num is None:
        digits = re.search(r"\d+$", name)
        if digits is not None and digits.start() > 0:
            return name[:digits.start()] + "#", int(digits.group())
    return base, int(num) if num is not None else 0


def _named(base: str, count: int) -> str:
    if base.endswith("#"):
        return f"{base[:-1]}{count}"
    return base if count == 0 else f"{base}_{count}"


def check_layers_alike(b: Trace) -> None:
    """Raise StampError unless ``b``'s layers have the same ops and values in every layer segment,
    and its middle layers (1 and 2) the same arguments, read at the same offsets."""
    def value(n):
        return [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype) for t in tensors(n.meta.get("val"))]

    def relative(n, layer):
        def ref(y):
            t = b.tags[y]
            s, _, p = b.layout.place[y]
            return ("N", y.name) if t is None else (t - layer, s, p)
        return repr(fx.node.map_arg((n.args, n.kwargs), ref))

    for seg in b.layout.segments:
        if seg[0] != "L":
            continue
        ops = {tuple((n.op, n.target if n.op == "call_function" else "", repr(value(n))) for n in run)
               for run in seg[2]}
        if len(ops) != 1:
            raise StampError("the layers' ops or values differ")
        if [relative(n, 1) for n in seg[2][1]] != [relative(n, 2) for n in seg[2][2]]:
            raise StampError("the middle layers read different inputs")


class _Stamper:
    """The new node, name, value and storage of each node of ``b`` in each copy."""

    def __init__(self, a: Trace, b: Trace, L: int, prefix: str):
        if a.layout.shape() != b.layout.shape() or a.out_layout.shape() != b.out_layout.shape():
            raise StampError("the two traces differ beyond their layer count")
        self.a, self.b, self.L, self.prefix = a, b, L, prefix
        self.last = b.k - 1
        self.env: dict = {}       # (copy or None, node of b) -> new node
        self.storages: dict = {}  # (copy, storage of b's template) -> new meta storage
        self.owner: dict = {}     # storage of b -> (first node of b holding it, index in its val)
        for n in b.nodes:
            for j, t in enumerate(tensors(n.meta.get("val"))):
                self.owner.setdefault(StorageWeakRef(t.untyped_storage()), (n, j))
        first_a, first_b = a.nodes[0].meta.get("seq_nr"), b.nodes[0].meta.get("seq_nr")
        # how far the process's autograd counter went between the two traces' starts
        self.seq_offset = first_b - first_a if first_a is not None and first_b is not None else 0

    def source(self, copy: int) -> int:
        """The layer of ``b`` that ``copy`` is made from."""
        return 0 if copy == 0 else self.last if copy == self.L - 1 else 1

    def _in_a(self, x: fx.Node) -> fx.Node:
        """``x``'s node in ``a`` (``b``'s last layer is ``a``'s last)."""
        if x.op == "output":
            return self.a.output
        s, layer, p = self.b.layout.place[x]
        seg = self.a.layout.segments[s]
        return seg[1][p] if layer is None else seg[2][self.a.k - 1 if layer == self.last else layer][p]

    def target_copy(self, copy: int | None, layer: int | None, other: int | None) -> int | None:
        """The copy that an input from ``b``'s layer ``other`` stands for in ``copy`` (made from
        ``layer``); None outside the layers."""
        if other is None:
            return None
        if layer is None:
            if other in (0, self.last):
                return 0 if other == 0 else self.L - 1
            raise StampError("a node outside the layers reads a middle layer")
        d = other - layer
        if abs(d) > 1 or not 0 <= copy + d < self.L:
            raise StampError("a layer reads beyond its neighbours")
        return copy + d

    def map_arg(self, copy: int | None, layer: int | None, y: fx.Node) -> fx.Node:
        c = self.target_copy(copy, layer, self.b.tags[y])
        return self.env[(None, y)] if c is None else self.env[(c, self.b.layout.at(y, self.source(c)))]

    def counted(self, x: fx.Node, copy: int | None, number, offset: int = 0) -> int:
        """A counter's value (``number(node)``: a name's number, ``seq_nr``) at ``x``'s copy."""
        n_b = number(x)
        out = n_b + (self.L - self.b.k) * (n_b - number(self._in_a(x)) - offset)
        if copy is not None and copy > 1 and self.source(copy) == 1:
            out += (copy - 1) * (number(self.b.layout.at(x, 2)) - n_b)
        return out

    def name(self, x: fx.Node, copy: int | None) -> str:
        base = _count(x.name)[0]

        def number(n):
            b, c = _count(n.name)
            if b != base:
                raise StampError(f"{x.name} is named {n.name} in another trace or layer")
            return c
        return _named(base, self.counted(x, copy, number))

    def seq_nr(self, x: fx.Node, copy: int | None):
        if x.meta.get("seq_nr") is None:
            return None
        return self.counted(x, copy, lambda n: n.meta.get("seq_nr", x.meta["seq_nr"]), self.seq_offset)

    def storage(self, copy: int | None, layer: int | None, t: torch.Tensor):
        """The storage that ``t`` (a tensor of ``b``'s node in ``layer``) lives in, in ``copy``."""
        owner, j = self.owner[StorageWeakRef(t.untyped_storage())]
        c = self.target_copy(copy, layer, self.b.tags[owner])
        if c is None:
            return t.untyped_storage()
        twin = tensors(self.b.layout.at(owner, self.source(c)).meta["val"])[j]
        if c in (0, 1, self.L - 1):
            return twin.untyped_storage()
        key = (c, StorageWeakRef(twin.untyped_storage()))
        if key not in self.storages:
            nbytes = twin.untyped_storage().nbytes()
            self.storages[key] = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        return self.storages[key]

    def val(self, copy: int | None, layer: int | None, v: Any) -> Any:
        """``v`` (``b``'s node's value) for ``copy``: the same FakeTensors where they live in the
        same storages, else new ones of their mode, device, sizes and strides on the copy's
        storages (a FakeTensor wraps a meta tensor and shares its storage)."""
        from torch._subclasses.fake_tensor import FakeTensor

        def one(t):
            if not isinstance(t, torch.Tensor):
                return t
            st = self.storage(copy, layer, t)
            if StorageWeakRef(st) == StorageWeakRef(t.untyped_storage()):
                return t
            meta = torch.empty(0, dtype=t.dtype, device="meta").set_(st, t.storage_offset(), t.shape, t.stride())
            new = FakeTensor(t.fake_mode, meta, t.device)
            return new.requires_grad_(t.requires_grad) if t.requires_grad else new
        return pytree.tree_map(one, v)

    def rename(self, value: Any, layer: int, copy: int) -> Any:
        """Module paths of ``layer`` (in strings anywhere in ``value``) renamed to ``copy``'s."""
        pat = re.compile(re.escape(f"{self.prefix}{layer}") + r"(?=\.|$)")
        new = f"{self.prefix}{copy}"

        def walk(x):
            if isinstance(x, str):
                return pat.sub(new, x)
            if isinstance(x, dict):
                return {walk(k): walk(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
                return type(x)(walk(v) for v in x)
            return x
        return walk(value)


def _order(layout: Layout, L: int, source) -> list:
    """``(copy or None, item of b)`` in the ``L``-layer graph's order."""
    order = []
    for seg in layout.segments:
        if seg[0] == "N":
            order += [(None, n) for n in seg[1]]
            continue
        for c in (range(L) if seg[1] > 0 else range(L - 1, -1, -1)):
            order += [(c, n) for n in seg[2][source(c)]]
    return order


def _desc_for(desc, index: int):
    """AOTAutograd's descriptor of flat input ``index`` (or of its gradient), from ``desc``."""
    if desc is None:
        return None
    if type(desc).__name__ == "PlainAOTInput":
        return dataclasses.replace(desc, idx=index)
    if type(desc).__name__ == "GradAOTOutput" and type(desc.grad_of).__name__ == "PlainAOTInput":
        return dataclasses.replace(desc, grad_of=dataclasses.replace(desc.grad_of, idx=index))
    raise StampError(f"an unknown descriptor {type(desc).__name__}")


_RENAMED = ("custom", "fwd_nn_module_stack", "nn_module_stack", "stack_trace")


def build(a: Trace, b: Trace, L: int, prefix: str) -> tuple[fx.GraphModule, int]:
    """The joint GraphModule of ``L`` layers and its number of forward outputs.

    Raises
    ------
    StampError
        If the traces do not stamp (see :mod:`remat_compiler.stamp`).
    """
    check_layers_alike(b)
    st = _Stamper(a, b, L, prefix)
    graph, root, primal_index = fx.Graph(), torch.nn.Module(), 0
    for copy, x in _order(b.layout, L, st.source):
        layer = b.tags[x]
        name = st.name(x, copy)
        args = fx.node.map_arg(x.args, lambda y: st.map_arg(copy, layer, y))
        kwargs = fx.node.map_arg(x.kwargs, lambda y: st.map_arg(copy, layer, y))
        if x.op == "get_attr":
            setattr(root, name, getattr(b.gm, x.target))
        target = name if x.op in ("get_attr", "placeholder") else x.target
        new = graph.create_node(x.op, target, args, kwargs, name=name, type_expr=x.type)
        if new.name != name:
            raise StampError(f"fx named {name} {new.name}")
        meta = dict(x.meta)
        meta["val"] = st.val(copy, layer, x.meta.get("val"))
        if "seq_nr" in meta:
            meta["seq_nr"] = st.seq_nr(x, copy)
        if copy is not None and layer != copy:
            meta.update((k, st.rename(meta[k], layer, copy)) for k in _RENAMED if meta.get(k) is not None)
        if x.op == "placeholder" and not x.name.startswith("tangents"):
            meta["desc"] = _desc_for(x.meta.get("desc"), primal_index)
            primal_index += 1
        new.meta = meta
        st.env[(copy, x)] = new
    num_fwd = b.traced.num_fwd_outputs
    old_descs = b.output.meta.get("desc")
    outs, descs = [], []
    for copy, i in _order(b.out_layout, L, st.source):
        o = b.outs[i]
        outs.append(st.map_arg(copy, b.out_layout.place[i][1], o) if isinstance(o, fx.Node) else o)
        if old_descs is not None:
            descs.append(old_descs[i] if i < num_fwd else _desc_for(old_descs[i], len(outs) - 1 - num_fwd))
    out = graph.output(outs)
    out.meta = dict(b.output.meta)
    if "seq_nr" in out.meta:
        out.meta["seq_nr"] = st.seq_nr(b.output, None)
    if old_descs is not None:
        out.meta["desc"] = descs
    graph._codegen = _codegen_for(b.gm.graph._codegen, graph, num_fwd)
    # its Python code is generated when first asked for (the passes rewrite the graph first)
    gm = _make_graph_module(root, graph, class_name=type(b.gm).__name__, graph_module_cls=_LazyGraphModule)
    gm.meta.update(b.gm.meta)
    return gm, num_fwd


def _codegen_for(old, graph: fx.Graph, num_fwd: int):
    """The joint graph's calling convention, ``(primals, tangents) -> (forward outputs,
    gradients)``, for the stamped graph's counts."""
    info = getattr(old, "pytree_info", None)
    if info is None:
        return old
    if not (_pair_of(info.in_spec, list) and _pair_of(info.out_spec, tuple)):
        raise StampError("an unknown calling convention")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    n_tangents = sum(1 for n in placeholders if n.name.startswith("tangents"))
    n_out = len(next(iter(graph.find_nodes(op="output"))).args[0])
    new = copy_module.copy(old)
    new.pytree_info = info._replace(
        in_spec=pytree.tree_structure(([0] * (len(placeholders) - n_tangents), [0] * n_tangents)),
        out_spec=pytree.tree_structure((tuple([0] * num_fwd), tuple([0] * (n_out - num_fwd)))))
    return new


def _pair_of(spec, kind) -> bool:
    """Whether ``spec`` is a tuple of two ``kind`` containers of leaves."""
    children = spec.children()
    return spec.type is tuple and len(children) == 2 and \
        all(c.type is kind and all(g.is_leaf() for g in c.children()) for c in children)
