"""The two combines of an MoE segment side by side: what a solve that chooses between them per
segment needs (issue 16 part 2).

:class:`~remat_compiler.moe.MoELayer`'s combines (``"autograd"``: GEMM2 -> A2A -> Unpermute as plain
ops; ``"fused"``: one :class:`~remat_compiler.moe.FusedCombine` whose backward is
``remat::combine_dgrad``), and a transformers MoE block's (its experts' down projection, routing
weights, restored order and per-token sum as transformers runs them, or as one
:class:`~remat_compiler.moe.hf.GroupedFusedCombine` whose backward is
``remat::grouped_combine_dgrad``, running transformers' forward ops in transformers' order) run the
same forward ops and differ, in each segment, only in one contiguous piece of the backward: from the
gradient of the segment's output ``G`` to ``dL/da`` (the SwiGLU output's gradient), ``dL/dp`` (the
probabilities') and ``dL/dW2``. An MoELayer's piece is the backward its GEMM2, combine and unpermute
submodules recorded; an HF block's, all recorded by its ``experts`` module, is the backward of its
GEMM2 and unpermute forward ops (:func:`in_piece`, ``remat_compiler.passes.moe``'s ``grad_of``).
:func:`align_combines` takes the
graphs traced with every segment in each mode and checks exactly that: identical forward nodes (names,
ops, shapes), and a backward that, outside the pieces, is the same sequence of ops in both, node for
node. It returns the :class:`CombineUnion`: per segment, each piece's nodes, what it reads (the
backward values upstream, the forward values, with the step it reads them at) and which of its nodes
the rest of the backward reads in place of the other piece's. Segments left unfused in the fused
graph (an HF block whose experts cannot run the fused combine), and segments fused in both (an
MoELayer the user built with ``combine="fused"``), are no choice: their backward is shared.

Under expert parallelism the two pieces hold different collectives: the autograd piece sends
``dL/dy`` through the all-to-all that reverses the combine; the fused piece sends ``G`` through it,
the probabilities along in a small all-to-all and ``dL/dp`` back in another (the uneven
``remat::all_to_all_uneven`` op with a route). The collectives are backward nodes of the piece, so
they are never recomputed, and the graph a choice materialises runs each of them once, in its
piece's place: every rank runs rank 0's choice, so every rank issues the same collectives in the same
order. Outside the pieces the collectives are shared, op for op.

:meth:`CombineUnion.materialise` splices, for a choice of mode per segment, the chosen pieces between
the shared nodes: it is the backward op sequence of the graph traced with those modes
(:func:`remat_compiler.moe.segments.segment_combines`), which is the graph a plan made on the union is then
simulated, emitted and checked on. The forward decisions of a plan (its saved set) carry over by name,
since the forward nodes are the same.

Example
-------
>>> _, cg_a = analyze(model, (x,))                       # doctest: +SKIP
>>> _, cg_f = analyze(model, (x,), solver="moe_cpsat")   # doctest: +SKIP
>>> union = align_combines(cg_a, cg_f)                   # doctest: +SKIP
>>> union.pieces["layers.0"]["autograd"].fw_reads         # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat_compiler.graph import CostGraph

__all__ = ["Piece", "CombineUnion", "align_combines", "in_piece", "MODES", "PIECE_ROLES"]

MODES = ("autograd", "fused")
#: Backward roles of a segment's combine piece (:mod:`remat_compiler.passes.moe`): the fused combine's backward
#: nodes are all of the ``fused_combine`` submodule, tagged with these roles too.
PIECE_ROLES = frozenset({"gemm2", "combine_a2a", "unpermute"})


@dataclass
class Piece:
    """One segment's combine backward in one mode.

    Attributes
    ----------
    nodes : list of str
        Its backward nodes, in the order the backward runs them (contiguous there).
    start : int
        Backward step of its first node in the graph it was traced in.
    bw_inputs : list of str
        Backward values (or tangents) produced outside the piece that it reads: ``G``'s storage.
    fw_reads : dict of str to int
        Forward values it reads (storage owners) -> the piece-relative step of its last read of each.
    outputs : dict of str to str
        Its nodes read outside it -> a mode-independent key (``"read:<shared node>:<i>"``, the i-th
        piece input of that shared node, or ``"bw_output:<i>"``) that the other piece's matching
        node has too.
    """

    nodes: list[str]
    start: int
    bw_inputs: list[str] = field(default_factory=list)
    fw_reads: dict[str, int] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)


@dataclass
class CombineUnion:
    """Both combines of every MoE segment that is a choice, aligned (see the module docstring).

    Attributes
    ----------
    graphs : dict of str to CostGraph
        The graph with every segment traced in each mode: ``{"autograd": cg, "fused": cg}``.
    pieces : dict of str to dict of str to Piece
        ``{segment: {mode: Piece}}``, segments in the order their pieces run in backward.
    shared : list of tuple of str
        The backward nodes outside the pieces, in backward order, as ``(autograd name, fused name)``
        pairs of the same op.
    """

    graphs: dict[str, CostGraph]
    pieces: dict[str, dict[str, Piece]]
    shared: list[tuple[str, str]]

    def materialise(self, modes: dict[str, str]) -> list[tuple[str, str]]:
        """The backward of the graph whose segments run the combines ``modes`` names.

        Parameters
        ----------
        modes : dict of str to str
            A mode (:data:`MODES`) for every segment of :attr:`pieces`.

        Returns
        -------
        list of tuple of str
            ``(mode, node name)`` in backward order: the shared nodes (by their name in the autograd
            graph, ``mode`` ``"shared"``) with each segment's chosen piece spliced in where the
            pieces run, names as in that mode's graph.

        Raises
        ------
        ValueError
            If a segment has no mode or an unknown one, or ``modes`` names a segment the graphs do
            not have.
        """
        unknown = set(modes) - set(self.pieces)
        if unknown:
            raise ValueError(f"no MoE segment {sorted(unknown)} to choose for in the graphs; segments: "
                             f"{', '.join(repr(s) for s in self.pieces)}")
        for seg in self.pieces:
            if modes.get(seg) not in MODES:
                raise ValueError(f"segment {seg!r} needs a combine mode, one of {MODES}; got "
                                 f"{modes.get(seg)!r}")
        cg_a = self.graphs["autograd"]
        index = cg_a.bw_index
        at = {self.pieces[seg]["autograd"].start: seg for seg in self.pieces}
        out: list[tuple[str, str]] = []
        shared = iter(self.shared)
        pending = next(shared, None)
        for j in range(len(cg_a.bw_order) + 1):
            if j in at:
                seg = at[j]
                out += [(modes[seg], n) for n in self.pieces[seg][modes[seg]].nodes]
            while pending is not None and index[pending[0]] == j:
                out.append(("shared", pending[0]))
                pending = next(shared, None)
        return out


def in_piece(tag: dict | None) -> bool:
    """Whether a backward node (its ``moe`` tag) belongs to its segment's combine piece: an
    MoELayer's by the submodule that recorded it (:data:`PIECE_ROLES`); an HF block's, all
    recorded by its ``experts``, by the forward ops it differentiates (``grad_of``, all of them
    GEMM2 or unpermute: the down projection, the routing weights, the restored order, the sum)."""
    if not tag:
        return False
    if tag.get("kind") == "moe_layer":
        return tag.get("role") in PIECE_ROLES
    grad_of = tag.get("grad_of") or ()
    return bool(grad_of) and set(grad_of) <= PIECE_ROLES


def _pieces_of(cg: CostGraph, segments) -> dict[str, list[str]]:
    """The combine backward nodes of each of ``segments``, in backward order."""
    found: dict[str, list[str]] = {}
    for n in cg.bw_order:
        tag = cg.attr(n, "moe")
        if in_piece(tag) and tag["segment"] in segments:
            found.setdefault(tag["segment"], []).append(n)
    return found


def _fused_segments(cg: CostGraph) -> dict[str, tuple[str, bool]]:
    """segment -> (kind, whether any of its forward nodes ran a fused combine)."""
    found: dict[str, tuple[str, bool]] = {}
    for n in cg.fw_order:
        tag = cg.attr(n, "moe") or {}
        if tag:
            kind, fused = found.get(tag["segment"], (tag["kind"], False))
            found[tag["segment"]] = (kind, fused or bool(tag["fused"]))
    return found


def _check_forward(cg_a: CostGraph, cg_f: CostGraph) -> list[str]:
    """Check the forwards are the same and each graph is in its mode; the segments to choose for
    (fused in the fused graph alone: one fused in both, a user's ``combine="fused"`` MoELayer, is
    no choice, its backward shared)."""
    if cg_a.fw_order != cg_f.fw_order:
        raise ValueError("the two combines' graphs have different forward nodes; trace the same model "
                         "and inputs with segment_combines(model, ...) each segment 'autograd', then "
                         "'fused'")
    for n in cg_a.fw_order:
        for key in ("op", "shape", "dtype", "storage"):
            if cg_a.attr(n, key) != cg_f.attr(n, key):
                raise ValueError(f"forward node {n!r} differs between the two combines' graphs in its "
                                 f"{key}: {cg_a.attr(n, key)!r} against {cg_f.attr(n, key)!r}")
    auto, fused = _fused_segments(cg_a), _fused_segments(cg_f)
    if any(f and not fused.get(seg, ("", False))[1] for seg, (_k, f) in auto.items()):
        raise ValueError("a segment fused in the autograd graph is unfused in the fused one: trace every "
                         "segment that is a choice 'autograd', then 'fused'")
    if any(k == "moe_layer" and not f for k, f in fused.values()):
        raise ValueError("the fused graph was not traced with every MoELayer in combine='fused'")
    return [seg for seg, (_k, f) in fused.items() if f and not auto[seg][1]]


def _piece(cg: CostGraph, nodes: list[str], shared_key: dict[str, str]) -> Piece:
    """A piece's reads and outputs; ``shared_key`` names each shared node mode-independently."""
    inside = set(nodes)
    index = cg.bw_index
    start = index[nodes[0]]
    if [index[n] for n in nodes] != list(range(start, start + len(nodes))):
        raise ValueError(f"the combine backward {nodes[0]!r}..{nodes[-1]!r} is not contiguous in the "
                         "backward order: the pieces cannot be swapped")
    piece = Piece(list(nodes), start)
    for j, n in enumerate(nodes):
        for p in cg.preds(n):
            if p in inside:
                continue
            phase = cg.attr(p, "phase")
            if phase == "fw":
                owner = cg.storage(p)
                if owner is not None:
                    piece.fw_reads[owner] = j
            elif phase in ("bw", "tangent") and cg.storage(p) not in piece.bw_inputs:
                piece.bw_inputs.append(cg.storage(p) or p)
    outputs = {o: i for i, o in enumerate(cg.bw_outputs) if o in inside}
    for n in nodes:
        if n in outputs:
            piece.outputs[n] = f"bw_output:{outputs[n]}"
    for n in cg.bw_order:
        if n in inside:
            continue
        reads = [p for p in cg.preds(n) if p in inside]
        for i, p in enumerate(reads):
            piece.outputs.setdefault(p, f"read:{shared_key[n]}:{i}")
    return piece


def align_combines(cg_autograd: CostGraph, cg_fused: CostGraph) -> CombineUnion:
    """Align the graphs of a model traced with every segment's combine in each mode.

    Parameters
    ----------
    cg_autograd, cg_fused : CostGraph
        The same step traced with every segment that is a choice autograd, and then fused
        (:func:`remat_compiler.moe.segments.segment_combines`): every MoELayer, and the
        transformers blocks whose experts can run the fused combine. An HF block left unfused in
        the fused graph, or an MoELayer fused in both, is no choice: its backward is shared.

    Returns
    -------
    CombineUnion

    Raises
    ------
    ValueError
        If the forwards differ, a graph was not traced in its mode, the segments differ, no
        segment is fused, a piece is not contiguous in the backward, or the backwards differ outside the pieces (op for op,
        with the same MoE tags, reading the same forward values); the message names the first
        difference.
    """
    segments = _check_forward(cg_autograd, cg_fused)
    graphs = {"autograd": cg_autograd, "fused": cg_fused}
    found = {mode: _pieces_of(cg, segments) for mode, cg in graphs.items()}
    if list(found["autograd"]) != list(found["fused"]) or len(found["fused"]) != len(segments):
        raise ValueError(f"the combines' graphs have different MoE combine pieces in backward: "
                         f"{list(found['autograd'])} against {list(found['fused'])} (segments fused "
                         f"in the fused graph: {segments})")
    if not found["autograd"]:
        raise ValueError("no MoE segment with a fused combine in the graphs: nothing to choose")
    rest = {mode: [n for n in cg.bw_order if n not in {m for ns in found[mode].values() for m in ns}]
            for mode, cg in graphs.items()}
    if len(rest["autograd"]) != len(rest["fused"]):
        raise ValueError(f"outside the combine pieces the backwards differ in length: "
                         f"{len(rest['autograd'])} against {len(rest['fused'])} nodes")
    shared = list(zip(rest["autograd"], rest["fused"]))
    for a, f in shared:
        for key in ("op", "shape", "dtype", "moe"):
            if cg_autograd.attr(a, key) != cg_fused.attr(f, key):
                raise ValueError(f"backward node {a!r} (autograd) and {f!r} (fused) differ in their "
                                 f"{key}: {cg_autograd.attr(a, key)!r} against {cg_fused.attr(f, key)!r}")
    key_of = {"autograd": {a: a for a, _ in shared}, "fused": {f: a for a, f in shared}}
    pieces = {seg: {mode: _piece(graphs[mode], found[mode][seg], key_of[mode]) for mode in MODES}
              for seg in found["autograd"]}
    for seg, both in pieces.items():
        if sorted(both["autograd"].outputs.values()) != sorted(both["fused"].outputs.values()):
            raise ValueError(f"segment {seg!r}: the two combines' backwards hand different values to the "
                             f"rest of the backward: {sorted(both['autograd'].outputs.values())} against "
                             f"{sorted(both['fused'].outputs.values())}")
    _check_shared_reads(graphs, shared, pieces)
    return CombineUnion(graphs, pieces, shared)


def _check_shared_reads(graphs: dict[str, CostGraph], shared, pieces) -> None:
    """Each shared pair reads the same values: the same forward nodes, the partner of each shared
    node, and the same piece outputs (by their mode-independent keys)."""
    partner = {f: a for a, f in shared}
    out_key = {mode: {n: k for both in pieces.values() for n, k in both[mode].outputs.items()}
               for mode in MODES}
    for a, f in shared:
        def reads(mode, n, to_a):
            cg = graphs[mode]
            return sorted(out_key[mode].get(p) or to_a(p) if cg.attr(p, "phase") == "bw" else p
                          for p in cg.preds(n))
        got_a = reads("autograd", a, lambda p: p)
        got_f = reads("fused", f, lambda p: partner.get(p, p))
        if got_a != got_f:
            raise ValueError(f"backward node {a!r} (autograd) and {f!r} (fused) read different values: "
                             f"{got_a} against {got_f}")
