"""Regenerate benchmarks/RESULTS.md and one Pareto picture per workload.

Usage::

    python -m benchmarks.run                                  # every workload, full size
    python -m benchmarks.run --workloads gpt2,mixtral --time-limit 25
    python -m benchmarks.run --quick --workloads mlp --out /tmp/bench

Each workload's rows are written to ``OUT/data/<workload>.json`` as soon as it finishes; RESULTS.md is
then rebuilt from every document in ``OUT/data`` (so running one workload updates its section and
keeps the others), and ``OUT/pareto_<workload>.png`` is drawn for the workloads just run. Every file is
written atomically. Multi-rank workloads (``moe2``) run on gloo ranks spawned here, bounded by
``--dist-timeout``. ``scale`` plans GPT-2 at 12 and 48 layers without running it (plan-time targets).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import fields

import torch

from benchmarks.bench import BenchOptions, bench_workload
from benchmarks.report import atomic_write_text, plot_pareto_measured
from benchmarks.scale import bench_plan_scale
from benchmarks.workloads import WORKLOADS

#: Every workload name: the measured ones, then ``scale`` (GPT-2 at 12 and 48 layers, planned only).
NAMES = (*WORKLOADS, "scale")
__all__ = ["main", "run_workload", "run_spawned", "load_results"]

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(name: str, opts: BenchOptions, timeout_s: float) -> dict:
    """Run a multi-rank workload on freshly spawned gloo ranks; never wait longer than ``timeout_s``.

    Raises
    ------
    RuntimeError
        If a rank fails, or the ranks are still running at the deadline (they are terminated).
    """
    from benchmarks.dist_worker import run_rank

    spec = WORKLOADS[name]
    options = {f.name: getattr(opts, f.name) for f in fields(BenchOptions) if f.name != "log"}
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=run_rank, args=(rank, spec.world_size, port, name, options, out_path,
                                                    timeout_s))
                 for rank in range(spec.world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{name}: a rank failed with exit code {failed}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: ranks still running after {timeout_s:.0f} s; stopped")
                time.sleep(0.2)
            codes = [p.exitcode for p in procs]
            if codes != [0] * len(procs):
                raise RuntimeError(f"{name}: rank exit codes {codes}")
            with open(out_path, encoding="utf-8") as f:
                return json.load(f)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(timeout=10)


def run_workload(name: str, opts: BenchOptions, dist_timeout_s: float) -> dict:
    """One workload's result document, in this process or on spawned ranks."""
    if name == "scale":
        return bench_plan_scale(opts)
    spec = WORKLOADS[name]
    if spec.world_size > 1:
        return run_spawned(name, opts, dist_timeout_s)
    return bench_workload(spec, opts)


def load_results(data_dir: str) -> list[dict]:
    """Every result document in ``data_dir``, in the order of :data:`NAMES` (others after)."""
    docs = {}
    if os.path.isdir(data_dir):
        for fname in sorted(os.listdir(data_dir)):
            if fname.endswith(".json") and not fname.startswith("."):
                with open(os.path.join(data_dir, fname), encoding="utf-8") as f:
                    doc = json.load(f)
                docs[doc["workload"]] = doc
    order = [w for w in NAMES if w in docs] + sorted(set(docs) - set(NAMES))
    return [docs[w] for w in order]


def code_version() -> str:
    """Which code the numbers come from: ``$REMAT_BENCH_CODE_VERSION`` if set, else the checkout's commit
    (with a remark when remat_compiler/ or passes/ have local changes), else ``"unknown"``."""
    if os.environ.get("REMAT_BENCH_CODE_VERSION"):
        return os.environ["REMAT_BENCH_CODE_VERSION"]
    root = os.path.dirname(HERE)
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "remat_compiler", "passes"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"commit {sha}" + (" with local changes in remat_compiler/ or passes/" if dirty else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(NAMES),
                   help=f"comma-separated, from {','.join(NAMES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="shrunk workloads, short limits (smoke run, tests)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="each solve's time limit in seconds, for the whole solve (25; quick 5)")
    p.add_argument("--workers", type=int, default=8, help="CP-SAT workers (default 8)")
    p.add_argument("--objective", choices=("flops", "runtime"), default="flops",
                   help="CP-SAT's recompute cost (default flops: what the FLOP ratio counts)")
    p.add_argument("--rounds", type=int, default=None, help="timed steps per strategy (7; quick 3)")
    p.add_argument("--out", default=HERE, help="output folder (default: benchmarks/)")
    p.add_argument("--dist-timeout", type=float, default=None,
                   help="seconds a multi-rank workload may take before it is stopped (3600; quick 300)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; known: {', '.join(NAMES)}")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    opts = BenchOptions(quick=args.quick,
                        time_limit_s=args.time_limit or (5.0 if args.quick else 25.0),
                        num_workers=args.workers, objective=args.objective,
                        rounds=args.rounds or (3 if args.quick else 7),
                        fractions=(0.5,) if args.quick else (0.75, 0.5, 0.35))
    dist_timeout = args.dist_timeout or (300.0 if args.quick else 3600.0)
    data_dir = os.path.join(args.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    version = code_version()
    failures = []
    for name in names:
        t0 = time.perf_counter()
        try:
            result = run_workload(name, opts, dist_timeout)
        except RuntimeError as exc:  # a spawned workload that failed or timed out: report, go on
            failures.append(str(exc))
            print(f"[{name}] FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        result["command"] = command.strip()
        result["code_version"] = version
        atomic_write_text(os.path.join(data_dir, f"{name}.json"), json.dumps(result, indent=1) + "\n")
        if name != "scale":
            plot_pareto_measured(result, os.path.join(args.out, f"pareto_{name}.png"))
        # the page of every benchmark's current figures, this run's and those other commands saved
        # in data/ (benchmarks.results_page)
        from benchmarks.results_page import render_page  # it reads inductor_peers, which imports this module

        atomic_write_text(os.path.join(args.out, "RESULTS.md"), render_page(data_dir))
        print(f"[{name}] done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    for msg in failures:
        print(f"FAILED: {msg}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
