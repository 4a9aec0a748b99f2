"""Write ``benchmarks/RESULTS.md`` and its pictures from the saved benchmark outputs, running nothing.

Usage::

    python -m benchmarks.results_page                 # benchmarks/RESULTS.md, benchmarks/*.png
    python -m benchmarks.results_page --out /tmp/res  # somewhere else (reads benchmarks/data/ still)

The page holds the current figure of each workload and peer, one table per command, each naming the
command that measures it and the commit of the code it measured. The figures come from what those
commands saved in ``benchmarks/data/``:

- ``inductor_peers.json``: ``python -m benchmarks.inductor_peers --json ...`` (the Inductor backend
  against ``torch.compile``); ``inductor_variants.json``: figures of ``python -m benchmarks.inductor_variants``;
- ``gpt2.json``, ``mixtral.json``, ``moe1.json``, ``moe2.json``, ``mlp.json``, ``scale.json``:
  ``python -m benchmarks.run`` (the eager backend against checkpointing and ``torch.compile``);
- ``real_sizes.json``, ``real_sizes_targets.json``: ``python -m benchmarks.real_sizes --json ...``;
- ``fsdp_peers.json``: ``python -m benchmarks.fsdp_peers --json ...`` (FSDP2's settings, 2 gloo ranks);
  ``fsdp_peers_inductor.json`` and ``fsdp_peers_inductor_flops.json``: the same with ``--backend
  inductor``, and with ``--objective flops`` too;
- ``moe_table.md``, ``inductor.md`` (its coverage table), ``gpu_check.md``: the Markdown those commands
  print or write, tables taken as they are.

How a figure changed over time is in ``git log -p benchmarks/data/`` and the issues, not on the page.

>>> main(["--out", "/tmp/results"])  # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks import fsdp_peers, inductor_peers, real_sizes
from benchmarks.report import atomic_write_text, check_targets, format_rows, format_scale, plot_pareto_measured
from remat_compiler.viz import save_figure

__all__ = ["render_page", "summary_rows", "format_summary", "plot_peers", "main"]

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
MIB = float(2 ** 20)
#: The workloads of ``python -m benchmarks.run``, in page order.
EAGER_WORKLOADS = ("gpt2", "mixtral", "moe1", "moe2", "mlp")
#: What the Inductor peers' rows are called on the page.
PEER_NAMES = {"eager": "eager (no recompute)", "checkpoint every block": "`torch.utils.checkpoint`, every block",
              "torch.compile checkpoint every block": "`torch.compile` + checkpoint every block"}
MODEL_NAMES = {"gpt2": "GPT-2", "mixtral": "Mixtral"}


def _load_json(name: str, data_dir: str):
    with open(os.path.join(data_dir, name), encoding="utf-8") as f:
        return json.load(f)


def _read(name: str, data_dir: str) -> str:
    with open(os.path.join(data_dir, name), encoding="utf-8") as f:
        return f.read()


def _peer_name(label: str) -> str:
    if label.startswith("torch.compile budget"):
        return f"`torch.compile`, activation_memory_budget {label.split()[-1]}"
    return PEER_NAMES.get(label, label)


def summary_rows(peers: dict) -> list[dict]:
    """Every remat_compiler Inductor row of the peers document beside the peer whose peak is its budget.

    Returns
    -------
    list of dict
        ``model``, ``peer``, ``peer_peak_bytes``, ``peer_step_ratio`` (the peer's step over eager's),
        ``peak_bytes``, ``vs_peer`` (remat_compiler's step over the peer's, timed in the same rounds),
        ``recompute_gflop``.
    """
    out = []
    for doc in peers["workloads"]:
        by_label = {inductor_peers._label(r): r for r in doc["rows"] if not r["kind"].startswith("remat")}
        for r in doc["rows"]:
            if r["kind"] != "remat inductor" or r.get("status") != "ok" or r.get("peer") not in by_label:
                continue
            peer = by_label[r["peer"]]
            out.append({"model": doc["workload"], "peer": r["peer"], "peer_peak_bytes": inductor_peers._peak(peer),
                        "peer_step_ratio": peer["step_ratio"], "peer_step_s": peer["step_s"],
                        "peak_bytes": inductor_peers._peak(r), "step_s": r["step_s"], "vs_peer": r.get("vs_peer"),
                        "recompute_gflop": (r.get("recompute_flops") or 0) / 1e9})
    return out


def format_summary(rows: Sequence[dict]) -> str:
    """The summary table: at each peer's measured peak, remat_compiler's peak and step against the peer's."""
    lines = ["| model | peer | peer's peak (MiB) | remat_compiler's peak (MiB) | step time, remat_compiler / peer "
             "| recomputed GFLOP |", "|---|---|---|---|---|---|"]
    for r in rows:
        vs = "-" if r["vs_peer"] is None else f"{r['vs_peer']:.2f}"
        lines.append(f"| {MODEL_NAMES.get(r['model'], r['model'])} | {_peer_name(r['peer'])} "
                     f"| {inductor_peers._mib(r['peer_peak_bytes'])} | {inductor_peers._mib(r['peak_bytes'])} "
                     f"| {vs} | {r['recompute_gflop']:.2f} |")
    return "\n".join(lines)


def _figure(size=(8.5, 5.2)) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_peers(doc: dict, path: str | os.PathLike) -> str:
    """One workload of the peers document, a bar pair per peer: the peer's measured peak and
    remat_compiler's under that peak as its budget (left), and remat_compiler's step over the peer's,
    timed in the same rounds of one process (right; below 1 is faster)."""
    rows = summary_rows({"workloads": [doc]})
    labels = [_peer_name(r["peer"]).replace("`", "").replace(", activation_memory_budget", " budget") for r in rows]
    ys = list(range(len(rows)))[::-1]
    fig = _figure((10, 0.45 * len(rows) + 1.6))
    left, right = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    h = 0.38
    left.barh([y + h / 2 for y in ys], [r["peer_peak_bytes"] / MIB for r in rows], height=h, color="0.65",
              label="the peer")
    left.barh([y - h / 2 for y in ys], [r["peak_bytes"] / MIB for r in rows], height=h, color="C0",
              label="remat_compiler (Inductor), budget = the peer's peak")
    left.set_yticks(ys, labels, fontsize=8)
    left.set_xlabel("measured step peak (MiB)")
    left.legend(fontsize=7, loc="lower right")
    ratios = [r["vs_peer"] if r["vs_peer"] is not None else float("nan") for r in rows]
    right.barh(ys, ratios, height=0.6, color=["C0" if x <= 1.0 else "C3" for x in ratios])
    right.axvline(1.0, color="k", lw=0.8)
    for y, x in zip(ys, ratios):
        right.annotate(f"{x:.2f}", (x, y), xytext=(3, -3), textcoords="offset points", fontsize=7)
    right.set_xlim(0, max(1.1, max(ratios) + 0.1))
    right.set_xlabel("step, remat_compiler / peer (same rounds)")
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{doc['workload']}: {doc['description']}", fontsize=9)
    return save_figure(fig, path)


def _section_of(markdown: str, heading_prefix: str) -> str:
    """The lines of ``markdown`` from the heading that starts with ``heading_prefix`` to the next
    heading of the same or a higher level."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading_prefix))
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(lines))
                if lines[i].startswith("#") and len(lines[i]) - len(lines[i].lstrip("#")) <= level), len(lines))
    return "\n".join(lines[start + 1:end]).strip()


def _tables_and_bullets(markdown: str) -> str:
    """Only the table rows, the bullets and the lines between them of a command's Markdown, from its
    first table on: the command's own prose is replaced by the page's."""
    lines = markdown.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    return "\n".join(lines[first:]).strip()


def _command_in(markdown: str) -> str:
    m = re.search(r"Command: `([^`]+)`", markdown) or re.search(r"`(python -m benchmarks\.[^`]+)`", markdown)
    return m.group(1) if m else "-"


MEASURED = """\
How the figures are measured (`docs/measuring-memory.md` has the whole account):

- **Peak**: the most tensor bytes alive during one training step (forward, loss, backward, parameter
  gradients created from None) above what was resident before it. Eager-backend tables count live
  tensor storages op by op (`remat_compiler.LiveStorageTracker`); Inductor tables count every
  allocation and free PyTorch's CPU allocator reports (`remat_compiler.AllocatorPeak`, which sees
  Inductor's buffers and kernels' inner temporaries), with the resident-set growth beside it ("RSS").
- **Predicted**: remat_compiler's own figure before anything runs: the plan's simulated peak (eager) or
  the walk of the code Inductor wrote (Inductor).
- **Step time**: the runners are stepped round-robin (every other round in reverse order), and a ratio
  is the median over rounds of one runner's step over another's in the same round; "vs peer" is
  remat_compiler's step over its peer's, timed in one process. FLOP ratios are exact; step times are
  from a 2-core CPU and indicative.
- **FLOP ratio**: the step's FLOPs (`torch.utils.flop_counter`: matmul, convolution, attention) over
  eager's; 1.000 recomputes no counted op.
- **Peers**: `torch.utils.checkpoint.checkpoint(block, use_reentrant=False)` around every repeated block;
  `torch.compile` with `torch._functorch.config.activation_memory_budget` patched while it compiles
  (Inductor, or `aot_eager_decomp_partition` in the eager-backend tables); eager with no recompute.
  remat_compiler gets each peer's measured peak as its `memory_budget`.
- **Sizes** are in MiB (2^20 bytes), GiB on the real-size table.
"""


INTRO = """\
# Results: remat_compiler against the tools users would pick instead

The current figure for each workload and peer. Each table names the command that measures it and the commit
of the code it measured. This page and its pictures are written by `python -m benchmarks.results_page`
from the outputs those commands saved in `benchmarks/data/`, without running anything; how a figure
changed over time is in `git log -p benchmarks/data/` and the issues."""


def _exists(data_dir: str, *names: str) -> bool:
    return all(os.path.exists(os.path.join(data_dir, n)) for n in names)


def _summary_section(data_dir: str) -> list[str]:
    if not _exists(data_dir, "inductor_peers.json"):
        return []
    peers = _load_json("inductor_peers.json", data_dir)
    return ["## At the same memory: the step time", "",
            "The Inductor backend (`compile(model, memory_budget=peer_peak, backend=\"inductor\")`) at the "
            "measured peak of\neach peer, against that peer, on HuggingFace GPT-2 and Mixtral with random weights "
            f"(from `{peers['command']}`,\n{peers['code_version']}; the full tables are below):",
            "", format_summary(summary_rows(peers)), "",
            *[f"![{d['workload']}: peak and step time against each peer](peers_{d['workload']}.png)"
              for d in peers["workloads"]], ""]


def _inductor_section(data_dir: str) -> list[str]:
    parts = ["## The Inductor backend against `torch.compile`"]
    if _exists(data_dir, "inductor_peers.json"):
        peers = _load_json("inductor_peers.json", data_dir)
        parts += ["", f"Command: `{peers['command']}` (about 35 minutes on 2 CPU cores: every row is a fresh "
                  f"process compiling with a\ncold Inductor cache); code: {peers['code_version']}."
                  + (f" {peers['transcribed']}" if peers.get("transcribed") else "")]
        for doc in peers["workloads"]:
            parts += ["", f"### {doc['workload']}", "",
                      f"{doc['description']}. torch {doc['torch']}, {doc['threads']} torch threads, each row in a "
                      f"fresh process; step times: median of {doc['rounds']} interleaved rounds; CP-SAT "
                      f"{doc['time_limit_s']:g} s per solve, objective {doc['objective']}. \"tracked\": the "
                      "live-storage tracker that sees Inductor's buffers; compile: the first step less a median "
                      "step (trace + plan + Inductor for remat_compiler).",
                      "", inductor_peers.format_table(doc), "", "Targets:", "", *inductor_peers.check_targets(doc)]
    if _exists(data_dir, "inductor_variants.json"):
        variants = _load_json("inductor_variants.json", data_dir)
        parts += ["", "### The same plan with and without shared values stored once", "",
                  f"Command: `{variants['command']}`; code: {variants['code_version']}. {variants['what']}", "",
                  "| runner | plan peak (bytes) | walk (bytes) | " + " | ".join(
                      f"vs peer, {n} rounds" for n in variants["rounds"]) + " |",
                  "|---|---|---|" + "---|" * len(variants["rounds"])]
        for r in variants["rows"]:
            parts.append(f"| {r['runner']} | {r['plan_peak_bytes']:,} | {r['walk_bytes']:,} | "
                         + " | ".join(f"{x:.3f}" for x in r["vs_peer"]) + " |")
    if _exists(data_dir, "inductor.md"):
        coverage = _section_of(_read("inductor.md", data_dir), "## Coverage")
        parts += ["", "### Every model the eager backend supports, under Inductor", "", coverage.replace(
            "`python -m benchmarks.inductor_coverage`.", "Command: `python -m benchmarks.inductor_coverage` "
            "(about 3 minutes); code: commit e2099e0.")]
    return parts if len(parts) > 1 else []


def _eager_section(data_dir: str) -> list[str]:
    parts = ["## The eager backend against checkpointing and `torch.compile`", "",
             "Command: `python -m benchmarks.run` (all workloads; `--workloads gpt2,mixtral` and so on for "
             "some); each workload's\nrows are saved in `benchmarks/data/<workload>.json`. The step keeps only "
             "the loss, so remat_compiler plans with\n`hold_outputs=False`. CP-SAT minimises the objective "
             "named per workload (`flops`: counted FLOPs recomputed);\nstatus `feasible` means it stopped at its "
             "time limit, with the proven gap; the smallest feasible budget may use\nreruns (a value recomputed "
             "a second time, found by local search, no proven gap). On `moe2` (2 gloo ranks) the\npeak is the "
             "larger rank's, FLOPs are summed over ranks and a step takes as long as the slower rank."]
    for name in EAGER_WORKLOADS:
        if not _exists(data_dir, f"{name}.json"):
            continue
        doc = _load_json(f"{name}.json", data_dir)
        mf = doc["min_feasible"]
        parts += ["", f"### {name}", "",
                  f"{doc['description']}. {doc['world_size']} rank(s), {doc['threads']} torch thread(s) per rank, "
                  f"torch {doc['torch']}; traced graph {doc['nodes']} nodes. CP-SAT: {doc['time_limit_s']:g} s per "
                  f"solve, {doc['num_workers']} workers, objective {doc.get('objective', 'runtime')}. Smallest "
                  f"feasible budget: {mf['bytes'] / MIB:.2f} MiB ({'proven' if mf['proven'] else 'not proven'} "
                  f"within the limit). Step time: median of {doc['rounds']} interleaved steps. Command: "
                  f"`{doc.get('command', '-')}`; code: {doc.get('code_version', 'unknown')}.",
                  "", format_rows(doc["rows"]), "", f"![Pareto {name}](pareto_{name}.png)", "", "Targets:", "",
                  *check_targets(doc)]
    if _exists(data_dir, "scale.json"):
        doc = _load_json("scale.json", data_dir)
        parts += ["", "### Plan time on deeper GPT-2 (planned only)", "",
                  f"{doc['description']}. CP-SAT with {doc['num_workers']} workers, objective "
                  f"{doc.get('objective', 'runtime')}, each solve building the block menu anew. FLOP gap: "
                  "status and gap on counted FLOPs; tie-break gap: on the whole objective (FLOPs plus one unit "
                  f"per recomputed op). Command: `{doc.get('command', '-')}`; code: "
                  f"{doc.get('code_version', 'unknown')}.", "", format_scale(doc)]
    return parts if len(parts) > 3 else []


def _moe_section(data_dir: str) -> list[str]:
    if not _exists(data_dir, "moe_table.md"):
        return []
    moe = _read("moe_table.md", data_dir)
    return ["## MoE: the combine chosen per segment", "",
            f"Command: `{_command_in(moe)}`; code: commit b4bedce. The moe1 stack (4 `MoELayer`s, one "
            "process, float32). The A2A column plans\nthe same budgets on a fake 2-rank group, where the "
            "choice is not made: the bytes a rank sends again. Budget \"fast - y\" is moe_fast's\nmeasured "
            "peak less every layer's y (4 × 2 MiB): moe_fast cannot reach it without recomputing a GEMM; the\n"
            "default `cpsat` reaches "
            "it with no FLOPs recomputed, fusing three of the four layers.", "", _tables_and_bullets(moe)]


def _real_sizes_section(data_dir: str) -> list[str]:
    if not _exists(data_dir, "real_sizes.json", "real_sizes_targets.json"):
        return []
    sweep = _load_json("real_sizes.json", data_dir)
    targets = _load_json("real_sizes_targets.json", data_dir)
    return ["## Real sizes: Mistral-7B and 70B shapes planned for an H100 on a CPU", "",
            "`MistralConfig` on the meta device, bfloat16, batch 1, the model's own loss, the logits let go; "
            "planned for\nthe `h100` preset (CUDA's caching-allocator units, vendor rates). Peaks are the plans' "
            "predicted step peaks\nabove the resident weights (nothing runs). Budgets lie on the line from "
            "checkpoint-every-block's peak to the\nno-recompute peak. CP-SAT minimises counted FLOPs, "
            f"{sweep[0]['workers']} workers, its time limit in brackets; the gap is the proven FLOP gap.\n"
            "Est. step: the roofline estimate on the H100 preset. Planner RSS: the planning process's peak "
            "resident set.", "",
            "Every length and budget (command: `python -m benchmarks.real_sizes --json "
            "benchmarks/data/real_sizes.json`, about 35 minutes;\ncode: commit cf6fb58; every layer traced, so "
            "its trace times are those of a full trace):", "",
            real_sizes.format_markdown(sweep), "",
            "The two target points, timed from the config to the plan, with the time limit bounding the whole "
            "planning\nand identical layers stamped (command: `python -m benchmarks.real_sizes --shapes 7b "
            "--seqs 8192 --fractions 0.5`,\nthen `--shapes 70b`, their points saved in "
            "`benchmarks/data/real_sizes_targets.json`; code: commit 2bd1213):", "",
            real_sizes.format_markdown(targets), "", *real_sizes._verdicts(targets)]


def _fsdp_section(data_dir: str) -> list[str]:
    if not _exists(data_dir, "fsdp_peers.json"):
        return []
    doc = _load_json("fsdp_peers.json", data_dir)
    return ["## Sharded: FSDP2's own settings against the plan, at each one's measured peak", "",
            "Command: `python -m benchmarks.fsdp_peers --json benchmarks/data/fsdp_peers.json` (about 7 "
            f"minutes); code: commit {doc['commit']}.\n2 gloo ranks on this 2-core CPU, every block a "
            "`fully_shard` unit then the root, fp32. Each peer runs FSDP2; its per-rank\npeak is measured "
            "by the allocator's events (which see what FSDP2 re-allocates by resizing storages and what gloo\n"
            "allocates inside a collective; " + ("the peers' and ours" if doc["rows"] and doc["rows"][0].get("meter") ==
                                                 "AllocatorPeak" else "the `torch.compile` peer's and ours beside it") +
            "), and remat_compiler compiles the same sharded model with the smaller rank's peak as\nits budget "
            "(the one plan runs on every rank). Step times: medians of "
            "interleaved rounds, one process a rank "
            "(indicative); FLOPs (the flop counter's,\nwhich sees none inside Inductor's kernels, with grouped "
            "matmuls counted as the planner counts them: see docs/fsdp.md)\nand bytes are exact. Recomputed "
            "FLOPs: a peer's counted FLOPs less FSDP2 eager's; the `torch.compile` peer's counted on a\ntwin "
            "that plans as Inductor does and runs the graphs op by op (`fsdp_peers._recomputed_by_peer`); "
            "ours, the plan's count. Bytes re-gathered: what a rank sends again in a step, ours as the "
            "plan charges it\n(`passes.costs.sent_bytes`), the peer's as FSDP2 re-gathers "
            "(`fsdp_peers.peer_regather_bytes`; \"-\" in files made before it).", "",
            fsdp_peers.format_table(doc["rows"]), *_fsdp_inductor_rows(data_dir)]


def _fsdp_inductor_rows(data_dir: str) -> list[str]:
    """The sharded step under ``backend="inductor"`` against the peers named in its file, with the
    library's objective and with ``objective="flops"``."""
    lines = []
    for name, flag, title in (("fsdp_peers_inductor.json", "", ""),
                              ("fsdp_peers_inductor_flops.json", " --objective flops --time-limit 60",
                               ", `objective=\"flops\"`")):
        if not _exists(data_dir, name):
            continue
        doc = _load_json(name, data_dir)
        workloads = ",".join(dict.fromkeys(r["workload"] for r in doc["rows"]))
        peers = ",".join(str(fsdp_peers.PEERS.index(p)) for p in dict.fromkeys(r["peer"] for r in doc["rows"]))
        lines += ["", f"### The same, our step under `backend=\"inductor\"`{title}", "",
                  f"Command: `python -m benchmarks.fsdp_peers --workloads {workloads} --peers {peers} --backend "
                  f"inductor{flag} --json benchmarks/data/{name}`;\ncode: commit {doc['commit']}. Every row measured "
                  "by the allocator's events (a dispatch-mode tracker sees none of Inductor's\nbuffers); our FLOPs are "
                  "not counted inside Inductor's kernels (what we recompute is the plan's count); \"predicted\" is "
                  "the peak walked in the code Inductor wrote.",
                  "", fsdp_peers.format_table(doc["rows"])]
    return lines


def _gpu_section(data_dir: str) -> list[str]:
    """``gpu_check.md`` as the command wrote it; a dry run's note on how it was written gives way to what
    measures it."""
    if not _exists(data_dir, "gpu_check.md"):
        return []
    paragraphs = _read("gpu_check.md", data_dir).strip().split("\n\n")
    out = []
    for para in paragraphs:
        if para.startswith("Not yet measured on a GPU"):
            para = ("Not measured on a GPU yet: the predictions below are those of the plan files in "
                    "`data/cuda_plans/`, made for an H200\non a CPU-only machine. On a GPU (about 5 minutes on "
                    "an H100/H200), `python -m benchmarks.gpu_check --plans benchmarks/data/cuda_plans\n--out "
                    "benchmarks/data/gpu_check.md` measures eager, torch.compile, remat_compiler at 1.0 / 0.6 / 0.4 "
                    "and the transfer of\nthe four plan files, and `python -m benchmarks.results_page` puts its "
                    "rows here.")
        out.append(para)
    return ["\n\n".join(out)]


def render_page(data_dir: str = DATA) -> str:
    """The whole of RESULTS.md, from the saved outputs in ``data_dir``; a section whose file is not
    there is left out."""
    sections = [INTRO.splitlines(), _summary_section(data_dir), MEASURED.rstrip().splitlines(),
                _inductor_section(data_dir), _eager_section(data_dir), _moe_section(data_dir),
                _real_sizes_section(data_dir), _fsdp_section(data_dir),
                _gpu_section(data_dir)]
    return "\n\n".join("\n".join(s).strip() for s in sections if s) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.results_page", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DATA, help="the saved outputs (default: benchmarks/data)")
    p.add_argument("--out", default=HERE, help="where RESULTS.md and the pictures go (default: benchmarks/)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "RESULTS.md"), render_page(args.data))
    if _exists(args.data, "inductor_peers.json"):
        for doc in _load_json("inductor_peers.json", args.data)["workloads"]:
            plot_peers(doc, os.path.join(args.out, f"peers_{doc['workload']}.png"))
    for name in EAGER_WORKLOADS:
        if os.path.exists(os.path.join(args.data, f"{name}.json")):
            plot_pareto_measured(_load_json(f"{name}.json", args.data), os.path.join(args.out, f"pareto_{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
