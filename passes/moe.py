"""Pass: find the MoE segments of a joint graph and tag each of their nodes with its role.

Reads ``meta["custom"]["remat.trace_module"]`` / ``["remat.module_class"]`` (recorded while tracing),
``meta["remat.phase"]`` and ``meta["remat.storage"]``; writes ``meta["remat.moe"]`` on every node recorded inside an MoE block, a
dict with the keys

=============  ========================================================================================
``segment``    the MoE block's module path (``""`` when the traced model is the block itself)
``kind``       ``"moe_layer"`` (:class:`remat_compiler.moe.MoELayer`), ``"hf_sparse_moe"``
               (transformers' ``MixtralSparseMoeBlock``, ``OlmoeSparseMoeBlock``,
               ``Qwen3MoeSparseMoeBlock``: a ``gate`` router and a fused ``experts`` module) or
               ``"hf_shared_moe"`` (``DeepseekV3MoE``: the same two plus a dense ``shared_experts``
               MLP that every token runs, added to the routed output; ``Qwen2MoeSparseMoeBlock``:
               a ``shared_expert`` MLP scaled by a sigmoid ``shared_expert_gate``, then added)
``role``       one of :data:`ROLES`, see below
``fused``      True on the nodes of the MoELayer's fused GEMM2 -> A2A -> Unpermute
               (``combine="fused"``, :class:`remat_compiler.moe.FusedCombine`) and of an HF
               experts module's fused down projection + combine (its ``fused_combine`` child,
               :func:`remat_compiler.moe.hf.hf_fused_combine_mode`), else False
``grad_of``    on the backward nodes of an HF block: the forward roles (a sorted tuple) of the
               block's forward nodes that autograd recorded under the same sequence number
               (``meta["seq_nr"]``), i.e. of the forward ops whose gradient the node computes;
               ``()`` where none is found, and ``None`` on every other node. Its backward roles
               say only which submodule recorded it (``experts``), so this is what names the
               backward of the down projection and the combine
               (:mod:`remat_compiler.solvers.combine_choice`)
=============  ========================================================================================

Roles of forward nodes, in the order the forward runs them:

- ``input``: the block's own nodes before routing (the reshape of the hidden states to tokens);
- ``router``: gate GEMM, softmax, top-k, renormalisation; except its two outputs, which are
  ``probs`` (the floating routing weights the unpermute multiplies by) and ``routing`` (the integer
  expert indices): the router's nodes that other forward nodes of the segment read;
- ``permute``: gathering token copies into expert order (sort, gather, offsets, capacity slots);
- ``dispatch_a2a`` / ``combine_a2a``: the two all-to-alls (and their layout reshapes);
- ``gemm1``, ``act`` (SwiGLU: everything between the two GEMMs), ``gemm2``;
- ``unpermute``: weighting by probs and summing each token's rows;
- ``shared``: the shared experts (DeepSeek-V3's ``shared_experts`` MLP; Qwen2-MoE's ``shared_expert``
  MLP and its ``shared_expert_gate`` linear, whose sigmoid and product the block itself computes
  and so are ``output``), which run on every token
  beside the routed ones: ``moe_origin`` recomputes them with the rest of the segment, ``moe_fast``
  saves what their backward reads (only the routed experts' activation is recomputed);
- ``output``: the block's own nodes after the experts (the reshape back, the sum with the shared
  experts' output): those reading, within the block, a node of the experts or the shared experts.

For :class:`~remat_compiler.moe.MoELayer` the role is the submodule that ran the node
(``router`` ... ``unpermute``); in fused mode the ``fused_combine`` submodule's GEMM is ``gemm2``,
its collectives ``combine_a2a`` and the rest ``unpermute``. An HF block's ``experts`` runs every step in
one module (grouped or batched matmuls; with the fused combine, the down projection and the weighted
sum in its ``fused_combine`` child, roled with the rest of the module), so its forward roles come from
data flow: the first and last expert GEMMs are ``gemm1`` and ``gemm2`` (with views of their outputs, and the weight views and
gathers that feed them, i.e. the nodes whose ancestry inside the module reaches a parameter
placeholder), the nodes between them ``act``, earlier
nodes ``permute`` and later ones ``unpermute``; if the module does not have exactly two GEMMs its
nodes are ``experts``. Backward nodes carry the role of the submodule that recorded them (``experts``
for the HF experts module, ``shared`` for the shared experts, ``boundary`` for the block's own
gradient reshapes).

Blocks are recognised by class name (:data:`MOE_BLOCKS`). HuggingFace's experts run their
``grouped_mm`` implementation (transformers' default ``experts_implementation``), which has static
shapes: traced, its GEMMs are ``aten._grouped_mm`` in bfloat16 and transformers'
``grouped_mm_fallback`` op in float32 (which transformers uses while compiling). The ``"eager"`` one
loops in Python over the experts that received tokens (``nonzero`` on the routing), which cannot be
traced (see :func:`remat_compiler.trace.trace`). The pass only writes metadata.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from remat_compiler.passes.c10d import is_c10d
from remat_compiler.passes.keys import MOE, PHASE, STORAGE, TRACE_MODULE, TRACE_MODULE_CLASS

__all__ = ["tag_moe_segments", "ROLES", "MOE_BLOCKS"]

ROLES = ("input", "router", "probs", "routing", "permute", "dispatch_a2a", "gemm1", "act", "gemm2",
         "combine_a2a", "unpermute", "shared", "output", "experts", "boundary")

# block class -> kind
MOE_BLOCKS = {"MoELayer": "moe_layer", "MixtralSparseMoeBlock": "hf_sparse_moe",
              "OlmoeSparseMoeBlock": "hf_sparse_moe", "Qwen3MoeSparseMoeBlock": "hf_sparse_moe",
              "DeepseekV3MoE": "hf_shared_moe", "Qwen2MoeSparseMoeBlock": "hf_shared_moe"}

_LAYER_CHILDREN = {"router": "router", "permute": "permute", "dispatch": "dispatch_a2a",
                   "gemm1": "gemm1", "act": "act", "gemm2": "gemm2", "combine": "combine_a2a",
                   "unpermute": "unpermute"}
_FUSED_CHILD = "fused_combine"
_HF_ROUTER, _HF_EXPERTS = "gate", "experts"
_HF_SHARED = ("shared_experts", "shared_expert", "shared_expert_gate")  # DeepSeek-V3's; Qwen2-MoE's
_GEMM_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "_grouped_mm", "grouped_mm",
             "grouped_mm_fallback"}


def _custom(node: fx.Node) -> dict:
    return node.meta.get("custom") or {}


def _op_name(node: fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return schema.name.split("::")[-1] if schema is not None else ""


def _is_gemm(node: fx.Node) -> bool:
    return node.op == "call_function" and _op_name(node) in _GEMM_OPS


def _find_segments(gm: fx.GraphModule) -> dict[str, str]:
    """Module paths of MoE blocks seen in the trace -> kind."""
    found = {}
    for n in gm.graph.nodes:
        custom = _custom(n)
        kind = MOE_BLOCKS.get(custom.get(TRACE_MODULE_CLASS, ""))
        if kind is not None and custom.get(TRACE_MODULE) is not None:
            found[custom[TRACE_MODULE]] = kind
    return found


def _segment_of(path: str, segments: dict[str, str]) -> str | None:
    best = None
    for seg in segments:
        if path == seg or seg == "" or path.startswith(seg + "."):
            if best is None or len(seg) > len(best):
                best = seg
    return best


def _child(path: str, seg: str) -> tuple[str, str]:
    """(first component below the block, the rest) of ``path``; ("", "") for the block itself."""
    rel = path if seg == "" else path[len(seg) + 1:]
    head, _, rest = rel.partition(".")
    return head, rest


def _descendants(start: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [start]
    while stack:
        for u in stack.pop().users:
            if u in within and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _ancestors(start: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), [start]
    while stack:
        for p in stack.pop().all_input_nodes:
            if p in within and p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _with_getitems(node: fx.Node) -> set[fx.Node]:
    return {node} | {u for u in node.users if u.target is operator.getitem}


def _expert_roles(region: list[fx.Node]) -> dict[fx.Node, str]:
    """Forward roles inside a module that runs permute, both GEMMs, SwiGLU and unpermute itself."""
    gemms = [n for n in region if _is_gemm(n)]
    if len(gemms) != 2:
        return {n: "experts" for n in region}
    within = set(region)
    g1, g2 = gemms
    after_g1, before_g2 = _descendants(g1, within), _ancestors(g2, within)
    before_g1, after_g2 = _ancestors(g1, within), _descendants(g2, within)
    touches_param: dict[fx.Node, bool] = {}
    for n in region:  # graph order: inputs first
        touches_param[n] = any(p.op == "placeholder" or touches_param.get(p, False)
                               for p in n.all_input_nodes)
    position = {n: i for i, n in enumerate(region)}
    roles = {}
    for n in region:
        storage = n.meta.get(STORAGE)
        if n in _with_getitems(g1) or storage == g1.name:
            roles[n] = "gemm1"
        elif n in _with_getitems(g2) or storage == g2.name:
            roles[n] = "gemm2"
        elif n in after_g1 and n in before_g2:
            roles[n] = "act"
        elif n in after_g2:
            roles[n] = "unpermute"
        elif touches_param[n] and n in before_g1:
            roles[n] = "gemm1"
        elif touches_param[n] and n in before_g2:
            roles[n] = "gemm2"
        else:
            roles[n] = "permute" if position[n] < position[g1] else "unpermute"
    return roles


def _router_outputs(router_nodes: list[fx.Node], seg_fw: set[fx.Node]) -> dict[fx.Node, str]:
    """The router's nodes that the rest of the segment's forward reads: probs (float) / routing (int)."""
    inside = set(router_nodes)
    out = {}
    for n in router_nodes:
        if any(u in seg_fw and u not in inside for u in n.users):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                out[n] = "probs" if val.is_floating_point() else "routing"
    return out


def tag_moe_segments(gm: fx.GraphModule) -> fx.GraphModule:
    """Write ``meta["remat.moe"]`` (segment, kind, role, fused) on every node of every MoE block.

    Parameters
    ----------
    gm : fx.GraphModule
        A joint graph annotated by :func:`remat_compiler.passes.phases.annotate_phases` and
        :func:`remat_compiler.passes.storage.annotate_storage` (``remat.phase``, ``remat.storage``), whose nodes
        carry the module paths recorded by :func:`remat_compiler.trace.trace`.

    Returns
    -------
    fx.GraphModule
        The same graph; nodes outside MoE blocks get ``meta["remat.moe"] = None``.

    Example
    -------
    >>> gm = tag_moe_segments(gm)                                  # doctest: +SKIP
    >>> {n.meta["remat.moe"]["role"] for n in gm.graph.nodes if n.meta["remat.moe"]}  # doctest: +SKIP
    {'input', 'router', 'probs', 'routing', 'permute', 'gemm1', 'act', ...}
    """
    segments = _find_segments(gm)
    members: dict[str, list[fx.Node]] = {seg: [] for seg in segments}
    for n in gm.graph.nodes:
        n.meta[MOE] = None
        path = _custom(n).get(TRACE_MODULE)
        if path is None or n.op != "call_function":
            continue
        seg = _segment_of(path, segments)
        if seg is not None:
            members[seg].append(n)
    for seg, nodes in members.items():
        kind = segments[seg]
        roles = _segment_roles(seg, kind, nodes)
        grad_of = _grad_of(nodes, roles) if kind != "moe_layer" else {}
        for n in nodes:
            role, fused = roles[n]
            n.meta[MOE] = {"segment": seg, "kind": kind, "role": role, "fused": fused,
                           "grad_of": grad_of.get(n)}
    return gm


def _grad_of(nodes: list[fx.Node], roles: dict[fx.Node, tuple[str, bool]]) -> dict[fx.Node, tuple]:
    """Each backward node of a segment -> the sorted forward roles recorded under its ``seq_nr``."""
    by_seq: dict[int, set[str]] = {}
    for n in nodes:
        if n.meta.get(PHASE) == "fw" and n.meta.get("seq_nr") is not None:
            by_seq.setdefault(n.meta["seq_nr"], set()).add(roles[n][0])
    return {n: tuple(sorted(by_seq.get(n.meta.get("seq_nr"), ()))) for n in nodes if n.meta.get(PHASE) != "fw"}


def _segment_roles(seg: str, kind: str, nodes: list[fx.Node]) -> dict[fx.Node, tuple[str, bool]]:
    children = {n: _child(_custom(n)[TRACE_MODULE], seg) for n in nodes}
    fw = [n for n in nodes if n.meta.get(PHASE) == "fw"]
    router_child = "router" if kind == "moe_layer" else _HF_ROUTER
    router_fw = [n for n in fw if children[n][0] == router_child]
    computed = {n for n in fw if children[n][0] == _HF_EXPERTS or children[n][0] in _HF_SHARED}
    after_experts: set[fx.Node] = set()  # forward nodes reading (through the block) an expert's result
    for n in fw:  # graph order: a node's inputs come first
        if any(p in computed or p in after_experts for p in n.all_input_nodes):
            after_experts.add(n)
    first_router = router_fw[0] if router_fw else None
    order = {n: i for i, n in enumerate(nodes)}
    outputs = _router_outputs(router_fw, set(fw))
    experts = _expert_roles([n for n in fw if children[n][0] == _HF_EXPERTS]) if kind != "moe_layer" else {}
    roles: dict[fx.Node, tuple[str, bool]] = {}
    for n in nodes:
        head, rest = children[n]
        is_fw = n.meta.get(PHASE) == "fw"
        fused = False
        if head == "":
            if not is_fw:
                role = "boundary"
            elif kind != "moe_layer":
                role = "output" if n in after_experts else "input"
            else:
                role = "input" if first_router is None or order[n] < order[first_router] else "output"
        elif head == router_child:
            role = outputs.get(n, "router")
        elif kind == "moe_layer" and head == _FUSED_CHILD:
            fused = True
            role = "gemm2" if _is_gemm(n) else "combine_a2a" if is_c10d(n) else "unpermute"
        elif kind == "moe_layer":
            role = _LAYER_CHILDREN.get(head, "experts")
        elif head == _HF_EXPERTS:
            role = experts.get(n, "act" if rest.startswith("act_fn") else "experts")
            fused = rest.partition(".")[0] == _FUSED_CHILD
        elif head in _HF_SHARED:
            role = "shared"
        else:
            role = "experts"
        roles[n] = (role, fused)
    return roles
