"""Plans to start CP-SAT from, for a budget below the no-recompute peak.

- the heuristics (:func:`~remat_compiler.solvers.greedy.best_heuristic_set`);
- with 3 or more identical blocks, the block decomposition's bound and plan (:mod:`.blockbound`);
- else the per-block options composed under the budget (:mod:`.blockwise`);
- else CP-SAT on the model with identical blocks tied to the same decisions.

:func:`seed` runs them in that order (under the runtime objective the decomposition first: where its
plan meets its bound the rest are skipped), each on its share of the job's clock, and picks the cheapest;
the composition and the tied blocks end by ``SHARES["end"]`` of it, or are skipped, so the search
that follows keeps its time. Under ``objective="flops"`` a heuristic plan that recomputes no counted
FLOPs is FLOP-optimal, and the block methods are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from remat_compiler.graph import block_boundary_set, block_classes, block_stack
from remat_compiler.schedule import build_schedule, no_recompute, peak_of, save_all_set, simulate
from remat_compiler.solvers.cpsat.blockbound import block_bound
from remat_compiler.solvers.cpsat.blockwise import blockwise_saved_set
from remat_compiler.solvers.cpsat.costs import flop_gap
from remat_compiler.solvers.cpsat.model import build_model, hint
from remat_compiler.solvers.cpsat.run import Job
from remat_compiler.solvers.greedy import best_heuristic_set

__all__ = ["Seed", "seed", "SHARES"]

#: The shares of the time limit T the warm start takes (each also bounded by what is left).
SHARES = {
    "heuristics": 0.3,       # of T: the greedy heuristics
    "decomposition": 0.85,   # of T: the block decomposition's bound and plan...
    "bound": 0.88,           # ...of which the bound's menus and choice, the rest for its fix-up solve
    "composition": 0.3,      # of T, at most COMPOSITION_CAP_S: the per-block composition
    "end": 0.6,              # of T: the composition and the tied blocks end by then, so that the
                             # cost search (until SHARES["search"] of T, see .steps) keeps its share
}
COMPOSITION_CAP_S = 15.0
RECHOICES = 3  # times the decomposition charges a whole overshoot and chooses its blocks again (see decomposition)
#: Before charging a re-choice the whole overshoot, the decomposition tries 1/CHARGE_PARTS of it,
#: 2/CHARGE_PARTS, ...: on Mistral-7B at seq 8192 and 0.3 of the no-recompute peak, the composition
#: overshot by 333 MB in the head's span; charged all of it, the blocks' choice still overshot (78 MB)
#: and the third choice fitted at 2.769e10 FLOPs recomputed, where half of it left the fix-up room
#: for a plan of 2.639e10 (the bound: 2.556e10)
CHARGE_PARTS = 4
MIN_PHASE_S = 0.5  # a phase with less time than this before the warm start's end is skipped


@dataclass
class Seed:
    """A warm start: the cheapest plan found (None if none fits), a proven lower bound on the cost
    from the block decomposition (cost units; None if it did not run), and whether the plan is the
    decomposition's own."""

    saved: set[str] | None = None
    bound: float | None = None  # math.inf: no plan fits
    decomposed: bool = False


def seed(job: Job, *, heuristics: bool, block_reuse: bool, block_reuse_share: float) -> Seed:
    """The warm start for ``job``: the no-recompute plan if it fits, else (``heuristics``) the
    cheapest of the heuristics' and (``block_reuse``) the block methods' plans and the memo's plans
    that fit."""
    cg, budget = job.cg, job.budget_bytes
    all_saved = set(save_all_set(cg))
    T = job.deadline.seconds
    if budget is None or no_recompute(cg).peak_bytes <= budget:
        return Seed(all_saved if job.complies(all_saved) else None)
    if not heuristics:
        return Seed()
    policy = bool(job.forced_saved or job.forbidden_saved)
    blocks = block_reuse and not policy and not job.deterministic
    # identical blocks: the decomposition's bound, and its plan (often optimal); not in deterministic
    # mode (its solves run against the wall clock). Under the runtime objective it runs whatever the
    # heuristics find, so it runs first, and where its plan meets its bound no heuristic plan can be
    # cheaper by more than the search's tolerance: the heuristics are skipped (0.75 s of GPT-2's 7 s
    # solve, 2.2 s under Inductor's decompositions). Under "flops" it runs after them, and not when
    # the heuristic's plan recomputes no counted FLOPs (it is FLOP-optimal already).
    first = blocks and job.objective != "flops"
    found = _decomposed(job) if first else Seed()
    heuristic, free = None, False
    if not (found.decomposed and job.meets(job.cost(found.saved), found.bound)):
        heuristic, _ = best_heuristic_set(cg, budget, job.cost_of,
                                          deadline=job.deadline.part(SHARES["heuristics"] * T))
        free = (job.objective == "flops" and heuristic is not None
                and flop_gap(cg, job.recomputed(heuristic), 0) == 0)
        if blocks and not first and not free:
            found = _decomposed(job)
    composed = tied = None
    # a FLOP-free heuristic plan is FLOP-optimal: the block phases could only lower the tie-break,
    # which the search does from it (at Mistral-7B's size they took 18 s of a 60 s limit for nothing)
    if block_reuse and not free and not found.decomposed and _room(job) >= MIN_PHASE_S:
        composed = composition(job, min(COMPOSITION_CAP_S, SHARES["composition"] * T, _room(job)))
        if composed is None and _room(job) >= MIN_PHASE_S:
            tied = tied_blocks(job, min(T * block_reuse_share, _room(job)), heuristic)
    known = job.memo.fitting(cg, budget, job.complies)
    plans = [w for w in (found.saved, composed, tied, heuristic, *known) if w is not None and job.complies(w)]
    found.saved = set(min(plans, key=job.cost)) if plans else None
    found.decomposed = found.decomposed and found.saved is not None
    return found


def _decomposed(job: Job) -> Seed:
    """The decomposition on its share of the job's clock."""
    return decomposition(job, job.deadline.slice(cap=SHARES["decomposition"] * job.deadline.seconds))


def _room(job: Job) -> float:
    """The time left before the warm start's end (``SHARES["end"]`` of the time limit)."""
    return SHARES["end"] * job.deadline.seconds - job.deadline.elapsed()


def tied_blocks(job: Job, seconds: float, start=None) -> set[str] | None:
    """CP-SAT with identical blocks tied to the same decisions (from ``start``, a saved set), on a
    copy of the job's model (built here if not yet: the search uses it next); None if there are no
    such blocks, or it finds no plan in ``seconds`` (building the model included)."""
    classes = block_classes(job.cg)
    if not classes:
        return None
    clock = job.deadline.part(max(MIN_PHASE_S, seconds))
    full = job.cost_model()
    rm = replace(full, model=full.model.clone())  # the same variables, by index
    for cls in classes:
        first = rm.saved.get(cls[0])
        for v in cls[1:]:
            if first is not None and v in rm.saved:
                rm.model.add(rm.saved[v] == first)
    if clock.left() < MIN_PHASE_S:  # the build took the time
        return None
    if start is not None:
        hint(rm, job.cg, start)
    status, solver = job.solve(rm.model, max(MIN_PHASE_S, clock.left()), deadline=clock,
                               gap_units=job.gap_units(rm.cost_gcd))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {v for v, var in rm.saved.items() if solver.value(var)}


def composition(job: Job, seconds: float) -> set[str] | None:
    """The per-block options composed under the budget (:mod:`.blockwise`), if the graph has at
    least 3 identical blocks."""
    stack = block_stack(job.cg)
    if stack is None or len(stack.blocks) < 3:
        return None
    return blockwise_saved_set(job.cg, job.budget_bytes, block_boundary_set(job.cg), job.cost_of,
                               deadline=job.deadline.part(seconds))


def decomposition(job: Job, seconds: float) -> Seed:
    """The block decomposition's bound (:mod:`.blockbound`) and its plan: the bound's choice of
    block plans, with what lies outside the blocks left to a CP-SAT solve of the full model.

    The composition saves everything outside the blocks, and its fix-up recomputes only there; where
    the choice leaves the blocks too little room for that (GPT-2's loss head at the
    checkpoint-every-block budget: 3 MiB over), the blocks are chosen again under the budget
    lowered by what the composition overshot, from the same menus, up to :data:`RECHOICES` times.
    Before each such re-choice the blocks are chosen under the budget lowered by parts of the
    overshoot (1/:data:`CHARGE_PARTS`, 2/..., while time is left): these choices leave the blocks
    more room, and their fix-ups may fit; the cheapest plan they give is the decomposition's, and
    the whole overshoot is charged only where none gives one. The choice's own fix-up, which fits
    only by recomputing outside the blocks where the composition overshoots, is one of those plans,
    not the answer before them.
    The bound stays the budget's own. Where the composition peaks in the head's span (after the
    blocks' forward, before the head reads a block: GPT-2's logits and their log-softmax beside every
    block's saved values), only the head's window is charged the overshoot: lowering the whole budget
    would take it from every block's backward window too (on GPT-2 traced for Inductor at 89,150,000
    bytes, a plan recomputing 1.07 GFLOP where the head's charge gives one of 0.81)."""
    clock = job.deadline.part(seconds)
    found = block_bound(job.cg, job.budget_bytes, job.cost_of, deadline=clock.part(SHARES["bound"] * seconds),
                        menus=job.memo.menus, cost_key=job.objective, accept=job.meets)
    if found is None:
        return Seed()
    bound = found.bound
    # the bound's own choice leaves the tail room for what its menu keeps in the head's span (the rest
    # recomputed): where its composition fits, it is the plan (Qwen2-7B at seq 4096 and 0.5: of the
    # bound's cost). Else the blocks are chosen as if the tail were free, the head charged what their
    # composition overshoots. The tail's choice gets no fix-up: on Mistral-7B at seq 8192 and 0.3 it
    # overshoots 11.5 MB in a block's window (the attention mask that block's recomputation reads is
    # live there, which the windows' fixed memory leaves out), which nothing outside the blocks mends,
    # and the time its fix-up took left the tail-free choices' fix-ups too little in some runs
    saved = set(found.saved) if found.saved is not None and _fits(job, found.saved) else None
    if saved is None and clock.left() >= MIN_PHASE_S:
        saved = _charged(job, _rechoose(job, clock, job.budget_bytes, 0), clock)
    return Seed(bound=bound) if saved is None else Seed(saved, bound, decomposed=True)


def _charged(job: Job, found, clock) -> set[str] | None:
    """The plan of the choice ``found`` (made as if the tail were free), or of choices made again so
    with parts of, or all of, what its composition overshoots charged (:func:`decomposition`)."""
    target, head_extra = job.budget_bytes, 0
    for attempt in range(RECHOICES + 1):
        if found is None or found.saved is None:
            break
        sim = simulate(job.cg, build_schedule(job.cg, found.saved))
        over = sim.peak_bytes - job.budget_bytes
        # a part of the overshoot leaves the blocks more room (a cheaper choice), and the fix-up may
        # find room outside them for the rest; which part fits is not monotone in the part, nor is
        # what its fix-up costs: the cheapest plan of those found. The choice's own fix-up is one of
        # them: where the composition overshoots, a plan it finds recomputes outside the blocks, which
        # may cost more than a part's choice (Qwen2-7B at seq 4096 and 0.5 of the no-recompute peak:
        # 5.908e9 FLOP units, where half of the 148 MB overshoot charged to the head gives 5.622e9).
        # It runs first, on the whole clock (given a fifth of it, on the slower machine of session 40,
        # it and every part found nothing, and the warm start fell back to a heuristic's plan); the
        # parts share what it leaves, each an equal slice with the whole charge after them (a fix-up
        # that finds nothing runs to its end)
        again = over > 0 and attempt < RECHOICES  # chosen again if nothing fits
        parts = sorted({over * k // CHARGE_PARTS for k in range(1, CHARGE_PARTS)} - {0}) if again else []
        own = set(found.saved) if over <= 0 and job.complies(found.saved) else _fix_up(job, found, clock)
        plans = [] if own is None else [own]
        span = found.head_times
        in_head = span is not None and span[0] <= sim.peak_time <= span[1]
        for i, part in enumerate(parts):
            if clock.left() < MIN_PHASE_S:
                break
            share = clock.part(clock.left() / (len(parts) - i + 1))
            saved = _plan_of(job, _rechoose(job, share, target - (0 if in_head else part),
                                            head_extra + (part if in_head else 0)), share)
            if saved is not None:
                plans.append(saved)
        if plans:
            return min(plans, key=job.cost)
        if not again or clock.left() < MIN_PHASE_S:
            break
        if in_head:
            head_extra += over
        else:
            target -= over
        found = _rechoose(job, clock, target, head_extra)
    return None


def _rechoose(job: Job, clock, target: int, head_extra: int):
    """The bound's choice of block plans again, from the same menus, as if the tail were free, under
    ``target`` with the head's window charged ``head_extra`` more (the tail kept as the tail's menu
    keeps it within that)."""
    return block_bound(job.cg, target, job.cost_of, deadline=clock.part(SHARES["bound"] * clock.left()),
                       menus=job.memo.menus, cost_key=job.objective, accept=job.meets, head_extra=head_extra,
                       tail=False)


def _plan_of(job: Job, found, clock) -> set[str] | None:
    """A plan from the bound's choice ``found``: the composition itself where it fits, else its
    fix-up's; None where neither fits."""
    if found is None or found.saved is None:
        return None
    if _fits(job, found.saved):
        return set(found.saved)  # it recomputes outside the blocks only what the tail's menu drops
    return _fix_up(job, found, clock)


def _fits(job: Job, saved) -> bool:
    return job.complies(saved) and peak_of(job.cg, saved) <= job.budget_bytes


def _fix_up(job: Job, found, clock) -> set[str] | None:
    """The decomposition's choice of block plans fixed, the rest solved by CP-SAT under the budget:
    its saved set, or None where nothing fits (or nothing was found in time)."""
    blocks = found.block_candidates
    rm = build_model(job.cg, job.budget_bytes, objective=job.objective,
                     forced_saved=[v for v in blocks if v in found.saved],
                     forbidden_saved=[v for v in blocks if v not in found.saved])
    hint(rm, job.cg, found.saved)
    status, solver = job.solve(rm.model, max(0.5, clock.left()), deadline=clock, gap_units=job.gap_units(rm.cost_gcd))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    saved = {v for v, var in rm.saved.items() if solver.value(var)}
    return saved if peak_of(job.cg, saved) <= job.budget_bytes else None
