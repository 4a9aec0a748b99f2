"""Each FSDP unit's reshard choice, read off a plan, and the two fixed settings as policies.

In the traced step a unit's all-gather and everything computed from its shards alone (the casts
and copy-in before it, the unsharded parameters cut from the gathered buffer, their views) are
the unit's *parameter values* (:func:`unit_values`). A plan that recomputes the unit's all-gather
in backward frees them after the forward and gathers again (FSDP2's
``reshard_after_forward=True``); one that keeps what backward reads of them does not
(``reshard_after_forward=False``). :func:`record_unit_choices` writes that choice per unit in
``plan.extras["fsdp_units"]`` with why: the same saved set with this unit flipped, simulated, and
its peak and recompute time against the plan's (``plan.explain()`` prints it, the JSON plan has
it). :func:`fixed_reshard` forces one setting on every unit (hard saves / forbidden saves for
CP-SAT), so the joint plan can be compared with the best plan under each fixed setting.

>>> print(m.plan.explain())                                     # doctest: +SKIP
FSDP unit         layers.0: re-gathered in backward (12 KiB sent again); keeping its 48 KiB ...
"""
from __future__ import annotations

import time

from remat_compiler.graph import CostGraph
from remat_compiler.schedule import build_schedule, save_all_set, simulate

__all__ = ["unit_values", "record_unit_choices", "fixed_reshard", "unit_lines", "COMPARE_S"]

#: The ops of a unit's gather: the all-gather, or on gloo the all-to-all it is written as
#: (:mod:`remat_compiler.fsdp.gather`).
_GATHERS = ("all_gather_into_tensor", "all_to_all_single")


def unit_values(cg: CostGraph, num_units_params: list[int]) -> list[dict]:
    """Per unit (in :class:`~remat_compiler.fsdp.step.ShardedStep`'s order, ``num_units_params``
    shards each): its forward all-gather node and its parameter values (forward nodes computed from
    its shards alone).

    Returns
    -------
    list of dict
        ``{"gather": node name or None, "values": set of node names}`` per unit.
    """
    owner: dict[str, int] = {}
    k = 0
    for i, n in enumerate(num_units_params):
        for name in cg.inputs[k:k + n]:
            owner[name] = i
        k += n
    out = [{"gather": None, "values": set()} for _ in num_units_params]
    for n in cg.fw_order:
        if cg.attr(n, "phase") != "fw":
            continue
        units = {owner.get(p, -1) if cg.attr(p, "phase") == "input" else _of(out, p)
                 for p in cg.preds(n)}
        if len(units) != 1 or -1 in units:
            continue
        i = units.pop()
        out[i]["values"].add(n)
        if out[i]["gather"] is None and any(g in str(cg.attr(n, "op")) for g in _GATHERS):
            out[i]["gather"] = n
    return out


def _of(units: list[dict], name: str) -> int:
    for i, u in enumerate(units):
        if name in u["values"]:
            return i
    return -1


def fixed_reshard(cg: CostGraph, values: set[str], reshard_after_forward: bool) -> tuple[list[str], list[str]]:
    """One fixed FSDP2 setting for every unit, as ``(forced_saved, forbidden_saved)`` for
    :func:`~remat_compiler.solvers.cpsat.solve_cpsat` over ``values`` (the union of the units'
    :func:`unit_values`): ``True`` keeps none of them (not the gathered buffer either: backward
    gathers again), ``False`` keeps the unsharded parameters (the storages of the values the
    model reads, whether backward reads them or only recomputes activations from them) and so
    never gathers again; the activations are left to the solver, so each setting gets its best
    activation plan.

    Returns
    -------
    (forced_saved, forbidden_saved) : lists of candidate names
    """
    if reshard_after_forward:
        return [], [v for v in cg.candidates if v in values and not cg.attr(v, "never_recompute")]
    read = {cg.storage(v) for v in values if any(u not in values for u in cg.g.successors(v))}
    return [v for v in cg.candidates if v in read], []


#: Seconds :func:`record_unit_choices` spends simulating flipped choices (one simulation of the whole
#: step per unit); the units past it are recorded without the comparison.
COMPARE_S = 20.0


def record_unit_choices(planned, units, *, compare_s: float = COMPARE_S) -> None:
    """Write each unit's choice and why into ``planned.plan.extras["fsdp_units"]`` (a list, one
    dict per unit in forward order: ``unit``, ``gather`` (its gather's node), ``choice`` ("kept" or
    "re-gathered"), ``unsharded_bytes``, ``regather_comm_bytes``, ``flipped_peak_bytes``,
    ``flipped_recompute_s``, ``why``). The flipped figures come from one simulation per unit, for
    ``compare_s`` seconds at most; past it they are None and ``why`` says so."""
    cg, plan = planned.cg, planned.plan
    per_unit = unit_values(cg, [len(u.params) for u in units])
    saved, recomputed = set(plan.saved), set(plan.recomputed)
    candidates = set(save_all_set(cg))
    records, started = [], time.perf_counter()
    for unit, uv in sorted(zip(units, per_unit), key=lambda x: cg.fw_index.get(x[1]["gather"], 1 << 30)):
        gather = uv["gather"]
        if gather is None:
            continue
        regathered = gather in recomputed
        kept_vals = (candidates & uv["values"])
        if regathered:  # flipped: keep what backward reads of this unit's values
            flipped = (saved - uv["values"]) | kept_vals
        else:
            flipped = saved - uv["values"]
        comm = int(cg.attr(gather, "comm_bytes"))
        unsharded = int(cg.attr(gather, "bytes"))
        record = {"unit": unit.label, "gather": gather, "choice": "re-gathered" if regathered else "kept",
                  "unsharded_bytes": unsharded, "regather_comm_bytes": comm,
                  "flipped_peak_bytes": None, "flipped_recompute_s": None,
                  "why": f"not compared with the other choice (past {compare_s:.0f} s of comparisons)"}
        if time.perf_counter() - started < compare_s:
            sim = simulate(cg, build_schedule(cg, sorted(flipped)))
            record.update(flipped_peak_bytes=sim.peak_bytes, flipped_recompute_s=sim.recompute_s,
                          why=_why(regathered, plan, sim, unsharded, comm))
        records.append(record)
    plan.extras["fsdp_units"] = records


def _why(regathered: bool, plan, flipped, unsharded: int, comm: int) -> str:
    from remat_compiler.budget import human_bytes

    budget = plan.budget_bytes
    if regathered:
        if budget is not None and flipped.peak_bytes > budget:
            return (f"keeping its {human_bytes(unsharded)} gathered to backward would peak at "
                    f"{human_bytes(flipped.peak_bytes)}, above the budget {human_bytes(budget)}; the "
                    f"re-gather sends {human_bytes(comm)} again")
        return (f"keeping it would peak at {human_bytes(flipped.peak_bytes)} with recompute "
                f"{flipped.recompute_s * 1e3:.3f} ms against the plan's {plan.recompute_s * 1e3:.3f} ms "
                f"(solve status {plan.status})")
    if flipped.peak_bytes >= plan.peak_bytes:
        return (f"re-gathering would not lower the peak ({human_bytes(flipped.peak_bytes)}) and would "
                f"send {human_bytes(comm)} again")
    fits = budget is None or plan.peak_bytes <= budget
    return (f"re-gathering would lower the peak to {human_bytes(flipped.peak_bytes)} but send "
            f"{human_bytes(comm)} again (recompute {flipped.recompute_s * 1e3:.3f} ms against "
            f"{plan.recompute_s * 1e3:.3f} ms)" + ("; the budget does not need it" if fits else ""))


def unit_lines(records: list[dict]) -> list[str]:
    """The explain() lines of ``plan.extras["fsdp_units"]``: one per unit, its choice and why."""
    from remat_compiler.budget import human_bytes

    lines = []
    for i, r in enumerate(records):
        what = ("re-gathered in backward (reshard_after_forward=True)" if r["choice"] == "re-gathered"
                else "kept to backward (reshard_after_forward=False)")
        lines.append(f"{'FSDP unit' if i == 0 else '':<17} {r['unit']}: {what}, "
                     f"{human_bytes(r['unsharded_bytes'])} unsharded; {r['why']}")
    return lines
