"""The schedule a plan implies, and an independent liveness simulation of it.

A plan is a set of saved forward values. Everything else follows from one rule, which codegen
implements and this module simulates:

- the forward runs every forward node in order; a value that is not saved is freed after its last
  forward use;
- the backward runs its nodes in order; a forward value it needs that is neither saved nor otherwise
  available (inputs, tangents, outputs the caller holds) is recomputed *just before the first backward
  step that needs it*, together with whatever it needs in turn, in forward order; each value is freed
  after its last use;
- a plan may also name *reruns* ``(v, j)``: a recomputed value whose instance is dropped after its
  last use before backward step ``j`` and recomputed again just before the first step at or after
  ``j`` that needs it (views of it are taken again from the new instance). A value can so be
  recomputed more than once, when holding it between two distant uses costs more memory than
  computing it twice.

Memory is counted per node: each node allocates its output while its inputs are live (a multi-output
op all the outputs it returns; recomputed, also those the plan does not take from it, which live only
while it runs: :func:`recomputed_outputs`), and a value is freed right after its last reader (as fx's generated
code does). Steps group nodes: forward step ``i`` runs the i-th forward node; backward step ``F + j``
runs the recomputations the j-th backward node needs and then that node. Every node run also has a
*time* on one integer axis, which is what the CP-SAT model uses (:func:`bw_time`): forward node ``i``
runs at time ``i``; in backward step ``j`` the recomputation of forward node ``i`` runs at
``F + j*(F+1) + i`` and the backward node at ``F + j*(F+1) + F``. A value is live from the time of the
node that allocates it through the time of its last reader, so the live bytes at a node's time are
exactly what the emitted code holds while that node runs. Parameters and inputs are resident before
the step and not counted; tangents appear at the first backward step; parameter gradients, the caller's
outputs and the gradients autograd passes in (a scalar loss's seed; every output's gradient when the
loss is computed outside) stay live to the end. Memory that code outside the compiled
module allocates (a loss computed outside it) is not part of the plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from remat_compiler.graph import CostGraph
from remat_compiler.errors import PlanCheckError

__all__ = ["Schedule", "SimResult", "build_schedule", "simulate", "save_all_set", "no_recompute", "peak_of",
           "bw_time", "bw_step_of", "rerunnable", "recomputed_outputs"]


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
        Forward nodes that backward recomputes, in the order it recomputes them (a rerun value
        appears once per recomputation).
    rerun : list[tuple[str, int]]
        The reruns that take effect, as (value, backward step where it is recomputed again), sorted.
    """

    fw: list[str]
    bw: list[tuple[list[str], str]]
    saved: list[str]
    bw_inputs: list[str]
    recomputed: list[str] = field(default_factory=list)
    rerun: list[tuple[str, int]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"fw": self.fw, "bw": [[r, b] for r, b in self.bw], "saved": self.saved,
                "bw_inputs": self.bw_inputs, "recomputed": self.recomputed,
                "rerun": [[v, j] for v, j in self.rerun]}

    @classmethod
    def from_json(cls, d: dict) -> "Schedule":
        return cls(fw=list(d["fw"]), bw=[(list(r), b) for r, b in d["bw"]], saved=list(d["saved"]),
                   bw_inputs=list(d["bw_inputs"]), recomputed=list(d["recomputed"]),
                   rerun=[(v, int(j)) for v, j in d.get("rerun", [])])


@dataclass
class SimResult:
    """The simulated memory of a schedule, node by node.

    ``peak_bytes`` is the exact peak of the emitted code, reached while ``peak_node`` runs, at
    ``peak_time`` on the node-level time axis (see the module docstring). Each allocated value
    instance ``(owner, "fw" | "rc" | "rc2"... | "bw")`` (``rcK``: the K-th recomputation of a rerun
    value) has its bytes in ``sizes``, its ``(first, last)`` time in ``times`` and its first and
    last event (index into ``events``) in ``spans``. ``events`` lists each node run with the bytes
    live while it runs.
    """

    peak_bytes: int
    num_fw_steps: int
    recompute_s: float
    recompute_flops: int
    recompute_comm_bytes: int
    sizes: dict[tuple[str, str], int] = field(default_factory=dict)
    events: list[tuple[str, int]] = field(default_factory=list)
    times: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    spans: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    peak_node: str | None = None
    peak_time: int = 0

    def live_at(self, time: int) -> list[tuple[str, str]]:
        """The value instances live at a node-level time (e.g. ``peak_time``)."""
        return [k for k, (a, z) in self.times.items() if a <= time <= z]

    def load_at(self, time: int) -> int:
        """Live bytes at a node-level time."""
        return sum(self.sizes[k] for k in self.live_at(time))


def bw_time(num_fw: int, step, slot=None):
    """Time of a node run in backward step ``step`` (0-based): the recomputation of forward node
    ``slot``, or the backward node itself when ``slot`` is None. Works on ints and CP-SAT expressions.

    >>> bw_time(3, 0, 1), bw_time(3, 0), bw_time(3, 1, 0)
    (4, 6, 7)
    """
    return num_fw + step * (num_fw + 1) + (num_fw if slot is None else slot)


def bw_step_of(num_fw: int, time: int) -> int | None:
    """The backward step (0-based) a node-level time falls in; None for a forward time.

    >>> bw_step_of(3, 6), bw_step_of(3, 7), bw_step_of(3, 2)
    (0, 1, None)
    """
    return None if time < num_fw else (time - num_fw) // (num_fw + 1)


def _is_getitem(cg: CostGraph, n: str) -> bool:
    return cg.attr(n, "op") == "getitem"


def rerunnable(cg: CostGraph, n: str) -> bool:
    """Whether a recomputed value may be recomputed a second time: a single-output op that is safe
    to recompute (a multi-output op's outputs and views go with their op and storage)."""
    a = cg.g.nodes[n]
    return (a["phase"] == "fw" and not a["never_recompute"] and not a["is_tuple"] and a["op"] != "getitem"
            and cg.storage(n) == n and a["bytes"] > 0)


def recomputed_outputs(cg: CostGraph, n: str) -> list[str]:
    """The getitems of multi-output op ``n`` whose storage a recomputation of ``n`` allocates, taken or
    not: the kernel returns them all at once, and those the plan does not take (saved, held by the
    caller, or not needed) live in its result for an instant (fx frees the result after its last
    getitem, which allocates nothing). A getitem that must not be recomputed while its op may be is
    an output the recomputation does not make (a training BatchNorm's running statistics: codegen
    recomputes it as ``no_stats``, which returns the first three outputs only)."""
    nodes = cg.g.nodes
    return [u for u in cg.g.successors(n)
            if nodes[u]["op"] == "getitem" and cg.storage(u) == u and nodes[u]["bytes"] > 0
            and not nodes[u]["never_recompute"]]


def build_schedule(cg: CostGraph, saved, rerun=()) -> Schedule:
    """Derive the full schedule from a set of saved candidate values (and optional reruns).

    Parameters
    ----------
    cg : CostGraph
    saved : iterable of str
        Candidate names (see :attr:`CostGraph.candidates`) to keep from the forward.
    rerun : iterable of (str, int)
        Recomputed values to drop and recompute again from backward step ``j`` on (see the module
        docstring).

    Returns
    -------
    Schedule
        Saved values that backward never reads are dropped from ``saved``, and values that must not
        be recomputed (random, reading a mutated input) but that a recomputation needs are added
        to it; reruns that change
        nothing are dropped from ``rerun``, the others name the step where the value is recomputed
        again.

    Raises
    ------
    PlanCheckError
        If a saved name is not a candidate, or a rerun names a value that is not recomputed, cannot
        be recomputed twice, or a step outside the backward.
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
        if n in cand and cg.attr(n, "never_recompute"):
            saved_set.add(n)  # a recomputation needs it and it cannot be recomputed: it is kept
            continue
        recompute.add(n)
        stack.extend(cg.preds(n))

    # Each backward step recomputes what it needs and nothing earlier steps already made, in forward
    # order (a topological order; it is also the order the CP-SAT model's times assume).
    fw_index = cg.fw_index
    rerun_at: dict[int, set[str]] = {}
    for v, j in rerun:
        if v not in recompute or not rerunnable(cg, v):
            raise PlanCheckError(f"rerun of {v}: only a recomputed single-output op can be recomputed again")
        if not 0 < j < len(cg.bw_order):
            raise PlanCheckError(f"rerun of {v} at backward step {j}: steps are 1..{len(cg.bw_order) - 1}")
        rerun_at.setdefault(int(j), set()).add(v)
    views_of: dict[str, set[str]] = {}
    if rerun_at:
        for n in recompute:
            if cg.storage(n) not in (None, n):
                views_of.setdefault(cg.storage(n), set()).add(n)
    emitted: set[str] = set()
    order: list[str] = []
    bw_steps = []
    dropped: set[str] = set()      # rerun values not yet recomputed again
    effective: list[tuple[str, int]] = []
    for j, b in enumerate(cg.bw_order):
        for v in rerun_at.get(j, ()):
            if v in emitted:
                emitted.discard(v)
                emitted.difference_update(views_of.get(v, ()))
                dropped.add(v)
        rec: list[str] = []
        stack = [p for p in cg.preds(b) if p in recompute and p not in emitted]
        while stack:
            cur = stack.pop()
            if cur in emitted:
                continue
            emitted.add(cur)
            rec.append(cur)
            stack.extend(p for p in cg.preds(cur) if p in recompute and p not in emitted)
            if cg.attr(cur, "is_tuple"):  # a multi-output op's used outputs come with it
                stack.extend(u for u in cg.g.successors(cur)
                             if u in recompute and _is_getitem(cg, u) and u not in emitted)
        rec.sort(key=fw_index.__getitem__)
        for v in dropped.intersection(rec):
            effective.append((v, j))
        dropped.difference_update(rec)
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
                    bw_inputs=bw_inputs, recomputed=order, rerun=sorted(effective))


def save_all_set(cg: CostGraph) -> list[str]:
    """The candidates backward reads when nothing is recomputed (the no-recompute plan)."""
    return build_schedule(cg, cg.candidates).saved


def no_recompute(cg: CostGraph) -> SimResult:
    """The simulation of the no-recompute plan, computed once per graph (kept in ``cg.derived``):
    its peak is what a budget fraction is a fraction of, and its intervals are the life of every
    value no plan changes."""
    if "no_recompute" not in cg.derived:
        cg.derived["no_recompute"] = simulate(cg, build_schedule(cg, save_all_set(cg)))
    return cg.derived["no_recompute"]


def peak_of(cg: CostGraph, saved, rerun=()) -> int:
    """The simulated peak of the plan that saves ``saved`` (and reruns ``rerun``)."""
    return simulate(cg, build_schedule(cg, saved, rerun)).peak_bytes


def simulate(cg: CostGraph, schedule: Schedule) -> SimResult:
    """Simulate the live storage bytes of a schedule, node by node.

    Every node, recomputed or not, allocates its output while its inputs are live, and each value is
    freed right after its last reader, so ``peak_bytes`` is exact for the emitted code; it is what
    the solvers bound (the CP-SAT model reproduces it on the same time axis, see
    :mod:`remat_compiler.solvers.cpsat.model`).

    Returns
    -------
    SimResult

    Raises
    ------
    PlanCheckError
        If the schedule reads a value before it exists, or recomputes a node that must not be.
    """
    return _Simulator(cg, schedule).run()


class _Simulator:
    """One simulation: the value instances live now, and each instance's first and last event and
    time, filled as the schedule's nodes run in order."""

    def __init__(self, cg: CostGraph, schedule: Schedule):
        self.cg, self.schedule = cg, schedule
        self.nodes, self.storage = cg.g.nodes, cg.storages  # looked up once: the loop runs per node
        self.F = len(schedule.fw)
        self.recomputed = set(schedule.recomputed)
        self.live: dict[str, tuple[str, str]] = {}         # storage owner -> current instance
        self.spans: dict[tuple[str, str], list[int]] = {}  # instance -> [first ev, last ev, first t, last t]
        self.sizes: dict[tuple[str, str], int] = {}
        self.order: list[str] = []                          # node runs, one per event
        self.times: list[int] = []                          # each event's time

    def alloc(self, owner: str, kind: str, ev: int, time: int) -> None:
        key = (owner, kind)
        self.spans[key] = [ev, ev, time, time]
        self.sizes[key] = self.nodes[owner]["bytes"]
        self.live[owner] = key

    def use(self, n: str, ev: int, time: int, reader: str) -> None:
        nodes = self.nodes
        owner = self.storage[n]
        if owner is None or nodes[owner]["phase"] == "input" or nodes[owner]["bytes"] == 0:
            return  # resident, or an empty storage (``torch.tensor([])``): nothing to keep alive
        key = self.live.get(owner)
        if key is None:
            raise PlanCheckError(f"{reader} reads {n} (storage {owner}) before it exists")
        span = self.spans[key]
        span[1], span[3] = max(span[1], ev), max(span[3], time)

    def step(self, n: str, kind: str, time: int) -> None:
        """Run node ``n`` (``kind`` "fw", "rc", "rcK" or "bw") at ``time``."""
        cg, nodes, storage = self.cg, self.nodes, self.storage
        ev = len(self.order)
        self.order.append(n)
        self.times.append(time)
        for p in cg.fw_preds(n) if kind == "fw" else cg.preds(n):  # a recomputation reads less
            self.use(p, ev, time, n)
        if storage[n] == n and nodes[n]["bytes"] > 0 and self.live.get(n) != (n, kind):
            self.alloc(n, kind, ev, time)
        if not nodes[n]["is_tuple"]:
            return
        for u in cg.g.successors(n):  # a multi-output op allocates every output it returns at once
            taken = u in self.recomputed if kind.startswith("rc") else nodes[u]["phase"] == nodes[n]["phase"]
            if storage[u] == u and nodes[u]["bytes"] > 0 and nodes[u]["op"] == "getitem" and taken:
                self.alloc(u, kind, ev, time)
        if kind.startswith("rc"):  # and, for an instant, those a recomputation does not take
            for u in recomputed_outputs(cg, n):
                if u not in self.recomputed:
                    key = (u, f"{kind}-transient")
                    self.spans[key] = [ev, ev, time, time]
                    self.sizes[key] = nodes[u]["bytes"]

    def run(self) -> SimResult:
        cg, schedule, F = self.cg, self.schedule, self.F
        for i, n in enumerate(schedule.fw):
            self.step(n, "fw", i)
        for o in cg.fw_outputs:  # the forward's outputs live until it returns
            if o is not None:
                self.use(o, len(self.order) - 1, F - 1, "the forward's output")
        saved = set(schedule.saved)
        for owner in list(self.live):  # after the forward: what backward can no longer read is dead
            if owner not in saved and owner not in cg.held_storages:
                del self.live[owner]
        for t in cg.tangents:
            if cg.attr(t, "bytes") > 0:
                self.alloc(t, "bw", len(self.order), F)  # from the start of backward, before any recompute
        made: dict[str, int] = {}
        for j, (rec, b) in enumerate(schedule.bw):
            for r in rec:
                if cg.attr(r, "never_recompute"):
                    raise PlanCheckError(f"schedule recomputes {r}: {cg.attr(r, 'reason')}")
                made[r] = made.get(r, 0) + 1
                self.step(r, "rc" if made[r] == 1 else f"rc{made[r]}", bw_time(F, j, cg.fw_index[r]))
            self.step(b, "bw", bw_time(F, j))
        self.hold_to_end()
        events = _sweep(((a, z, self.sizes[k]) for k, (a, z, _ta, _tz) in self.spans.items()),
                        len(self.order))
        peak = max(events) if events else 0
        peak_ev = events.index(peak) if events else 0
        return SimResult(
            peak_bytes=peak,
            peak_node=self.order[peak_ev] if self.order else None,
            peak_time=self.times[peak_ev] if self.times else 0,
            sizes=dict(self.sizes),
            times={k: (v[2], v[3]) for k, v in self.spans.items()},
            spans={k: (v[0], v[1]) for k, v in self.spans.items()},
            num_fw_steps=F,
            recompute_s=sum(cg.attr(r, "runtime_s") for r in schedule.recomputed),
            recompute_flops=sum(cg.attr(r, "flops") for r in schedule.recomputed),
            recompute_comm_bytes=sum(cg.attr(r, "comm_bytes") for r in schedule.recomputed),
            events=list(zip(self.order, events)),
        )

    def hold_to_end(self) -> None:
        """Extend to the end what lives through the step: the caller's outputs (unless it drops
        them), the gradients backward returns, and the gradients autograd's engine passes in (it
        holds them until backward returns).

        When the model returns a scalar (its loss), that seed is the only real gradient: AOTAutograd
        makes zeros for the other outputs and frees them after their last use. Otherwise every
        output's gradient is held to the end: right for out.backward(g), whose caller holds g; a
        gradient that a loss computed outside makes (loss_fn(out).backward()) is freed after its last
        use, and the plan is above by its bytes.
        """
        cg = self.cg
        last_ev, last_time = len(self.order) - 1, bw_time(self.F, len(self.schedule.bw) - 1)
        seeds = [t for t in cg.tangents if cg.attr(t, "shape") == ()] or list(cg.tangents)
        held = [o for o in cg.fw_outputs if o is not None and cg.storage(o) in cg.held_storages]
        for n in [*held, *cg.bw_outputs, *seeds]:
            if n is None or cg.storage(n) is None:
                continue
            key = self.live.get(cg.storage(n))
            if key is not None:
                self.spans[key][1], self.spans[key][3] = last_ev, last_time


def _sweep(spans, length: int) -> list[int]:
    """Live bytes at each position, from inclusive (first, last, bytes) spans."""
    diff = [0] * (length + 1)
    for a, z, size in spans:
        diff[a] += size
        diff[z + 1] -= size
    out, cur = [], 0
    for t in range(length):
        cur += diff[t]
        out.append(cur)
    return out
