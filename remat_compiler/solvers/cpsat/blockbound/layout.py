"""The block decomposition's layout of a graph: its blocks, each one's backward window and the reads
in it (:class:`_Layout`), and the memory no plan changes over a window (:func:`_fixed_intervals`)."""
from __future__ import annotations

import bisect


from remat_compiler.graph import CostGraph, block_stack
from remat_compiler.schedule import bw_time
from remat_compiler.solvers.cpsat.parts import alloc_index, fixed_intervals, storage_readers

__all__ = ["_Layout", "_Profile", "_fixed_intervals"]


class _Layout:
    """Blocks, windows and reads of a graph; ``ok`` False where the decomposition does not apply."""

    def __init__(self, cg: CostGraph):
        self.ok = False
        stack = block_stack(cg)
        if stack is None:
            return
        self.F, self.B = len(cg.fw_order), len(cg.bw_order)
        self.stack = stack
        self.blocks = stack.blocks
        L = self.L = len(stack.blocks)
        index = {b: k for k, b in enumerate(stack.blocks)}
        self.nodes = [[n for n in cg.fw_order if cg.attr(n, "block") == b] for b in stack.blocks]
        reads: dict[str, list[int]] = {}  # forward node -> backward steps reading it
        for j, b in enumerate(cg.bw_order):
            for p in cg.preds(b):
                reads.setdefault(p, []).append(j)
        self.reads = reads
        sreads: dict[str, list[int]] = {}  # storage -> backward steps reading it (views included)
        for v, steps in reads.items():
            if cg.storage(v) is not None:
                sreads.setdefault(cg.storage(v), []).extend(steps)
        self.sreads = sreads
        bw_block = [index.get(cg.attr(n, "block")) for n in cg.bw_order]
        ws = [min((j for j, k in enumerate(bw_block) if k == m), default=None) for m in range(L)]
        if None in ws or any(ws[m] <= ws[m + 1] for m in range(L - 1)):
            return  # every block has backward nodes, in reverse block order
        self.ws = ws
        first_read = []
        for m in range(L):
            steps = [j for v in self.nodes[m] for j in reads.get(v, ())]
            if not steps:
                return
            first_read.append(min(steps))
        self.pull = None
        if all(first_read[m] >= ws[m] for m in range(L)):
            # no block's value is read by backward before its own window (a bfloat16 stack: the
            # residual sum is read by the next block's forward only, its backward reads the float32
            # copy): the next block's recomputation may *pull* the boundary (module docstring, 4);
            # a block holds its share until its own window starts
            self.pull = self._pulled_boundary(cg)
            if self.pull is None or any(max(j for v in self.nodes[m] for j in reads.get(v, ())) >= ws[m - 1]
                                        for m in range(1, L)):
                return  # a block's values read after its window: another block's business
            self.tau = [None] + [ws[m - 1] for m in range(1, L)]
            self.tau_head = ws[L - 1]
        else:
            if any(first_read[m - 1] < ws[m] for m in range(1, L)):
                return  # a block's values are read before the next block's window
            self.tau = [None] + [first_read[m - 1] for m in range(1, L)]
            self.tau_head = first_read[L - 1]
            if self.tau_head >= ws[L - 1]:
                return
        rel_tau = {self.tau[m] - ws[m] for m in range(1, L)}
        if len(rel_tau) != 1:
            return
        self.rel_tau = rel_tau.pop()
        # identical in what the decomposition uses: ops, sizes, in-block edges, reads relative to
        # the window (reads before it only count as needs)
        idx = cg.fw_index
        cands = set(cg.candidates)
        sigs = set()
        for m in range(L):
            pos = {n: i for i, n in enumerate(self.nodes[m])}
            sigs.add(tuple(
                (cg.attr(n, "op"), cg.attr(n, "bytes"), cg.storage(n) == n, cg.attr(n, "is_tuple"),
                 n in cands, bool(cg.attr(n, "never_recompute")), idx[n] - idx[self.nodes[m][0]],
                 tuple(pos.get(p, -1) for p in cg.preds(n)),
                 tuple(j - ws[m] for j in reads.get(n, ()) if j >= ws[m]),
                 any(j < ws[m] for j in reads.get(n, ())))
                for n in self.nodes[m]))
        if len(sigs) != 1:
            return
        if self.pull is not None:
            self.ok = True
            return
        # a block's values read by forward nodes outside it (whose recomputation could read them at
        # any time) must be boundaries: read directly by backward before the block's window, so
        # live until then in every plan
        for m in range(L):
            inside = set(self.nodes[m])
            for v in self.nodes[m]:
                if cg.is_available_in_bw(v):
                    continue
                outside = [u for u in cg.g.successors(v) if cg.attr(u, "phase") == "fw" and u not in inside]
                if outside and not any(j < ws[m] for j in reads.get(v, ())):
                    return
        self.ok = True

    def read_in_backward(self, v: str) -> bool:
        """Whether a backward step reads ``v``, directly or through a view of its storage."""
        return bool(self.reads.get(v) or self.sreads.get(v))

    def _pulled_boundary(self, cg: CostGraph) -> int | None:
        """Where no block's value is read by backward before its window: the position in its block
        of the one value each block's successor (the head, for the last) reads in forward, the
        same in every block; None where there is not exactly one, or another block reads it."""
        found = set()
        for m in range(self.L):
            inside = set(self.nodes[m])
            nxt = set(self.nodes[m + 1]) if m + 1 < self.L else None
            out = []
            for p, v in enumerate(self.nodes[m]):
                if cg.is_available_in_bw(v):
                    continue
                outside = [u for u in cg.g.successors(v) if cg.attr(u, "phase") == "fw" and u not in inside]
                if not outside:
                    continue
                if nxt is not None and any(u not in nxt for u in outside):
                    return None
                if nxt is None and any(cg.attr(u, "block") in self.blocks for u in outside):
                    return None
                out.append(p)
            if len(out) != 1:
                return None
            found.add(out[0])
        if len(found) != 1:
            return None
        pull = found.pop()
        # the positions, in a block, of the nodes reading the previous block's boundary: the same in each
        readers = {tuple(p for p, u in enumerate(self.nodes[m]) if self.nodes[m - 1][pull] in cg.preds(u))
                   for m in range(1, self.L)}
        if len(readers) != 1:
            return None
        self.pull_readers = readers.pop()
        return pull


class _Profile:
    """Load of intervals ``(start, end, bytes)`` at any time, by binary search."""

    def __init__(self, intervals):
        starts = sorted((a, s) for a, _z, s in intervals)
        ends = sorted((z, s) for _a, z, s in intervals)
        self.s_at = [a for a, _ in starts]
        self.e_at = [z for z, _ in ends]
        self.s_cum = [0]
        for _a, s in starts:
            self.s_cum.append(self.s_cum[-1] + s)
        self.e_cum = [0]
        for _z, s in ends:
            self.e_cum.append(self.e_cum[-1] + s)

    def __call__(self, t: int) -> int:
        return self.s_cum[bisect.bisect_right(self.s_at, t)] - self.e_cum[bisect.bisect_left(self.e_at, t)]


def _fixed_intervals(cg: CostGraph, lay: _Layout):
    """Memory every plan has, as (start, end, bytes) on the model's time axis: what the full model
    fixes (:func:`.cpmodel.fixed_intervals`); and each candidate outside the blocks while the
    forward still reads it and between its first and last backward read (saved or recomputed,
    backward reads it there)."""
    fixed, _base = fixed_intervals(cg)
    blocks = set(lay.blocks)
    fw_last = storage_readers(cg)[1]
    for v in cg.candidates:
        if cg.attr(v, "block") in blocks or cg.is_available_in_bw(v):
            continue
        a = alloc_index(cg, v)
        fixed.append((a, max(fw_last.get(v, a), a), cg.attr(v, "bytes")))
        if lay.sreads.get(v):
            fixed.append((bw_time(lay.F, min(lay.sreads[v])), bw_time(lay.F, max(lay.sreads[v])),
                          cg.attr(v, "bytes")))
    return fixed
