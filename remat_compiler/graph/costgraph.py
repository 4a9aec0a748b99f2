"""CostGraph: the joint graph as a networkx DiGraph with per-node memory and compute costs.

Nodes are the joint graph's node names; an edge ``u -> v`` means v reads u, whenever v runs. A read
only v's forward run makes (a training BatchNorm's running statistics, which its recomputation does
not read: ``remat.recompute_unread``) is no edge: it is in v's ``fw_only_reads`` and counts for
the forward's liveness alone (:meth:`CostGraph.fw_preds`). Node attributes come from the passes'
``remat.*`` meta keys:

=================  =====================================================================
``phase``          "input", "tangent", "fw" or "bw"
``order``          position in the joint graph
``storage``        owner of the value's storage (itself, its base for views; None for tuples)
``bytes``          bytes of new storage the node allocates (0 for views, aliases, tuples)
``flops``          FLOPs (flop counter registry)
``runtime_s``      roofline runtime estimate, communication included
``comm_bytes``     bytes one rank sends for a collective
``never_recompute``  random, mutating or side-effecting op
``reason``         why it is never recomputed (None otherwise)
``is_tuple``       multi-output node (its tensors belong to its getitem users)
``fw_only_reads``  inputs only the node's forward run reads (not a recomputation of it)
``op``, ``shape``, ``dtype``, ``module``, ``block``, ``moe``  for people and hand-picked strategies
=================  =====================================================================

Graph attributes: ``fw_outputs`` / ``bw_outputs`` (node names, None for absent gradients),
``input_updates`` (positions in ``fw_outputs`` of the new values of inputs mutated in place, which
AOTAutograd writes back into the inputs and drops), ``block_container``, ``hold_outputs`` (whether
the caller keeps the model's outputs through backward),
``device`` (the device type the step runs on), ``traced_on`` (the device type the trace ran on
where it is not ``device``, else None: a CUDA plan traced on a CPU-only build), ``trace_notes`` (what
the trace changed to follow eager's path, :mod:`remat_compiler.eager_paths`), ``allocator`` (the
:mod:`remat_compiler.passes.allocator` model ``bytes`` are counted in), ``cost_model`` (the fields of the cost
model the runtimes come from, or None), ``fingerprint`` (see :meth:`CostGraph.fingerprint`).
"""
from __future__ import annotations

import hashlib
import operator
from functools import cached_property

import networkx as nx
import torch
import torch.fx as fx

from remat_compiler.passes import keys

__all__ = ["CostGraph"]


def _op_name(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "placeholder"
    if node.target is operator.getitem:
        return "getitem"
    return str(node.target)


class CostGraph:
    """A networkx view of an annotated joint graph, plus the derived sets every solver needs.

    Build it with :meth:`from_graph_module`; the DiGraph is ``cg.g``.
    """

    def __init__(self, g: nx.DiGraph):
        self.g = g
        #: facts the layers above derive from the graph once (the no-recompute simulation:
        #: :func:`remat_compiler.schedule.no_recompute`); the graph does not change after it is built
        self.derived: dict[str, object] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_graph_module(cls, gm: fx.GraphModule) -> "CostGraph":
        """Build the CostGraph of a joint graph that :func:`remat_compiler.passes.run_passes` annotated.

        Whether the caller keeps the model's outputs alive until backward ends is the trace's
        ``gm.meta["remat.hold_outputs"]`` (:func:`remat_compiler.trace.annotate_joint`): if not, they are
        values like any other, saved, freed or recomputed as the plan decides.

        Raises
        ------
        ValueError
            If the graph lacks the ``remat.*`` annotations (trace it and run the passes first).
        """
        g = nx.DiGraph()
        num_fwd = gm.meta.get(keys.NUM_FWD_OUTPUTS)
        if num_fwd is None:
            raise ValueError("graph is not annotated: run passes.run_passes(gm, num_fwd_outputs=...) first")
        if keys.HOLD_OUTPUTS not in gm.meta:
            raise ValueError("graph does not say whether the caller holds its outputs: trace it with "
                             "remat_compiler.trace (or annotate_joint) first")
        for i, n in enumerate(gm.graph.nodes):
            if n.op == "output":
                outs = list(n.args[0])
                g.graph["fw_outputs"] = [o.name if isinstance(o, fx.Node) else None
                                         for o in outs[:num_fwd]]
                g.graph["bw_outputs"] = [o.name if isinstance(o, fx.Node) else None
                                         for o in outs[num_fwd:]]
                continue
            val = n.meta.get("val")
            fw_only = tuple(n.meta.get(keys.RECOMPUTE_UNREAD, ()))
            g.add_node(
                n.name,
                order=i,
                phase=n.meta[keys.PHASE],
                storage=n.meta[keys.STORAGE],
                bytes=int(n.meta[keys.BYTES]),
                flops=int(n.meta.get(keys.FLOPS, 0)),
                runtime_s=float(n.meta.get(keys.RUNTIME_S, 0.0)),
                comm_bytes=int(n.meta.get(keys.COMM_BYTES, 0)),
                never_recompute=bool(n.meta.get(keys.NEVER_RECOMPUTE, False)),
                reason=n.meta.get(keys.REASON),
                is_tuple=bool(n.meta.get(keys.TUPLE, False)),
                op=_op_name(n),
                shape=tuple(val.shape) if isinstance(val, torch.Tensor) else None,
                dtype=str(val.dtype).replace("torch.", "") if isinstance(val, torch.Tensor) else None,
                module=n.meta.get(keys.MODULE, ""),
                block=n.meta.get(keys.BLOCK),
                moe=n.meta.get(keys.MOE),
                fw_only_reads=fw_only,
            )
            for a in n.all_input_nodes:
                if a.name not in fw_only:
                    g.add_edge(a.name, n.name)
        g.graph["input_updates"] = sorted(gm.meta.get(keys.INPUT_UPDATES, ()))
        g.graph["block_container"] = gm.meta.get(keys.BLOCK_CONTAINER)
        g.graph["hold_outputs"] = bool(gm.meta[keys.HOLD_OUTPUTS])
        g.graph["device"] = gm.meta.get(keys.DEVICE, "cpu")
        g.graph["traced_on"] = gm.meta.get(keys.TRACED_ON)
        g.graph["trace_notes"] = list(gm.meta.get(keys.TRACE_NOTES, ()))
        g.graph["allocator"] = gm.meta.get(keys.ALLOCATOR, "exact")
        g.graph["cost_model"] = gm.meta.get(keys.COST_MODEL)
        cg = cls(g)
        g.graph["fingerprint"] = cg._compute_fingerprint()
        return cg

    # ------------------------------------------------------------------ basic views
    def __len__(self) -> int:
        return self.g.number_of_nodes()

    def attr(self, name: str, key: str):
        return self.g.nodes[name][key]

    @cached_property
    def order(self) -> list[str]:
        """All node names in joint-graph order."""
        return sorted(self.g.nodes, key=lambda n: self.g.nodes[n]["order"])

    def _phase(self, phase: str) -> list[str]:
        return [n for n in self.order if self.g.nodes[n]["phase"] == phase]

    @cached_property
    def fw_order(self) -> list[str]:
        """Forward nodes in the order the forward runs them."""
        return self._phase("fw")

    @cached_property
    def bw_order(self) -> list[str]:
        """Backward nodes in the order the backward runs them (recomputation is inserted between).

        Nodes that depend on a tangent keep the joint graph's order (autograd's). Nodes that do not
        (a ``detach`` of an activation, a transposed weight: AOTAutograd places them in the forward
        region of the joint graph) run just before their first backward reader, so that what they
        read is not needed from the start of backward.
        """
        bw = self._phase("bw")
        in_bw = set(bw)
        dep: set[str] = set(self.tangents)
        for n in bw:
            if any(p in dep for p in self.g.predecessors(n)):
                dep.add(n)
        outputs = {o for o in self.bw_outputs if o is not None}
        order: list[str] = []
        done: set[str] = set()

        def emit(n: str) -> None:
            stack = [(n, False)]
            while stack:
                cur, expanded = stack.pop()
                if cur in done:
                    continue
                if expanded:
                    done.add(cur)
                    order.append(cur)
                    continue
                stack.append((cur, True))
                stack.extend((p, False) for p in reversed(self.preds(cur)) if p in in_bw and p not in done)

        for n in bw:
            readers = [u for u in self.g.successors(n) if u in in_bw]
            if n in dep or n in outputs or not readers:
                emit(n)
        for n in bw:
            emit(n)
        return order

    @cached_property
    def inputs(self) -> list[str]:
        return self._phase("input")

    @cached_property
    def tangents(self) -> list[str]:
        return self._phase("tangent")

    @property
    def fw_outputs(self) -> list[str | None]:
        return self.g.graph["fw_outputs"]

    @property
    def bw_outputs(self) -> list[str | None]:
        return self.g.graph["bw_outputs"]

    @property
    def fingerprint(self) -> str:
        """A hash of what a plan's meaning depends on, and nothing else: every node's name, op,
        phase, shape and dtype, its inputs, the outputs, the inputs updated in place, whether the
        caller holds the outputs, the allocator the bytes are counted in (omitted when exact,
        so CPU fingerprints are those of plans written before it was hashed), and the memory model
        where it is not the unfused graph's (:func:`remat_compiler.fusion.inductor_view`).

        Not in it: the device index (``cuda:0`` and ``cuda:3`` give one graph), the device type
        itself (what it changes is in the ops, such as CUDA's own attention kernels, and the
        allocator), factory ops' ``device=`` arguments, and the cost model's rates (they change
        the objective, not what a plan means: they are in the plan cache's key).
        """
        return self.g.graph["fingerprint"]

    @property
    def device(self) -> str:
        """The device type the step is planned for (``"cpu"``, ``"cuda"``)."""
        return self.g.graph.get("device", "cpu")

    @property
    def allocator(self) -> str:
        """The :mod:`remat_compiler.passes.allocator` model the bytes are counted in (``"exact"``,
        ``"cuda_caching"``)."""
        return self.g.graph.get("allocator", "exact")

    def preds(self, name: str) -> list[str]:
        """Inputs of a node, in joint-graph order."""
        return self._preds[name]

    @cached_property
    def _preds(self) -> dict[str, list[str]]:
        order = {n: a["order"] for n, a in self.g.nodes(data=True)}
        return {n: sorted(self.g.predecessors(n), key=order.__getitem__) for n in self.g.nodes}

    def fw_preds(self, name: str) -> list[str]:
        """Inputs of a node's forward run, in joint-graph order: its edges and its ``fw_only_reads``."""
        return self._fw_preds.get(name) or self._preds[name]

    @cached_property
    def _fw_preds(self) -> dict[str, list[str]]:
        order = {n: a["order"] for n, a in self.g.nodes(data=True)}
        return {n: sorted({*self._preds[n], *a["fw_only_reads"]}, key=order.__getitem__)
                for n, a in self.g.nodes(data=True) if a.get("fw_only_reads")}

    def storage(self, name: str) -> str | None:
        return self.storages[name]

    @cached_property
    def storages(self) -> dict[str, str | None]:
        """Every node's storage owner, as one dict (for the simulator's inner loop)."""
        return {n: a["storage"] for n, a in self.g.nodes(data=True)}

    # ------------------------------------------------------------------ derived sets
    @property
    def hold_outputs(self) -> bool:
        """Whether the caller keeps the model's outputs through backward (the trace's answer)."""
        return self.g.graph["hold_outputs"]

    @cached_property
    def held_storages(self) -> frozenset[str]:
        """Storages that outlive the step's backward: forward outputs when the caller holds them, and
        otherwise its scalar outputs (the loss it calls ``backward()`` on is alive through it). The
        updated values of inputs mutated in place are not the caller's: AOTAutograd copies them into
        the inputs and drops them (backward keeps one only if it reads it, as a saved value)."""
        updates = set(self.g.graph.get("input_updates", ()))
        outs = [o for i, o in enumerate(self.fw_outputs) if o is not None and i not in updates
                and (self.hold_outputs or self.g.nodes[o]["shape"] == ())]
        return frozenset(self.storage(o) for o in outs if self.storage(o) is not None
                         and self.g.nodes[self.storage(o)]["phase"] == "fw")

    @cached_property
    def candidates(self) -> list[str]:
        """Forward values a plan decides about: storage owners with bytes, not held by the caller.

        Each is either saved for backward (kept alive from the forward) or, if backward needs it,
        recomputed just before its first use there.
        """
        return [n for n in self.fw_order
                if self.storage(n) == n and self.g.nodes[n]["bytes"] > 0 and n not in self.held_storages
                and not self.g.nodes[n]["is_tuple"]]

    @cached_property
    def fw_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.fw_order)}

    @cached_property
    def bw_index(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.bw_order)}

    def is_available_in_bw(self, name: str) -> bool:
        """True for values backward always has: inputs, tangents, and storages the caller holds."""
        node = self.g.nodes[name]
        if node["phase"] in ("input", "tangent"):
            return True
        st = node["storage"]
        return st is not None and st == name and st in self.held_storages

    def summary(self) -> dict:
        """Counts and totals, for logs and the CLI."""
        return {
            "nodes": len(self),
            "fw_nodes": len(self.fw_order),
            "bw_nodes": len(self.bw_order),
            "candidates": len(self.candidates),
            "fw_flops": sum(self.g.nodes[n]["flops"] for n in self.fw_order),
            "bw_flops": sum(self.g.nodes[n]["flops"] for n in self.bw_order),
        }

    def _compute_fingerprint(self) -> str:
        h = hashlib.sha256()
        for n in self.order:
            a = self.g.nodes[n]
            h.update(f"{n}|{a['op']}|{a['phase']}|{a['shape']}|{a['dtype']}|".encode())
            h.update(",".join(self.fw_preds(n)).encode())
            h.update(b";")
        h.update(repr(self.fw_outputs).encode())
        h.update(repr(self.bw_outputs).encode())
        if self.g.graph.get("input_updates"):
            h.update(f"|input updates {self.g.graph['input_updates']}".encode())
        if not self.hold_outputs:
            h.update(b"|outputs dropped")
        if self.allocator != "exact":
            h.update(f"|allocator {self.allocator}".encode())
        if self.g.graph.get("memory_model"):
            h.update(f"|memory model {self.g.graph['memory_model']}".encode())
        return h.hexdigest()[:16]
