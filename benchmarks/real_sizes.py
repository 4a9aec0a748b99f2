"""Real sizes (issues 15, 33): Mistral-7B- and 70B-shaped models (and Qwen2-7B's) planned for an H100 from
this CPU-only machine.

Each shape is a ``MistralConfig`` (``qwen2-7b``: a ``Qwen2Config``) built on the meta device (no
weights: planning needs shapes and dtypes only), in bfloat16, batch 1, trained on its own loss
(``model(input_ids=ids, labels=ids)``, the logits let go). Each (shape, seq) point runs in a fresh
process, so that the planner's own peak RSS is the point's (``ru_maxrss``). In it:

1. the step is traced and analysed once for the ``h100`` preset (CUDA's units, vendor rates): from
   traces of 3 and 4 of its layers, the others stamped (:mod:`remat_compiler.stamp`, the graph a full
   trace gives), model construction included in the trace time;
2. the no-recompute plan and the checkpoint-every-block plan (peak, FLOP ratio);
3. CP-SAT at three budgets on the line from checkpointing's peak to the no-recompute peak: at
   checkpointing's peak (where a plan has to beat it), halfway (the issue's target point) and three
   quarters of the way. Each point is planned within the shape's time limit (60 s for 7B, 120 s for
   70B: the targets) from the config: each solve runs on what the limit leaves after the trace and the
   baselines, as ``plan_model(..., time_limit_s=...)`` bounds the whole call. It minimises counted
   FLOPs (``objective="flops"``), so its proven gap is the FLOP gap the targets name. Reported per
   plan: predicted peak, FLOP ratio (step FLOPs with recompute over without), estimated step time on
   the H100 preset (roofline, communication-free here), solve wall time, status and proven gap.

Run::

    python -m benchmarks.real_sizes                                  # both shapes, seq 4096/8192/16384
    python -m benchmarks.real_sizes --shapes 7b --seqs 8192 --markdown /tmp/rs.md --json /tmp/rs.json
    python -m benchmarks.real_sizes --shapes 7b --seqs 8192 --fractions 0.5       # the target point only
    python -m benchmarks.real_sizes --fsdp 8 --seqs 8192 --fractions 0.5          # one rank of 8, FSDP2 (docs/fsdp.md)
    python -m benchmarks.real_sizes --shapes qwen2-7b --seqs 4096 --fractions '' --of-peak 0.5,0.3  # issue 33

The sdpa kernels of these models trace as CPU kernels on a CPU-only build (a ``DeviceTraceWarning``
says so): the plans are for that graph, which is the one a GPU build traces with
``attn_implementation="eager"`` changed for sdpa's fused kernel (see :mod:`remat_compiler.trace`).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

__all__ = ["SHAPES", "FRACTIONS", "TARGET_SEQ", "RSS_TARGET_BYTES", "shape_config", "plan_point",
           "format_markdown", "format_section", "main"]

#: The shapes (issue 15's Mistral family, issue 33's Qwen2-7B): layers, hidden, FFN, heads, KV heads,
#: vocab; the solve's time limit.
SHAPES = {
    "7b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32768, time_limit_s=60.0),
    "70b": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=32768, time_limit_s=120.0),
    # issue 33's third 7B-class shape: Qwen2-7B's sizes (biased q/k/v, 152k vocabulary) in a Qwen2Config
    "qwen2-7b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, time_limit_s=60.0),
}
#: Where each budget lies between checkpoint-every-block's peak (0) and the no-recompute peak (1).
FRACTIONS = ((0.0, "checkpoint's peak"), (0.5, "halfway"), (0.75, "3/4 of the way"))
#: Issue 33's harder budgets (``--of-peak``): these fractions of the no-recompute peak itself.
OF_PEAK = (0.5, 0.3)
GIB = 1 << 30
#: The targets' point (issue 15): batch 1 x seq 8192, the halfway budget, within the shape's time limit,
#: FLOP gap <= 1%; the 70B planner's peak RSS at most 4 GiB.
TARGET_SEQ = 8192
RSS_TARGET_BYTES = 4 * GIB


def shape_config(shape: str):
    """The config of a :data:`SHAPES` entry (a ``MistralConfig``, or the ``model_type`` it names): its
    sizes, the rest the library's defaults."""
    from transformers import AutoConfig

    sizes = {k: v for k, v in SHAPES[shape].items() if k not in ("time_limit_s", "model_type")}
    return AutoConfig.for_model(SHAPES[shape].get("model_type", "mistral"), **sizes, dtype="bfloat16")


def _flop_ratio(plan) -> float:
    return (plan.baseline_flops + plan.recompute_flops) / plan.baseline_flops


def _step_s(plan) -> float:
    return plan.baseline_s + plan.recompute_s


def plan_point(shape: str, seq: int, *, workers: int, time_limit_s: float | None = None,
               fractions=FRACTIONS, log=print, fsdp: int | None = None, of_peak=()) -> dict:
    """Trace, analyse and plan one (shape, seq) point in this process; its result document. With
    ``fsdp``, one rank of an ``fsdp``-way FSDP2 step (:func:`remat_compiler.fsdp.planning.analyze_sharded`:
    every layer and the root a unit, traced in full), each plan's units kept / re-gathered recorded.
    ``of_peak``: budgets at these fractions of the no-recompute peak, after the ``fractions``' rows."""
    import torch

    import remat_compiler
    from remat_compiler.passes import keys
    from remat_compiler.passes.costs import CostModel
    from remat_compiler.clock import MIN_SLICE_S, Deadline
    from remat_compiler.hf_config import build_causal_lm, check_seq, token_inputs

    limit = time_limit_s if time_limit_s is not None else SHAPES[shape]["time_limit_s"]
    t0 = time.perf_counter()
    config = shape_config(shape)
    check_seq(config, seq)
    model = build_causal_lm(config, torch.bfloat16)
    cost_model = CostModel.preset("h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the sdpa DeviceTraceWarning (module docstring)
        if fsdp is None:
            gm, cg = remat_compiler.analyze(model, (), token_inputs(1, seq), cost_model=cost_model,
                                            hold_outputs=False)
        else:
            from remat_compiler.fsdp.planning import analyze_sharded
            gm, cg = analyze_sharded(model, (), token_inputs(1, seq), fsdp=fsdp, cost_model=cost_model,
                                     hold_outputs=False)
    trace_s = time.perf_counter() - t0
    stamped = keys.STAMPED in gm.meta
    log(f"[real_sizes] {shape} seq {seq}: traced in {trace_s:.1f} s ({len(cg.fw_order)} forward nodes"
        f"{', stamped' if stamped else ''})")
    t1 = time.perf_counter()
    save_all = remat_compiler.solve(cg, None, "save_all")
    ckpt = remat_compiler.solve(cg, None, "checkpoint_blocks")
    baselines_s = time.perf_counter() - t1
    doc = {"shape": shape if fsdp is None else f"{shape} FSDP {fsdp}", "seq": seq, "batch": 1, "dtype": "bfloat16", "device": "h100",
           "forward_nodes": len(cg.fw_order), "trace_s": trace_s, "stamped": stamped, "baselines_s": baselines_s,
           "time_limit_s": limit,
           "workers": workers,
           "no_recompute": {"peak_bytes": save_all.peak_bytes, "step_s": _step_s(save_all)},
           "checkpoint": {"peak_bytes": ckpt.peak_bytes, "flop_ratio": _flop_ratio(ckpt),
                          "step_s": _step_s(ckpt)},
           "plans": []}
    left = max(MIN_SLICE_S, limit - trace_s - baselines_s)  # each point planned from the config within the limit
    points = [(frac, label, int(ckpt.peak_bytes + frac * (save_all.peak_bytes - ckpt.peak_bytes)))
              for frac, label in fractions]
    points += [(None, f"{share} of no-recompute", int(share * save_all.peak_bytes)) for share in of_peak]
    for frac, label, budget in points:
        t1 = time.perf_counter()
        try:
            plan = remat_compiler.solve(cg, budget, "cpsat", time_limit_s=limit, num_workers=workers,
                                        objective="flops", deadline=Deadline(left))
        except remat_compiler.InfeasibleBudgetError as exc:  # a row saying so, and the floor found
            wall = time.perf_counter() - t1
            doc["plans"].append({"fraction": frac, "label": label, "budget_bytes": budget, "infeasible": True,
                                 "min_feasible_bytes": exc.min_feasible_bytes, "proven": exc.proven,
                                 "solve_s": wall, "solve_limit_s": left})
            log(f"[real_sizes] {shape} seq {seq} @{label}: infeasible, smallest feasible "
                f"{exc.min_feasible_bytes / GIB:.2f} GiB ({'proven' if exc.proven else 'not proven'}), {wall:.1f} s")
            continue
        wall = time.perf_counter() - t1
        row = {"fraction": frac, "label": label, "budget_bytes": budget, "peak_bytes": plan.peak_bytes,
               "flop_ratio": _flop_ratio(plan), "step_s": _step_s(plan), "solve_s": wall, "solve_limit_s": left,
               "status": plan.status, "gap": plan.gap, "end_to_end_s": trace_s + baselines_s + wall,
               "regather_bytes": plan.recompute_comm_bytes}
        doc["plans"].append(row)
        log(f"[real_sizes] {shape} seq {seq} @{label}: {plan.peak_bytes / GIB:.2f} GiB, FLOP ratio "
            f"{row['flop_ratio']:.4f}, {plan.status}, gap {plan.gap:.4f}, {wall:.1f} s (end to end, from "
            f"the config: {row['end_to_end_s']:.1f} s)")
    doc["planner_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return doc


def _run_in_child(shape: str, seq: int, workers: int, time_limit_s: float | None,
                  fractions: str | None = None, fsdp: int | None = None, of_peak: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.real_sizes", "--one", shape, str(seq), "--workers", str(workers)]
    if fsdp is not None:
        cmd += ["--fsdp", str(fsdp)]
    if time_limit_s is not None:
        cmd += ["--time-limit", str(time_limit_s)]
    if fractions is not None:
        cmd += ["--fractions", fractions]
    if of_peak is not None:
        cmd += ["--of-peak", of_peak]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def format_markdown(docs: list[dict]) -> str:
    """The RESULTS.md table: one row per (shape, seq, budget)."""
    lines = ["| shape | seq | no-recompute GiB | checkpoint GiB (FLOP ratio) | budget | plan GiB | FLOP ratio "
             "| est. step on H100 (ms) | solve s (limit) | status, gap | trace s | planner RSS GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in docs:
        for p in d["plans"]:
            head = (f"| {d['shape']} | {d['seq']} | {_gib(d['no_recompute']['peak_bytes'])} | "
                    f"{_gib(d['checkpoint']['peak_bytes'])} ({d['checkpoint']['flop_ratio']:.3f}) | "
                    f"{p['label']}: {_gib(p['budget_bytes'])} | ")
            solve = f"{p['solve_s']:.1f} ({p.get('solve_limit_s', d['time_limit_s']):.0f})"
            tail = f" | {d['trace_s']:.0f} | {_gib(d['planner_peak_rss_bytes'])} |"
            if p.get("infeasible"):
                lines.append(head + f"infeasible: the smallest plan found is {_gib(p['min_feasible_bytes'])} "
                             f"({'proven' if p['proven'] else 'not proven'}) | – | – | {solve} | –" + tail)
            else:
                lines.append(head + f"{_gib(p['peak_bytes'])} | {p['flop_ratio']:.4f} | {p['step_s'] * 1e3:.0f} | "
                             f"{solve} | {p['status']}, {p['gap']:.4f}" + tail)
    return "\n".join(lines) + "\n"


def _how_traced(doc: dict) -> str:
    if doc.get("stamped"):
        return "AOTAutograd over fake tensors of 3 and 4 layers, the others stamped: remat_compiler.stamp"
    return "AOTAutograd over fake tensors"


def _verdicts(docs: list[dict]) -> list[str]:
    lines = []
    for d in docs:
        if d["seq"] != TARGET_SEQ:
            continue
        half = next((p for p in d["plans"] if p["fraction"] == 0.5), None)
        if half is None:
            continue
        # the target is planning from the config: trace, baselines and solve (older documents have no
        # baselines_s or end_to_end_s: their trace and solve)
        total = half.get("end_to_end_s", d["trace_s"] + d.get("baselines_s", 0.0) + half["solve_s"])
        ok = total <= d["time_limit_s"] and half["gap"] <= 0.01
        rss = d["planner_peak_rss_bytes"]
        rss_part = ""
        if d["shape"] == "70b":
            ok = ok and rss <= RSS_TARGET_BYTES
            rss_part = f", planner peak RSS {_gib(rss)} GiB (target <= {_gib(RSS_TARGET_BYTES)})"
        lines.append(f"- {d['shape']} seq {d['seq']} at the halfway budget: planned in {total:.1f} s from the "
                     f"config (target <= {d['time_limit_s']:.0f} s), FLOP gap {half['gap']:.4f} (target <= 0.01)"
                     f"{rss_part}: **{'met' if ok else 'not met'}**. Of that, the trace took {d['trace_s']:.0f} s "
                     f"({_how_traced(d)}) and the solve {half['solve_s']:.1f} s.")
    return lines


def format_section(docs: list[dict], command: str, machine: str) -> str:
    """The RESULTS.md section: how it was measured, the table, the targets."""
    head = ["## Real sizes: Mistral-7B and 70B shapes planned for an H100 from this CPU-only machine",
            "",
            f"Command: `{command}` ({machine}). Each shape's config (`MistralConfig`; `Qwen2Config` for "
            "qwen2-7b) on the meta device, bfloat16, batch 1, the "
            "model's own loss, the logits let go; planned for the `h100` preset (CUDA's caching-allocator "
            "units, vendor rates). Peaks are the plans' predicted step peaks above the resident weights "
            "(nothing runs here). Budgets lie on the line from checkpoint-every-block's peak to the "
            "no-recompute peak. CP-SAT minimises counted FLOPs (`objective=\"flops\"`), "
            f"{docs[0]['workers']} workers, its time limit in brackets (the shape's limit less the trace and "
            "baselines before it, where the document records that); the gap is the proven FLOP gap. "
            "Est. step: the roofline estimate of the step with its recomputation on the H100 preset. "
            "Planner RSS: the planning process's peak resident set (trace included).",
            ""]
    return "\n".join(head) + "\n" + format_markdown(docs) + "\n" + "\n".join(_verdicts(docs)) + "\n"


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="7b,70b", help="comma-separated keys of SHAPES")
    ap.add_argument("--seqs", default="4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT workers")
    ap.add_argument("--time-limit", type=float, default=None, help="override the shape's solve limit (s)")
    ap.add_argument("--json", help="write every point's document here")
    ap.add_argument("--markdown", help="write the RESULTS.md section here")
    ap.add_argument("--from-json", help="render the section from a --json file written before (no planning)")
    ap.add_argument("--machine", default="2-core CPU machine",
                    help="how to describe the machine in the section (its load, say)")
    ap.add_argument("--fractions", default=None,
                    help=f"comma-separated budgets to solve, of {','.join(str(f) for f, _ in FRACTIONS)} "
                         "(default: all; 0.5 is the targets' halfway point)")
    ap.add_argument("--of-peak", default=None, metavar="F,F",
                    help=f"also solve at these fractions of the no-recompute peak (issue 33: "
                         f"{','.join(str(f) for f in OF_PEAK)}); --fractions '' for these alone")
    ap.add_argument("--fsdp", type=int, default=None, metavar="N",
                    help="plan one rank of an N-way FSDP2 step (docs/fsdp.md): rows '<shape> FSDP N'")
    ap.add_argument("--one", nargs=2, metavar=("SHAPE", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    fractions = FRACTIONS
    if args.fractions is not None:
        wanted = {float(f) for f in args.fractions.split(",") if f}
        fractions = tuple(fl for fl in FRACTIONS if fl[0] in wanted)
        if len(fractions) != len(wanted):
            ap.error(f"--fractions: each of {args.fractions} must be one of {[f for f, _ in FRACTIONS]}")
    of_peak = tuple(float(f) for f in args.of_peak.split(",") if f) if args.of_peak else ()
    if args.one:
        doc = plan_point(args.one[0], int(args.one[1]), workers=args.workers, time_limit_s=args.time_limit,
                         fractions=fractions, log=lambda m: print(m, file=sys.stderr, flush=True),
                         fsdp=args.fsdp, of_peak=of_peak)
        print(json.dumps(doc))
        return 0
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    if args.from_json:
        with open(args.from_json) as f:
            docs = json.load(f)
    else:
        docs = []
        for shape in shapes:
            for seq in (int(s) for s in args.seqs.split(",")):
                docs.append(_run_in_child(shape, seq, args.workers, args.time_limit, args.fractions, args.fsdp,
                                          args.of_peak))
                if args.json:
                    _write(args.json, json.dumps(docs, indent=1))
    section = format_section(docs, "python -m benchmarks.real_sizes", args.machine)
    print(section)
    if args.markdown:
        _write(args.markdown, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
