"""The schedule a plan implies, and an independent liveness simulation of it.

A plan is a set of saved forward values. Everything else follows from one rule, which codegen
implements and this module simulates:

- the forward runs every forward node in order; a value that is not saved is freed after its last
  forward use;
- the backward runs its nodes in order; a forward value it needs that is neither saved nor otherwise
  available (inputs, tangents, outputs the caller holds) is recomputed *just before the first backward
  step that needs it*, together with whatever it needs in turn (a multi-output op's used outputs are
  taken right after it); each value is freed after its last use.

Memory is counted per step: forward step ``i`` runs the i-th forward node; backward step ``F + j`` runs
the recomputations the j-th backward node needs and then that node. A value is live from the step that
allocates it through the step of its last use, both included; the peak is the largest sum of live bytes
over all steps. Parameters and inputs are resident before the step and not counted; tangents appear at
the first backward step; parameter gradients and the caller's outputs stay live to the end.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

from remat_compiler.costgraph import CostGraph
from remat_compiler.errors import PlanCheckError

__all__ = ["Schedule", "SimResult", "build_schedule", "simulate", "save_all_set"]


@dataclass
class Schedule:
    """What runs when.

    Attributes
    ----------
    fw : list[str]
        Forward nodes, in order.
    bw : list[tuple[list[str], str]]
        Backward steps: the nodes recomputed just before the step, then the backward node.
    saved : list[str]
        Candidate values the forward keeps for backward (the plan's decision).
    bw_inputs : list[str]
        Every forward-side value the backward reads directly: saved values, and inputs, tangents and
        held outputs it uses. This is what the forward hands to the backward.
    recomputed : list[str]
        Forward nodes that backward recomputes, in the order it recomputes them.
    """

    fw: list[str]
    bw: list[tuple[list[str], str]]
    saved: list[str]
    bw_inputs: list[str]
    recomputed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"fw": self.fw, "bw": [[r, b] for r, b in self.bw], "saved": self.saved,
                "bw_inputs": self.bw_inputs, "recomputed": self.recomputed}

    @classmethod
    def from_json(cls, d: dict) -> "Schedule":
        return cls(fw=list(d["fw"]), bw=[(list(r), b) for r, b in d["bw"]], saved=list(d["saved"]),
                   bw_inputs=list(d["bw_inputs"]), recomputed=list(d["recomputed"]))


@dataclass
class SimResult:
    """The simulated memory of a schedule.

    ``profile[t]`` is the live bytes at step t (forward steps first); ``intervals`` maps each allocated
    value instance ``(owner, "fw" | "rc" | "bw")`` to ``(first_step, last_step, bytes)``.
    """

    peak_bytes: int
    peak_step: int
    profile: list[int]
    intervals: dict[tuple[str, str], tuple[int, int, int]]
    num_fw_steps: int
    recompute_s: float
    recompute_flops: int
    recompute_comm_bytes: int


def _is_getitem(cg: CostGraph, n: str) -> bool:
    return cg.attr(n, "op") == "getitem"


def build_schedule(cg: CostGraph, saved) -> Schedule:
    """Derive the full schedule from a set of saved candidate values.

    Parameters
    ----------
    cg : CostGraph
    saved : iterable of str
        Candidate names (see :attr:`CostGraph.candidates`) to keep from the forward.

    Returns
    -------
    Schedule
        Saved values that backward never reads are dropped from ``saved``.

    Raises
    ------
    PlanCheckError
        If a saved name is not a candidate.
    """
    cand = set(cg.candidates)
    saved_set = set(saved)
    bad = saved_set - cand
    if bad:
        raise PlanCheckError(f"plan saves values that are not forward candidates: {sorted(bad)[:5]}")

    def available(n: str) -> bool:
        return cg.is_available_in_bw(n) or n in saved_set

    recompute: set[str] = set()
    stack = [p for b in cg.bw_order for p in cg.preds(b)]
    while stack:
        n = stack.pop()
        if cg.attr(n, "phase") != "fw" or available(n) or n in recompute:
            continue
        recompute.add(n)
        stack.extend(cg.preds(n))

    emitted: set[str] = set()
    order: list[str] = []

    def emit(n: str, out: list[str]) -> None:
        work = [(n, False)]
        while work:
            cur, expanded = work.pop()
            if cur in emitted or cur not in recompute:
                continue
            if not expanded:
                work.append((cur, True))
                work.extend((p, False) for p in reversed(cg.preds(cur)))
                continue
            emitted.add(cur)
            out.append(cur)
            if cg.attr(cur, "is_tuple"):
                for u in sorted(cg.g.successors(cur), key=lambda x: cg.attr(x, "order")):
                    if u in recompute and _is_getitem(cg, u) and u not in emitted:
                        emitted.add(u)
                        out.append(u)

    bw_steps = []
    for b in cg.bw_order:
        rec: list[str] = []
        for p in cg.preds(b):
            emit(p, rec)
        bw_steps.append((rec, b))
        order.extend(rec)

    bw_inputs: list[str] = []
    seen = set()
    for n in [*order, *cg.bw_order]:
        for p in cg.preds(n):
            ph = cg.attr(p, "phase")
            if p in seen or p in recompute or ph == "bw":
                continue
            if ph == "fw" and not available(p):
                raise PlanCheckError(f"backward needs {p}, which is neither saved nor recomputed")
            seen.add(p)
            bw_inputs.append(p)
    used = set(bw_inputs)
    return Schedule(fw=list(cg.fw_order), bw=bw_steps,
                    saved=[n for n in cg.candidates if n in saved_set and n in used],
                    bw_inputs=bw_inputs, recomputed=order)


def save_all_set(cg: CostGraph) -> list[str]:
    """The candidates backward reads when nothing is recomputed (the no-recompute plan)."""
    return build_schedule(cg, cg.candidates).saved


def simulate(cg: CostGraph, schedule: Schedule) -> SimResult:
    """Simulate the live storage bytes of a schedule, step by step.

    Returns
    -------
    SimResult

    Raises
    ------
    PlanCheckError
        If the schedule reads a value before it exists, or recomputes a node that must not be.
    """
    F = len(schedule.fw)
    end = F + len(schedule.bw) - 1
    recomputed = set(schedule.recomputed)
    saved = set(schedule.saved)
    live: dict[str, tuple[str, str]] = {}          # storage owner -> current instance key
    intervals: dict[tuple[str, str], list[int]] = {}
    sizes: dict[tuple[str, str], int] = {}

    def alloc(owner: str, kind: str, step: int) -> None:
        key = (owner, kind)
        intervals[key] = [step, step]
        sizes[key] = cg.attr(owner, "bytes")
        live[owner] = key

    def use(n: str, step: int, reader: str) -> None:
        owner = cg.storage(n)
        if owner is None or cg.attr(owner, "phase") == "input":
            return
        key = live.get(owner)
        if key is None:
            raise PlanCheckError(f"{reader} at step {step} reads {n} (storage {owner}) before it exists")
        intervals[key][1] = max(intervals[key][1], step)

    def run(n: str, step: int, kind: str) -> None:
        for p in cg.preds(n):
            use(p, step, n)
        if cg.storage(n) == n and cg.attr(n, "bytes") > 0:
            alloc(n, kind, step)

    for i, n in enumerate(schedule.fw):
        run(n, i, "fw")
    # After the forward: what backward can no longer read is dead.
    for owner in list(live):
        if owner not in saved and owner not in cg.held_storages:
            del live[owner]
    for t in cg.tangents:
        if cg.attr(t, "bytes") > 0:
            alloc(t, "bw", F)
    for j, (rec, b) in enumerate(schedule.bw):
        step = F + j
        for r in rec:
            if cg.attr(r, "never_recompute"):
                raise PlanCheckError(f"schedule recomputes {r}: {cg.attr(r, 'reason')}")
            run(r, step, "rc")
        run(b, step, "bw")
    # held to the end: the caller's outputs and the gradients backward returns
    for n in [*cg.fw_outputs, *cg.bw_outputs]:
        if n is None or cg.storage(n) is None:
            continue
        key = live.get(cg.storage(n))
        if key is not None:
            intervals[key][1] = end

    diff = [0] * (end + 2)
    for key, (a, z) in intervals.items():
        diff[a] += sizes[key]
        diff[z + 1] -= sizes[key]
    profile, cur = [], 0
    for t in range(end + 1):
        cur += diff[t]
        profile.append(cur)
    peak = max(profile) if profile else 0
    return SimResult(
        peak_bytes=peak,
        peak_step=profile.index(peak) if profile else 0,
        profile=profile,
        intervals={k: (v[0], v[1], sizes[k]) for k, v in intervals.items()},
        num_fw_steps=F,
        recompute_s=sum(cg.attr(r, "runtime_s") for r in recomputed),
        recompute_flops=sum(cg.attr(r, "flops") for r in recomputed),
        recompute_comm_bytes=sum(cg.attr(r, "comm_bytes") for r in recomputed),
    )
