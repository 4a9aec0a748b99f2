"""Pictures of plans: memory timelines, Pareto curves and DOT graphs (text tables are in ``tables.py``).

Plotting stays out of the solver path: everything here reads finished plans. Figures are drawn with
matplotlib's object API on the Agg canvas (no pyplot, no global backend switch) and written
atomically: a temporary file in the destination folder, then a rename.

>>> plot_timeline(cg, {"cpsat": plan, "save_all": base}, plan.budget_bytes, "timeline.png")  # doctest: +SKIP
>>> print(plan_to_dot(cg, plan))                                                          # doctest: +SKIP
"""
from __future__ import annotations

import os
from typing import Protocol, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat_compiler.budget import human_bytes
from remat_compiler.passes.files import atomic_write
from remat_compiler.graph import CostGraph
from remat_compiler.plan import Plan
from remat_compiler.schedule import build_schedule, simulate

__all__ = ["plot_timeline", "plot_pareto", "PointLike", "plan_to_dot", "node_decisions", "save_figure",
           "DOT_COLORS"]

_MIB = float(2**20)

#: Fill colour of each node class in :func:`plan_to_dot`.
DOT_COLORS = {
    "saved": "#6baed6",        # kept from the forward for backward
    "recomputed": "#fd8d3c",   # recomputed just before its first backward use
    "dropped": "#ffffff",      # freed after its last forward use; backward never needs it
    "forward": "#ffffcc",      # other forward nodes: views, held outputs, free ops
    "input": "#c7e9c0",        # parameters, inputs and tangents
    "backward": "#d9d9d9",
}


# ---------------------------------------------------------------------------- files
def save_figure(fig: Figure, path: str | os.PathLike, *, dpi: int = 120) -> str:
    """Write ``fig`` to ``path`` as a PNG of ``dpi`` dots per inch, atomically; return the absolute path.

    Raises ``OSError`` as :func:`remat_compiler.passes.files.atomic_write` does (folder not writable; no
    partial file is left behind).
    """
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))


def _figure(width_in: float = 9.0, height_in: float = 4.8) -> Figure:
    fig = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# ---------------------------------------------------------------------------- timeline
def plot_timeline(cg: CostGraph, plans: dict[str, Plan], budget_bytes: int | None,
                  path: str | os.PathLike) -> str:
    """Draw live activation memory per node run, forward then backward, for each plan.

    Parameters
    ----------
    cg : CostGraph
        The graph every plan was made for.
    plans : dict[str, Plan]
        Legend label -> plan; each curve is the live bytes while each node runs
        (``simulate(cg, build_schedule(cg, plan.saved, plan.rerun)).events``), the profile the plan's peak and
        the solver's budget refer to.
    budget_bytes : int or None
        Drawn as a horizontal line when given.
    path : str or PathLike
        PNG to write.

    Returns
    -------
    str
        The absolute path written.

    Raises
    ------
    PlanMismatchError
        If a plan was made for another graph.
    ValueError
        If ``plans`` is empty.
    """
    if not plans:
        raise ValueError("plot_timeline needs at least one plan")
    fig = _figure()
    ax = fig.add_subplot()
    num_fw = 0
    for rank, (label, plan) in enumerate(plans.items()):
        plan.check_applies_to(cg)
        sim = simulate(cg, build_schedule(cg, plan.saved, plan.rerun))
        num_fw = sim.num_fw_steps  # the first events are the forward nodes, one each
        mib = [b / _MIB for _node, b in sim.events]
        # one extra point so the last node is drawn as wide as the others; the first plan on top
        ax.plot(range(len(mib) + 1), mib + mib[-1:], drawstyle="steps-post", linewidth=1.8,
                zorder=3 + len(plans) - rank, label=f"{label}: peak {human_bytes(sim.peak_bytes)}")
    ax.axvline(num_fw, color="0.3", linestyle=":", linewidth=1.2)
    for text, align in (("\u2190 forward ", "right"), (" \u2192 backward", "left")):
        ax.text(num_fw, 0.98, text, transform=ax.get_xaxis_transform(), va="top", ha=align,
                fontsize=9, color="0.3")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / _MIB, color="crimson", linestyle="--", linewidth=1.2,
                   label=f"budget {human_bytes(budget_bytes)}")
    ax.set_xlabel("node run (forward nodes, then backward nodes and their recomputations)")
    ax.set_ylabel("live activation memory (MiB)")
    ax.set_title("Memory over one training step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.08)  # room for the forward / backward labels
    ax.legend(loc="best", fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------- pareto
class PointLike(Protocol):
    """What :func:`plot_pareto` reads from a row (``remat_compiler.sweep.ParetoRow`` has it)."""

    label: str
    kind: str
    budget: str
    plan: Plan | None


def plot_pareto(rows: Sequence[PointLike], path: str | os.PathLike) -> str:
    """Draw recompute FLOP overhead against predicted peak: the budget sweep and hand-picked strategies.

    Parameters
    ----------
    rows : sequence of PointLike
        For instance :class:`remat_compiler.sweep.ParetoRow`. Rows with ``kind == "sweep"`` form the curve; ``kind == "strategy"`` rows are marked
        separately. Rows without a plan (infeasible, not applicable) are skipped.
    path : str or PathLike
        PNG to write.

    Returns
    -------
    str
        The absolute path written.

    Raises
    ------
    ValueError
        If no row has a plan.
    """
    drawn = [r for r in rows if r.plan is not None]
    if not drawn:
        raise ValueError("no feasible point to draw: every budget was infeasible or no strategy applied")
    fig = _figure(8.0, 5.0)
    ax = fig.add_subplot()
    sweep = sorted((r for r in drawn if r.kind == "sweep"), key=lambda r: r.plan.peak_bytes)
    if sweep:
        ax.plot([r.plan.peak_bytes / _MIB for r in sweep], [100 * r.plan.flop_overhead for r in sweep],
                marker="o", linewidth=1.6, label=f"{sweep[0].plan.solver} budget sweep")
        for r in sweep:
            ax.annotate(r.budget, (r.plan.peak_bytes / _MIB, 100 * r.plan.flop_overhead),
                        textcoords="offset points", xytext=(4, 6), fontsize=8, color="0.25")
    strategies = [r for r in drawn if r.kind == "strategy"]
    for i, r in enumerate(strategies):  # colours C1.. and distinct markers: the sweep keeps C0
        ax.scatter([r.plan.peak_bytes / _MIB], [100 * r.plan.flop_overhead], s=70, zorder=3,
                   marker="sD^vP*Xh"[i % 8], color=f"C{1 + i % 9}", label=r.label)
    ax.set_xlabel("predicted step peak (MiB)")
    ax.set_ylabel("recompute overhead (% of the step's FLOPs)")
    ax.set_title("Recompute overhead against peak memory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------- DOT
def node_decisions(cg: CostGraph, plan: Plan) -> dict[str, str]:
    """Class of every node for pictures: a key of :data:`DOT_COLORS`.

    Forward candidates are ``saved``, ``recomputed`` or ``dropped`` (neither: freed after the
    forward because backward never needs them); other forward nodes are ``recomputed`` when the
    plan recomputes them (views, getitems) or ``forward``.

    Raises
    ------
    PlanMismatchError
        If the plan was made for another graph.
    """
    plan.check_applies_to(cg)
    saved, recomputed, candidates = set(plan.saved), set(plan.recomputed), set(cg.candidates)
    out = {}
    for n in cg.order:
        phase = cg.attr(n, "phase")
        if phase in ("input", "tangent"):
            out[n] = "input"
        elif phase == "bw":
            out[n] = "backward"
        elif n in saved:
            out[n] = "saved"
        elif n in recomputed:
            out[n] = "recomputed"
        elif n in candidates:
            out[n] = "dropped"
        else:
            out[n] = "forward"
    return out


def _dot_quote(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _node_label(cg: CostGraph, n: str) -> str:
    a = cg.g.nodes[n]
    parts = [n, a["op"].replace("aten.", "")]
    if a["shape"]:
        parts.append("x".join(map(str, a["shape"])))
    if a["bytes"]:
        parts.append(human_bytes(a["bytes"]))
    return "\n".join(parts)


def plan_to_dot(cg: CostGraph, plan: Plan) -> str:
    """The graph as DOT text, forward nodes coloured by the plan's decision, backward nodes grey.

    Each node has ``class`` set to its decision (see :func:`node_decisions`), so tools can read
    the plan back from the picture.

    Parameters
    ----------
    cg : CostGraph
    plan : Plan

    Returns
    -------
    str
        A ``digraph`` that Graphviz (``dot -Tsvg``) and pydot read.

    Raises
    ------
    PlanMismatchError
        If the plan was made for another graph.
    """
    decisions = node_decisions(cg, plan)
    legend = ", ".join(f"{k} {v}" for k, v in DOT_COLORS.items())
    title = (f"plan by {plan.solver} ({plan.status}): peak {human_bytes(plan.peak_bytes)}, budget "
             f"{human_bytes(plan.budget_bytes) if plan.budget_bytes else 'unlimited'}, "
             f"recompute {plan.flop_overhead:.1%} FLOPs\ncolours: {legend}")
    lines = ["digraph remat_plan {",
             f'  graph [rankdir=TB, labelloc=t, fontname="Helvetica", label={_dot_quote(title)}];',
             '  node [shape=box, style="filled,rounded", fontname="Helvetica", fontsize=9];',
             '  edge [color="#777777", arrowsize=0.6];']
    for n in cg.order:
        cls = decisions[n]
        style = ', style="filled,rounded,dashed"' if cls == "dropped" else ""
        lines.append(f"  {_dot_quote(n)} [label={_dot_quote(_node_label(cg, n))}, "
                     f'class="{cls}", fillcolor="{DOT_COLORS[cls]}"{style}];')
    for u, v in sorted(cg.g.edges, key=lambda e: (cg.attr(e[1], "order"), cg.attr(e[0], "order"))):
        lines.append(f"  {_dot_quote(u)} -> {_dot_quote(v)};")
    lines.append("}")
    return "\n".join(lines) + "\n"

