"""RESULTS.md's tables and the Pareto pictures (the page itself: :mod:`benchmarks.results_page`), from the per-workload result documents of :mod:`benchmarks.bench`.

Everything here reads finished results; text files are written atomically with
:func:`passes.files.atomic_write_text` (re-exported here), pictures with
:func:`remat_compiler.viz.save_figure`.

>>> plot_pareto_measured(result_gpt2, "benchmarks/pareto_gpt2.png")  # doctest: +SKIP
"""
from __future__ import annotations

import os
import textwrap
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat_compiler.passes.files import atomic_write_text
from remat_compiler.tables import note_cell
from remat_compiler.viz import save_figure

from benchmarks.workloads import ISSUE_TARGETS

__all__ = ["TABLE_HEADER", "PEER_STRATEGIES", "atomic_write_text", "format_rows", "check_targets",
           "format_scale", "plot_pareto_measured"]

MIB = float(2 ** 20)
#: The Markdown table header every workload's table starts with.
TABLE_HEADER = ("| workload | strategy | setting | budget (MiB) | measured peak (MiB) | predicted peak (MiB) "
                "| measured / predicted | FLOP ratio | step-time ratio | max abs grad error "
                "| plan / compile (s) | solver status | gap |")
#: Strategies a remat_compiler point is set against (at that strategy's measured peak).
PEER_STRATEGIES = ("eager", "checkpoint", "torch.compile", "moe_origin", "moe_fast", "moe_custom")


def _mib(n) -> str:
    """Bytes as MiB with at least three significant digits (``218.1``, ``60.14``, ``0.283``)."""
    if n is None:
        return "-"
    x = n / MIB
    return f"{x:.1f}" if x >= 100 else f"{x:.2f}" if x >= 10 else f"{x:.3f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _label(row: dict) -> str:
    return row["strategy"] if row["setting"] in ("-", "", None) else f"{row['strategy']} {row['setting']}"


def format_rows(rows: Sequence[dict]) -> str:
    """The rows as a Markdown table under :data:`TABLE_HEADER`; a row without a run shows its reason
    (a long reason as a numbered note under the table)."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    notes: list[str] = []
    for r in rows:
        if r["measured_peak_bytes"] is None:
            cells = [r["workload"], r["strategy"], r["setting"], _mib(r["budget_bytes"]), "-", "-", "-", "-", "-",
                     "-", "-", note_cell(f"{r['status']}: {r['note']}", notes, limit=72), "-"]
        else:
            pred = r["predicted_peak_bytes"]
            ratio = "-" if not pred else f"{r['measured_peak_bytes'] / pred:.3f}"
            status = r["status"] + (f" ({r['note']})" if r["note"] else "")
            cells = [r["workload"], r["strategy"], r["setting"], _mib(r["budget_bytes"]),
                     _mib(r["measured_peak_bytes"]), _mib(pred), ratio, _num(r["flop_ratio"], ".3f"),
                     _num(r["step_ratio"], ".2f"), _num(r["max_grad_error"], ".1e"), _num(r["prepare_s"], ".1f"),
                     status, "-" if r["gap"] is None else f"{r['gap']:.1%}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines + ([""] + notes if notes else []))


def check_targets(result: dict) -> list[str]:
    """The issue's targets, checked on one workload's rows: one Markdown bullet each.

    - at every peer's measured peak, remat_compiler's measured peak <= it with a FLOP ratio <= the peer's;
    - monotone: a smaller budget never gives a larger measured peak;
    - predicted peak within 5% of measured, and measured <= budget, on every remat_compiler row;
    - the lowest measured peak, against checkpointing every block, and the best FLOP ratio at or
      below checkpointing's peak.
    """
    rows = result["rows"]
    remat = [r for r in rows if r["strategy"] == "remat_compiler"]
    ran = [r for r in remat if r["measured_peak_bytes"] is not None]
    out = []
    for peer in (r for r in rows if r["strategy"] in PEER_STRATEGIES and r["measured_peak_bytes"] is not None):
        name = _label(peer)
        match = next((r for r in remat if r["budget_bytes"] == peer["measured_peak_bytes"]
                      and name in r["setting"]), None)
        if match is None:
            out.append(f"- at {name}'s peak ({_mib(peer['measured_peak_bytes'])} MiB): no remat_compiler point")
        elif match["measured_peak_bytes"] is None:
            out.append(f"- at {name}'s peak ({_mib(peer['measured_peak_bytes'])} MiB): **not met**, "
                       f"{match['status']}: {match['note']}")
        else:
            fits = match["measured_peak_bytes"] <= match["budget_bytes"]
            cheaper = match["flop_ratio"] <= peer["flop_ratio"] + 1e-12
            verdict = "met" if fits and cheaper else "**not met**"
            out.append(f"- at {name}'s peak ({_mib(peer['measured_peak_bytes'])} MiB, FLOP ratio "
                       f"{peer['flop_ratio']:.3f}): {verdict}, remat_compiler measured "
                       f"{_mib(match['measured_peak_bytes'])} MiB at FLOP ratio {match['flop_ratio']:.3f}")
    by_budget = sorted(ran, key=lambda r: r["budget_bytes"])
    breaks = [(a, b) for a, b in zip(by_budget, by_budget[1:])
              if a["measured_peak_bytes"] > b["measured_peak_bytes"]]
    out.append("- monotone (smaller budget never a larger measured peak): " + (
        "met" if not breaks else "**not met**: " + "; ".join(
            f"budget {_mib(a['budget_bytes'])} MiB measured {_mib(a['measured_peak_bytes'])} MiB > budget "
            f"{_mib(b['budget_bytes'])} MiB measured {_mib(b['measured_peak_bytes'])} MiB" for a, b in breaks)))
    planned = [r for r in rows if r["predicted_peak_bytes"] and r["measured_peak_bytes"] is not None]
    if planned:
        worst = max(planned, key=lambda r: abs(r["measured_peak_bytes"] / r["predicted_peak_bytes"] - 1))
        dev = worst["measured_peak_bytes"] / worst["predicted_peak_bytes"] - 1
        out.append(f"- predicted peak within 5% of measured on every planned row: "
                   f"{'met' if abs(dev) <= 0.05 else '**not met**'} (worst {dev:+.1%}, {_label(worst)})")
    over = [r for r in ran if r["measured_peak_bytes"] > r["budget_bytes"]]
    out.append("- measured peak <= budget on every remat_compiler row: " + (
        "met" if not over else "**not met**: " + ", ".join(_label(r) for r in over)))
    issue = ISSUE_TARGETS.get(result["workload"]) if not result.get("quick") else None
    if issue and ran:
        low = min(r["measured_peak_bytes"] for r in ran)
        out.append(f"- lowest remat_compiler measured peak <= {issue['lowest_peak_mib']:g} MiB (issue target): "
                   f"{'met' if low <= issue['lowest_peak_mib'] * MIB else '**not met**'}, {_mib(low)} MiB")
        small = [r for r in ran if r["measured_peak_bytes"] <= issue["flop_target_peak_mib"] * MIB]
        best = min(small, key=lambda r: r["flop_ratio"]) if small else None
        out.append(f"- FLOP ratio <= {issue['flop_target']:.2f} at a measured peak <= "
                   f"{issue['flop_target_peak_mib']:g} MiB (issue target): " + (
                       "**not met**, no remat_compiler point at or below that peak" if best is None else
                       f"{'met' if best['flop_ratio'] <= issue['flop_target'] else '**not met**'}, best "
                       f"{best['flop_ratio']:.3f} at {_mib(best['measured_peak_bytes'])} MiB"))
    out += _fast_less_y_targets(rows, remat)
    ckpt = next((r for r in rows if r["strategy"] == "checkpoint" and r["measured_peak_bytes"]), None)
    if ran and ckpt:
        low = min(ran, key=lambda r: r["measured_peak_bytes"])
        below = 1 - low["measured_peak_bytes"] / ckpt["measured_peak_bytes"]
        out.append(f"- lowest remat_compiler measured peak: {_mib(low['measured_peak_bytes'])} MiB, "
                   f"{abs(below):.1%} {'below' if below >= 0 else 'above'} checkpoint every block "
                   f"({_mib(ckpt['measured_peak_bytes'])} MiB)")
        under = [r for r in ran if r["measured_peak_bytes"] <= ckpt["measured_peak_bytes"]]
        if under:
            best = min(under, key=lambda r: r["flop_ratio"])
            out.append(f"- best remat_compiler FLOP ratio at or below checkpoint every block's peak: "
                       f"{best['flop_ratio']:.3f} ({_label(best)}; checkpoint: {ckpt['flop_ratio']:.3f})")
        else:
            out.append("- no remat_compiler point at or below checkpoint every block's peak")
    return out


def _fast_less_y_targets(rows: Sequence[dict], remat: Sequence[dict]) -> list[str]:
    """Issue 16: at moe_fast's measured peak minus every layer's y, a plan that recomputes no GEMM, by
    ``moe_cpsat`` (fused custom backward) and by ``remat_compiler`` (autograd graph). "No GEMM
    recomputed" is a FLOP ratio no higher than the strategy's own no-recompute graph's: moe_custom's
    for moe_cpsat (its d(probs) is a counted batched row dot product, ``1 + 1/(9H)`` of the step),
    moe_fast's (1.000) for remat_compiler."""
    ratio = {r["strategy"]: r["flop_ratio"] for r in rows
             if r["strategy"] in ("moe_fast", "moe_custom") and r["measured_peak_bytes"] is not None}
    out = []
    for mc in (r for r in rows if r["strategy"] == "moe_cpsat"):
        budget = mc["budget_bytes"]
        found = []
        for r in [mc, *(r for r in remat if r["budget_bytes"] == budget)]:
            if r["measured_peak_bytes"] is None:
                found.append(f"{r['strategy']} {r['status']}: {r['note']}")
                continue
            ref = ratio.get("moe_custom" if r["strategy"] == "moe_cpsat" else "moe_fast", 1.0)
            ok = r["measured_peak_bytes"] <= budget and r["flop_ratio"] <= ref + 1e-12
            found.append(f"{r['strategy']} {'met' if ok else '**not met**'}, measured "
                         f"{_mib(r['measured_peak_bytes'])} MiB at FLOP ratio {r['flop_ratio']:.4f} "
                         f"(no recompute: {ref:.4f})")
        out.append(f"- at moe_fast's peak minus every layer's y ({_mib(budget)} MiB), no GEMM recomputed "
                   f"(issue 16): " + "; ".join(found))
    return out


def format_scale(doc: dict) -> str:
    """The plan-time table (Markdown) of a :func:`benchmarks.scale.bench_plan_scale` document."""
    mib = float(2 ** 20)
    lines = ["| layers | graph nodes | trace + analyse (s) | budget | budget (MiB) | CP-SAT time limit (s) "
             "| plan time (s) | status | FLOP gap | objective gap <= 1% after (s) | tie-break gap "
             "| predicted peak (MiB) | recompute FLOP overhead | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["status"] == "infeasible":
            tail = ["infeasible", "-", "-", "-", "-", r["note"], f"**not met** (<= {r['target_s']:g} s)"]
        else:
            in_time = r["solve_s"] <= r["target_s"]
            met = in_time and (r["status"] == "optimal" or r["gap"] <= 0.01)
            tb = r.get("tiebreak_gap")
            verdict = f"{'met' if met else '**not met**'} (<= {r['target_s']:g} s, gap <= 1%)"
            tail = [r["status"], f"{r['gap']:.2%}", "-" if r["to_1pct_s"] is None else f"{r['to_1pct_s']:.1f}",
                    "-" if tb is None else f"{tb:.2%}",
                    f"{r['predicted_peak_bytes'] / mib:.1f}", f"{r['flop_overhead']:.1%}", verdict]
        lines.append("| " + " | ".join([str(r["layers"]), str(r["nodes"]), f"{r['trace_s']:.1f}", r["budget_name"],
                                        f"{r['budget_bytes'] / mib:.1f}", f"{r['time_limit_s']:g}",
                                        f"{r['solve_s']:.1f}", *tail]) + " |")
    return "\n".join(lines)


def _figure() -> Figure:
    fig = Figure(figsize=(8.5, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_pareto_measured(result: dict, path: str | os.PathLike) -> str:
    """Measured peak (x) against FLOP ratio (y) for every strategy of one workload, on the same axes.

    remat_compiler's points and PyTorch's planner's points are joined in budget order; the other
    strategies are single markers.

    Raises
    ------
    ValueError
        If no row has a measured peak.
    """
    rows = [r for r in result["rows"] if r["measured_peak_bytes"] is not None]
    if not rows:
        raise ValueError(f"no measured point to draw for {result['workload']}")
    fig = _figure()
    ax = fig.add_subplot()
    families = {
        "remat_compiler": dict(marker="o", color="C0", key=lambda r: r["measured_peak_bytes"]),
        "torch.compile": dict(marker="s", color="C3", key=lambda r: -float(r["setting"].split()[-1])),
    }
    for name, style in families.items():
        pts = sorted((r for r in rows if r["strategy"] == name), key=style["key"])
        if not pts:
            continue
        ax.plot([r["measured_peak_bytes"] / MIB for r in pts], [r["flop_ratio"] for r in pts],
                marker=style["marker"], color=style["color"], linewidth=1.4, markersize=6,
                label=name if name == "remat_compiler" else "torch.compile (activation_memory_budget)")
        if name == "torch.compile":
            for r in pts:
                ax.annotate(r["setting"].split()[-1], (r["measured_peak_bytes"] / MIB, r["flop_ratio"]),
                            textcoords="offset points", xytext=(5, -10), fontsize=8, color="C3")
    singles = [r for r in rows if r["strategy"] not in families]
    for i, r in enumerate(singles):
        ax.scatter([r["measured_peak_bytes"] / MIB], [r["flop_ratio"]], s=80, zorder=4,
                   marker="*DP^vXh"[i % 7], color=f"C{(4 + i) % 10}", label=_label(r))
    ax.set_xlabel("measured step peak (MiB)")
    ax.set_ylabel("FLOP ratio to no recompute")
    ax.set_title("\n".join(textwrap.wrap(f"{result['workload']}: {result['description']}", 100)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
