"""Plan: what a solver decided (what is saved, what is recomputed and where), and what it costs.

A Plan is plain data: it can be printed (:meth:`Plan.explain`), written as JSON and read back
(:meth:`Plan.to_json`, :meth:`Plan.from_json`), and checked by :func:`remat_compiler.check.check_plan`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

from remat_compiler.budget import human_bytes
from remat_compiler.eager_paths import CHECKPOINT_NOTE
from remat_compiler.graph import CostGraph
from remat_compiler.errors import PlanMismatchError
from remat_compiler.passes.files import atomic_write_text
from remat_compiler.schedule import Schedule, build_schedule, save_all_set, simulate

__all__ = ["Plan", "ValueInfo", "make_plan", "moe_combine_of", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2  # 2: reruns (version 1 documents, which have none, are still read)


@dataclass
class ValueInfo:
    """One saved or recomputed value, for tables and JSON."""

    name: str
    op: str
    shape: list[int] | None
    dtype: str | None
    bytes: int
    flops: int
    runtime_s: float
    decision: str  # "saved" | "recomputed"
    reason: str
    module: str = ""


#: Substrings of a collective's op name and how explain() names it.
_COLLECTIVE_LABELS = (("all_to_all", "all-to-all"), ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter"))


@dataclass
class Plan:
    """A recomputation plan for one traced graph and one budget.

    Attributes
    ----------
    budget_bytes : int | None
        The budget the plan was made for (None: unlimited).
    peak_bytes : int
        Predicted peak of the step above what was resident before it (the simulator's number).
    baseline_peak_bytes : int
        The no-recompute (save-all) plan's peak.
    saved, recomputed : list[str]
        Saved forward values; forward nodes recomputed in backward (in recompute order; a value
        recomputed more than once appears once per recomputation).
    rerun : list[tuple[str, int]]
        Recomputed values dropped between two uses and recomputed again at a backward step (see
        :mod:`remat_compiler.schedule`); part of the plan's decision with ``saved``.
    recompute_flops, baseline_flops : int
        FLOPs recomputed; FLOPs of the step without recomputation (forward + backward).
    recompute_s, baseline_s : float
        The same as roofline runtime estimates (communication included).
    recompute_comm_bytes : int
        Collective bytes sent again because of recomputation.
    solver, status, gap, solve_time_s :
        Who made it; "optimal" or "feasible"; proven relative gap of the cost (0 when optimal);
        wall time of the solve.
    model_peak_bytes : int
        The solver's own claim on the peak (CP-SAT: its model's node-level peak, >= peak_bytes).
    min_feasible_bytes : int | None
        The smallest peak any plan reaches on this graph, when the solver computed it.
    fingerprint : str
        The traced graph's fingerprint; a plan applies only to a graph with the same one.
    schedule : Schedule
        The full schedule codegen emits.
    values : list[ValueInfo]
        Every saved and recomputed value with its costs and the reason for the decision.
    """

    budget_bytes: int | None
    peak_bytes: int
    baseline_peak_bytes: int
    saved: list[str]
    recomputed: list[str]
    recompute_flops: int
    baseline_flops: int
    recompute_s: float
    baseline_s: float
    recompute_comm_bytes: int
    solver: str
    status: str
    gap: float
    solve_time_s: float
    model_peak_bytes: int
    fingerprint: str
    schedule: Schedule
    values: list[ValueInfo] = field(default_factory=list)
    min_feasible_bytes: int | None = None
    extras: dict = field(default_factory=dict)
    rerun: list = field(default_factory=list)

    # ------------------------------------------------------------------ derived
    @property
    def flop_overhead(self) -> float:
        """Recomputed FLOPs as a fraction of the step's FLOPs (0.1 = 10% more)."""
        return self.recompute_flops / self.baseline_flops if self.baseline_flops else 0.0

    @property
    def runtime_overhead(self) -> float:
        return self.recompute_s / self.baseline_s if self.baseline_s else 0.0

    @property
    def saved_bytes(self) -> int:
        return sum(v.bytes for v in self.values if v.decision == "saved")

    def digest(self) -> str:
        """A hash of the whole plan document (the one :meth:`to_json` writes and checks on reading)."""
        return _document_digest(self._document())

    def _document(self) -> dict:
        d = asdict(self)
        d["schedule"] = self.schedule.to_json()
        return json.loads(json.dumps(d))  # JSON types (tuples become lists) before hashing

    # ------------------------------------------------------------------ people
    def _collectives_again(self) -> str:
        """The kinds of collective the plan runs again ("all-gather" for FSDP units gathered again
        before their backward, "all-to-all" for recomputed MoE dispatches), for explain's totals.
        An FSDP unit's gather (``extras["fsdp_units"]``' ``gather`` node) is an all-gather whatever
        op runs it (on gloo an all-to-all, :mod:`remat_compiler.fsdp.gather`)."""
        gathers = {r.get("gather") for r in self.extras.get("fsdp_units", ())}
        kinds = set()
        for v in self.values:
            if v.decision == "recomputed":
                kinds |= {"all-gather"} if v.name in gathers else \
                    {label for key, label in _COLLECTIVE_LABELS if key in v.op}
        return " and ".join(sorted(kinds)) or "collectives"

    def explain(self, max_rows: int = 40) -> str:
        """A table of what is saved and recomputed and why, with totals.

        Example
        -------
        >>> print(plan.explain())  # doctest: +SKIP
        """
        head = [
            f"plan by {self.solver}: {self.status}"
            + (f" (gap {self.gap:.2%})" if self.status != "optimal" else "")
            + (f", stopped within {self.extras['tolerance']:.0%} of the step's estimated cost of the best "
               f"(tolerance)" if self.status != "optimal" and self.extras.get("tolerance") else "")
            + f", solved in {self.solve_time_s:.2f} s",
            f"budget            {human_bytes(self.budget_bytes) if self.budget_bytes else 'unlimited'}",
            f"predicted peak    {human_bytes(self.peak_bytes)}  ({self.peak_bytes} bytes)",
            f"no-recompute peak {human_bytes(self.baseline_peak_bytes)}",
            f"recompute         {len(self.recomputed)} nodes, {self.recompute_flops:,} FLOPs "
            f"({self.flop_overhead:.1%} of the step), est. {self.recompute_s * 1e3:.3f} ms "
            f"({self.runtime_overhead:.1%})"
            + (f", {human_bytes(self.recompute_comm_bytes)} {self._collectives_again()} again"
               if self.recompute_comm_bytes else ""),
            f"saved             {len([v for v in self.values if v.decision == 'saved'])} values, "
            f"{human_bytes(self.saved_bytes)}",
        ]
        if self.extras.get("device", "cpu") != "cpu":
            traced = self.extras.get("traced_on")
            rates = (self.extras.get("cost_model") or {}).get("name")
            head.append(f"device            {self.extras['device']}"
                        + (f", bytes in {self.extras['allocator']} allocator blocks" if self.extras.get("allocator")
                           and self.extras["allocator"] != "exact" else "")
                        + (f", runtimes for {rates}" if rates else "")
                        + (f" (traced on {traced})" if traced else ""))
        if self.extras.get("memory_model"):  # made on a view of the graph (remat_compiler.fusion)
            head.append(f"for Inductor      planned on the memory of Inductor's code: {self.extras['inlined']} values "
                        f"its kernels compute where they are read cost no bytes, and backward recomputes those "
                        f"it reads (remat_compiler.fusion); fraction budgets are of the no-recompute peak of the "
                        f"step run op by op ({human_bytes(self.extras['fraction_base_bytes'])})")
        fused = self.extras.get("inductor_fused_recompute")
        if fused:
            head.append(f"for Inductor      {len(fused)} pointwise values recomputed, not saved: their readers are "
                        f"all pointwise, so Inductor fuses them (remat_compiler.fusion)")
        for i, note in enumerate(self.extras.get("trace_notes") or ()):
            head.append(f"{'traced as eager' if i == 0 else '':<17} {note}")
        if any(n.startswith(CHECKPOINT_NOTE) for n in self.extras.get("trace_notes") or ()):
            head.append(f"{'fraction budgets':<17} are of the no-recompute peak above "
                        f"({human_bytes(self.baseline_peak_bytes)}): the step without the model's own checkpointing")
        head += _combine_lines(self.extras.get("moe_combine") or {})
        if self.extras.get("fsdp_units"):
            from remat_compiler.fsdp.choices import unit_lines
            head += unit_lines(self.extras["fsdp_units"])
        if self.rerun:
            head.append(f"recomputed again  {len(self.rerun)} times: "
                        + ", ".join(f"{v} at backward step {j}" for v, j in self.rerun[:6])
                        + (" ..." if len(self.rerun) > 6 else ""))
        rows = [("name", "op", "shape", "bytes", "FLOPs", "decision", "reason")]
        ordered = sorted(self.values, key=lambda v: (v.decision != "saved", -v.bytes))
        for v in ordered[:max_rows]:
            rows.append((v.name, v.op.replace("aten.", ""), "x".join(map(str, v.shape or [])) or "-",
                         human_bytes(v.bytes), f"{v.flops:,}", v.decision, v.reason))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if len(ordered) > max_rows:
            lines.append(f"... {len(ordered) - max_rows} more rows (to_json() has them all)")
        return "\n".join(head + [""] + lines)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        """The plan as a JSON document with a schema version."""
        d = self._document()
        d["digest"] = _document_digest(d)
        d["schema_version"] = SCHEMA_VERSION
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Read a plan written by :meth:`to_json`.

        Raises
        ------
        ValueError
            If the text is not a plan document, has another schema version, or its digest does
            not match its content (a corrupt or edited file).
        """
        if not isinstance(text, (str, bytes, bytearray)):
            raise ValueError(f"not a plan: expected the JSON text Plan.to_json writes, got "
                             f"{type(text).__name__}")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a plan: invalid JSON ({exc})") from exc
        if not isinstance(d, dict) or "schema_version" not in d:
            raise ValueError("not a plan document: no schema_version")
        if type(d["schema_version"]) is not int or d["schema_version"] not in (1, SCHEMA_VERSION):
            raise ValueError(f"plan schema version {d['schema_version']!r} is not supported "
                             f"(this remat_compiler reads version {SCHEMA_VERSION}); re-plan the model")
        digest = d.pop("digest", None)
        d.pop("schema_version")
        if digest != _document_digest(d):
            raise ValueError("plan document is corrupt: its digest does not match its content")
        try:
            d["schedule"] = Schedule.from_json(d["schedule"])
            d["values"] = [ValueInfo(**v) for v in d["values"]]
            d["rerun"] = [(v, int(j)) for v, j in d.get("rerun", [])]
            return cls(**d)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"not a plan document: {exc!r}") from exc

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON atomically (a temporary file in the same folder, then a rename)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def check_applies_to(self, cg: CostGraph) -> None:
        """Raise PlanMismatchError unless this plan was made for ``cg``'s graph."""
        if self.fingerprint != cg.fingerprint:
            made_for = (self.extras.get("device"), self.extras.get("allocator"))
            runs_on = (cg.device, cg.allocator)
            if made_for[1] is not None and made_for != runs_on:
                raise PlanMismatchError(
                    f"this plan was made for {made_for[0]} (bytes as the {made_for[1]} allocator charges "
                    f"them), but the model runs on {runs_on[0]} ({runs_on[1]}): re-plan for this device "
                    f"(plan_model(..., device={runs_on[0]!r}), or a cost_model preset for it)")
            made_in = self.extras.get("memory_model")
            runs_in = cg.g.graph.get("memory_model")
            if made_in != runs_in:
                raise PlanMismatchError(
                    f"this plan was made for the memory of {made_in or 'the eager'} backend's code, but it is "
                    f"applied to {runs_in or 'the eager'} backend's (backend='inductor' plans on a graph "
                    f"whose fused values cost no bytes): apply it with backend={made_in or 'eager'!r}, "
                    f"or re-plan for this backend")
            raise PlanMismatchError(
                f"this plan was made for graph {self.fingerprint}, but the model traces to graph "
                f"{cg.fingerprint}: a plan applies only to the same model, input shapes and dtypes; "
                f"re-plan with this model")


def _document_digest(d: dict) -> str:
    """A hash of a plan document's whole content (without its digest and schema version)."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _reason_saved(cg: CostGraph, n: str) -> str:
    a = cg.g.nodes[n]
    if a["never_recompute"]:
        return f"must save: {a['reason']}"
    if a["runtime_s"] > 0 and a["bytes"] > 0:
        return f"recompute would cost {a['runtime_s'] * 1e6:.1f} us for {human_bytes(a['bytes'])}"
    return "backward reads it"


def _reason_recomputed(cg: CostGraph, n: str) -> str:
    a = cg.g.nodes[n]
    if a["bytes"] == 0:
        return "free: view or multi-output op" if a["runtime_s"] == 0 else "needed for a recomputed value"
    return f"frees {human_bytes(a['bytes'])} between forward and first use for {a['runtime_s'] * 1e6:.1f} us"


def moe_combine_of(cg: CostGraph) -> dict[str, dict]:
    """How each MoE segment of ``cg`` was traced: its combine.

    Returns
    -------
    dict
        ``{segment: {"mode": "fused" | "autograd", "y_bytes": int}}`` for every segment
        :mod:`remat_compiler.passes.moe` tagged (an :class:`~remat_compiler.moe.MoELayer` or a transformers MoE
        block; empty for other graphs): ``"fused"`` when the segment's GEMM2 -> A2A -> Unpermute
        ran as one :class:`~remat_compiler.moe.FusedCombine` (an HF block's down projection and
        combine as one :class:`~remat_compiler.moe.hf.GroupedFusedCombine`), and ``y_bytes`` the
        bytes of its GEMM2 output y (what the autograd combine keeps for d(probs) and the fused
        one never stores). A plan records it (``plan.extras["moe_combine"]``) so that applying the
        plan traces every segment with the combine it was made for
        (:meth:`remat_compiler.pipeline.PlanSpec.prepared`).
    """
    found: dict[str, dict] = {}
    for n in cg.fw_order:
        tag = cg.attr(n, "moe")
        if not tag:
            continue
        seg = found.setdefault(tag["segment"], {"mode": "autograd", "y_bytes": 0})
        if tag.get("fused"):
            seg["mode"] = "fused"
        if tag.get("role") == "gemm2":
            seg["y_bytes"] = max(seg["y_bytes"], cg.attr(n, "bytes"))
    return found


def _combine_lines(combine: dict) -> list[str]:
    """The explain() lines naming each MoE segment's combine and why it stores y or not."""
    lines = []
    for i, (seg, c) in enumerate(sorted(combine.items())):
        y = human_bytes(c.get("y_bytes", 0))
        if c.get("mode") == "fused":
            why = (f"fused: y never stored ({y}); its backward reads the SwiGLU output, W2 and probs "
                   f"(remat::combine_dgrad, an HF block's remat::grouped_combine_dgrad)")
        else:
            why = f"autograd: y ({y}) kept or recomputed for d(probs)" + (
                "" if c.get("why") else " (solver='moe_cpsat' plans this segment with the fused combine)")
        lines.append(f"{'MoE combine' if i == 0 else '':<17} {seg or '(model)'}: {why}"
                     + (f"; {c['why']}" if c.get("why") else ""))
    return lines


def make_plan(cg: CostGraph, saved, *, budget_bytes: int | None, solver: str, status: str = "optimal",
              gap: float = 0.0, solve_time_s: float = 0.0, model_peak_bytes: int | None = None,
              min_feasible_bytes: int | None = None, baseline_peak_bytes: int | None = None,
              extras: dict | None = None, rerun=()) -> Plan:
    """Build a Plan from a saved set (and reruns): derive the schedule and simulate its memory and cost.

    ``extras`` gains the graph's ``device`` and, where the graph records one, its ``cost_model``
    (the rates its runtimes come from: :class:`remat_compiler.PlanSpec` re-costs a graph a given
    plan is applied to with them, so a plan for an H200 applies as it was made)."""
    facts = {"device": cg.device, "allocator": cg.allocator}
    if cg.g.graph.get("traced_on"):
        facts["traced_on"] = cg.g.graph["traced_on"]
    if cg.g.graph.get("trace_notes"):
        facts["trace_notes"] = list(cg.g.graph["trace_notes"])
    if cg.g.graph.get("cost_model") is not None:
        facts["cost_model"] = dict(cg.g.graph["cost_model"])
    if cg.g.graph.get("memory_model"):  # a view of the graph as traced (remat_compiler.fusion.inductor_view)
        facts.update(memory_model=cg.g.graph["memory_model"], inlined=cg.g.graph["inlined"],
                     fraction_base_bytes=cg.g.graph["fraction_base_bytes"])
    combine = moe_combine_of(cg)
    if combine:
        facts["moe_combine"] = combine
    extras = {**facts, **(extras or {})}
    schedule = build_schedule(cg, saved, rerun)
    sim = simulate(cg, schedule)
    if baseline_peak_bytes is None:
        baseline_peak_bytes = simulate(cg, build_schedule(cg, save_all_set(cg))).peak_bytes
    step_nodes = [*cg.fw_order, *cg.bw_order]
    values = []
    for n in schedule.saved:
        a = cg.g.nodes[n]
        values.append(ValueInfo(n, a["op"], list(a["shape"]) if a["shape"] else None, a["dtype"],
                                a["bytes"], a["flops"], a["runtime_s"], "saved", _reason_saved(cg, n),
                                a["module"]))
    for n in dict.fromkeys(schedule.recomputed):
        a = cg.g.nodes[n]
        values.append(ValueInfo(n, a["op"], list(a["shape"]) if a["shape"] else None, a["dtype"],
                                a["bytes"], a["flops"], a["runtime_s"], "recomputed",
                                _reason_recomputed(cg, n), a["module"]))
    return Plan(
        budget_bytes=budget_bytes,
        peak_bytes=sim.peak_bytes,
        baseline_peak_bytes=baseline_peak_bytes,
        saved=list(schedule.saved),
        recomputed=list(schedule.recomputed),
        recompute_flops=sim.recompute_flops,
        baseline_flops=sum(cg.attr(n, "flops") for n in step_nodes),
        recompute_s=sim.recompute_s,
        baseline_s=sum(cg.attr(n, "runtime_s") for n in step_nodes),
        recompute_comm_bytes=sim.recompute_comm_bytes,
        solver=solver,
        status=status,
        gap=gap,
        solve_time_s=solve_time_s,
        model_peak_bytes=sim.peak_bytes if model_peak_bytes is None else model_peak_bytes,
        fingerprint=cg.fingerprint,
        schedule=schedule,
        values=values,
        min_feasible_bytes=min_feasible_bytes,
        extras=dict(extras or {}),
        rerun=list(schedule.rerun),
    )
