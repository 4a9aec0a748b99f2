"""Smoke test of the benchmark command: ``python -m benchmarks.run --quick`` on the small MLP chain.

It runs the real command in a subprocess into a temporary folder and checks that RESULTS.md has the
table header and a row for every strategy, and that the Pareto picture is a valid PNG.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from matplotlib import image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.report import TABLE_HEADER  # noqa: E402
from benchmarks.strategies import PYTORCH_BUDGETS  # noqa: E402


def test_quick_benchmark_writes_results_and_picture(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.run", "--quick", "--workloads", "mlp", "--out", str(tmp_path),
           "--time-limit", "1", "--workers", "2", "--rounds", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=85)
    assert proc.returncode == 0, proc.stderr[-3000:]

    text = (tmp_path / "RESULTS.md").read_text()
    assert TABLE_HEADER in text
    rows = [line for line in text.splitlines() if line.startswith("| mlp |")]
    strategies = {line.split("|")[2].strip() for line in rows}
    assert {"eager", "checkpoint", "torch.compile", "remat_compiler"} <= strategies
    settings = {line.split("|")[3].strip() for line in rows if "| torch.compile |" in line}
    assert settings == {f"budget {b}" for b in PYTORCH_BUDGETS}
    remat = [line for line in rows if "| remat_compiler |" in line]
    assert any("@ eager peak" in line for line in remat)
    assert any("min feasible" in line for line in remat)

    doc = json.loads((tmp_path / "data" / "mlp.json").read_text())
    measured = [r for r in doc["rows"] if r["measured_peak_bytes"] is not None]
    assert all(r["flop_ratio"] >= 1.0 - 1e-9 for r in measured)
    assert all(r["max_grad_error"] < 1e-4 for r in measured)
    for r in measured:  # the plans are for the benchmark's own step (outputs dropped): exact
        if r["strategy"] == "remat_compiler":
            assert r["measured_peak_bytes"] == r["predicted_peak_bytes"] <= r["budget_bytes"], r
    eager = next(r for r in measured if r["strategy"] == "eager")
    assert eager["flop_ratio"] == 1.0 and eager["max_grad_error"] == 0.0

    png = tmp_path / "pareto_mlp.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(str(png))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]  # atomic writes leave nothing


def test_inductor_peers_table_and_targets():
    """benchmarks.inductor_peers' table and verdicts, on rows written by hand. Its ``--quick`` run is
    not run here: every row is a fresh process compiling with Inductor (minutes on 2 cores)."""
    from benchmarks.inductor_peers import TABLE_HEADER as PEERS_HEADER, check_targets, format_table

    mib = 2 ** 20

    def row(kind, setting, peak_mib, ratio, **extra):
        # measured by the allocator; the resident set half a MiB above it (the process's other memory)
        return {"workload": "gpt2", "kind": kind, "setting": setting, "status": "ok", "peak_bytes": peak_mib * mib,
                "allocator_peak_bytes": peak_mib * mib, "rss_peak_bytes": int((peak_mib + 0.5) * mib),
                "step_s": 0.1 * ratio, "step_ratio": ratio, "compile_s": 10.0, "max_grad_error": 0.0, **extra}

    remat = dict(backend="inductor", tracked_peak_bytes=None)
    doc = {"workload": "gpt2", "rows": [
        row("eager", "-", 200, 1.0), row("checkpoint", "every block", 60, 1.13),
        row("torch.compile", "budget 0.5", 80, 0.78),
        row("remat inductor", "@ torch.compile budget 0.5 peak", 79, 0.75, budget_bytes=80 * mib,
            predicted_peak_bytes=78 * mib, peer="torch.compile budget 0.5", vs_peer=0.97, **remat),
        row("remat inductor", "@ checkpoint every block peak", 61, 0.9, budget_bytes=60 * mib,
            predicted_peak_bytes=50 * mib, peer="checkpoint every block", recompute_flops=4_429_185_024,
            plan_gap=0.0456, **remat),
        {"workload": "gpt2", "kind": "remat eager", "setting": "@ checkpoint every block peak",
         "status": "infeasible", "note": "needs >= 70 MiB", "budget_bytes": 60 * mib},
    ]}
    table = format_table(doc).splitlines()
    assert table[0] == PEERS_HEADER and len(table) == 2 + len(doc["rows"])
    assert table[5].endswith("| met |") and table[6].endswith("| **not met** |") and table[3].endswith("| - |")
    assert "infeasible: needs >= 70 MiB" in table[7]
    targets = check_targets(doc)
    assert targets[0] == ("- at torch.compile budget 0.5's peak: met, 79.00 MiB (peer 80.00 MiB), step 0.97 of "
                          "the peer's in the same rounds")
    assert "| 0.75 | 0.97 |" in table[5] and "| 0.90 | - |" in table[6]
    assert "| inductor | - |" in table[5] and "| inductor | 4.43 (0.05) |" in table[6]
    # timed beside its peer, a row slower than the peer in the same rounds does not meet its target, even
    # when its ratio to eager (another process's) is below the peer's
    doc["rows"][3]["vs_peer"] = 1.02
    assert check_targets(doc)[0].startswith("- at torch.compile budget 0.5's peak: **not met**")
    assert targets[1].startswith("- at checkpoint every block's peak: **not met**")
    assert "<= 0.85 at checkpoint every block's peak (issue target): **not met**, 0.90" in targets[2]
    assert "**not met**: remat inductor @ checkpoint every block peak 61.00 > 60.00 MiB" in targets[3]
    assert targets[4] == ("- resident set above the budget (the allocator's figure plus the process's other "
                          "memory): remat inductor @ checkpoint every block peak 61.50 > 60.00 MiB")
    assert "**not met** (worst -18.0%, @ checkpoint every block peak)" in targets[5]
    assert "| 79.00 | 79.50 | 78.00 | 0.987 |" in table[5]  # measured, RSS, predicted, predicted / measured
    # rows from before the allocator was measured are read by their resident set
    for r in doc["rows"]:
        r.pop("peak_bytes", None)
    assert "**not met** (worst -18.7%, @ checkpoint every block peak)" in check_targets(doc)[4]


def test_fast_less_y_target_line():
    """Issue 16's target line, on rows written by hand: met when the plan fits the budget at no more
    FLOPs than its graph without recompute (moe_custom's for moe_cpsat, moe_fast's for cpsat)."""
    from benchmarks.report import check_targets

    mib = 2 ** 20

    def row(strategy, setting, peak_mib, ratio, budget_mib=None):
        return {"workload": "moe1", "strategy": strategy, "setting": setting, "status": "optimal", "note": "",
                "budget_bytes": budget_mib and budget_mib * mib, "measured_peak_bytes": peak_mib * mib,
                "predicted_peak_bytes": peak_mib * mib, "flop_ratio": ratio}

    rows = [row("eager", "-", 170, 1.0), row("moe_fast", "-", 116, 1.0), row("moe_custom", "-", 110, 1.0004),
            row("remat_compiler", "@ moe_fast peak - y", 108, 1.0556, 108),
            row("moe_cpsat", "@ moe_fast peak - y", 107, 1.0004, 108)]
    line, = [t for t in check_targets({"workload": "moe1", "rows": rows}) if "issue 16" in t]
    assert line.startswith("- at moe_fast's peak minus every layer's y (108.0 MiB)")
    assert "moe_cpsat met, measured 107.0 MiB at FLOP ratio 1.0004 (no recompute: 1.0004)" in line
    assert "remat_compiler **not met**, measured 108.0 MiB at FLOP ratio 1.0556" in line


def test_real_sizes_section_and_targets():
    """The issue-15 target lines: the halfway plan at seq 8192 within the shape's limit and 1% FLOP gap,
    and at 70B the planner's RSS within 4 GiB; the other lengths are rows, not targets."""
    from benchmarks.real_sizes import GIB, format_section

    def doc(shape, seq, solve_s, gap, rss):
        plans = [{"fraction": f, "label": label, "budget_bytes": 20 * GIB, "peak_bytes": 19 * GIB,
                  "flop_ratio": 1.0, "step_s": 0.5, "solve_s": solve_s, "status": "optimal", "gap": gap}
                 for f, label in ((0.0, "checkpoint's peak"), (0.5, "halfway"))]
        limit = 60.0 if shape == "7b" else 120.0
        return {"shape": shape, "seq": seq, "trace_s": 30.0, "time_limit_s": limit, "workers": 2,
                "no_recompute": {"peak_bytes": 40 * GIB}, "checkpoint": {"peak_bytes": 15 * GIB, "flop_ratio": 1.2},
                "plans": plans, "planner_peak_rss_bytes": rss}

    stamped = {**doc("7b", 8192, 55.0, 0.009, GIB), "stamped": True, "trace_s": 4.0, "baselines_s": 0.5}
    text = format_section([doc("7b", 4096, 99.0, 0.5, GIB), stamped, doc("70b", 8192, 110.0, 0.0, 5 * GIB)],
                          "cmd", "idle")
    verdicts = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 2  # seq 4096 is a row only
    assert verdicts[0].startswith("- 7b seq 8192") and verdicts[0].endswith("the solve 55.0 s.")
    # the target is end to end: 4 + 0.5 + 55 s within 60 s; at 70B 30 + 110 s is over 120 s
    assert "planned in 59.5 s" in verdicts[0] and "planned in 140.0 s" in verdicts[1]
    assert "**met**" in verdicts[0] and "stamped" in verdicts[0] and "stamped" not in verdicts[1]
    assert "planner peak RSS 5.00 GiB" in verdicts[1] and "**not met**" in verdicts[1]
    assert sum(line.startswith("| 7b |") for line in text.splitlines()) == 4


def test_each_inductor_variant_changes_its_one_step_and_restores_it():
    """benchmarks.inductor_variants: inside a variant the pipeline lacks exactly its step (the index
    merge is out of the pass list for "unmerged index work", nothing is stored for "unstored shared
    values"); after it, everything is back."""
    from remat_compiler import passes
    import remat_compiler.inductor.backend as backend
    import remat_compiler.inductor.compile as inductor_compile
    import remat_compiler.module as module
    from benchmarks.inductor_variants import VARIANTS, variant

    def steps():
        return passes.PASSES, backend.fusing, module.annotate_joint, inductor_compile.store_shared_values

    pass_list, fusing, annotate, store = before = steps()
    with variant("unmerged index work"):
        assert [p.name for p in passes.PASSES] == [p.name for p in pass_list if p.name != "merge_repeated_index_work"]
        assert steps()[1:] == before[1:]
    with variant("unstored shared values"):
        assert inductor_compile.store_shared_values is not store and inductor_compile.store_shared_values(None) == []
        assert steps()[:3] == before[:3]
    for name in VARIANTS:
        with variant(name):
            pass
        assert steps() == before, name


def test_round_robin_reverses_its_order_every_other_round():
    """No runner is always timed right after the same one: round k runs the runners forward when k is
    even and backward when it is odd, and each runner's times stay in its own row."""
    import torch

    from benchmarks.measure import Runner, time_round_robin

    calls = []

    def runner(name):
        w = torch.ones((), requires_grad=True)
        return Runner(name, "-", lambda: (calls.append(name), w * 2)[1], [w])

    times = time_round_robin([runner("a"), runner("b"), runner("c")], (), {}, 4)
    assert calls == list("abc" "cba" "abc" "cba")
    assert [len(t) for t in times] == [4, 4, 4] and all(s > 0 for t in times for s in t)


def _faults_allocating(n: int) -> list[int]:
    """Page faults of allocating, filling and freeing a 1 MiB buffer ``n`` times after a warm-up; then
    the same after :func:`benchmarks.measure.keep_freed_memory` (run by the test below in a process
    started with RSS_ENV)."""
    import resource

    import torch

    from benchmarks.measure import keep_freed_memory

    def faults() -> int:
        for _ in range(3):  # warm, as the timed steps are: the heap grows to hold the buffer
            torch.ones(2**18)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            torch.ones(2**18)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    mapped = faults()
    kept = keep_freed_memory()
    return [mapped, int(kept), faults()]


def test_keep_freed_memory_stops_the_page_faults_rss_env_adds_to_every_step():
    """Under RSS_ENV (the resident-peak measurement's) every 1 MiB buffer is a fresh mapping: 256
    page faults each. After keep_freed_memory (what inductor_peers runs before timing) the buffer is
    reused from malloc's heap once the heap has grown to hold it, as in a process without RSS_ENV: no
    faults but those of the heap growing once more now and then (one buffer's 256 in some runs),
    never one buffer's worth per allocation."""
    from benchmarks.rss_check import run_fresh

    mapped, kept, after = run_fresh("tests.test_benchmarks:_faults_allocating", 20, timeout_s=120)
    assert kept == 1
    assert mapped >= 20 * 256
    assert after <= 2 * 256


def test_fsdp_peers_table_gives_each_ratio_and_says_which_peer_does_not_run():
    """The sharded peers' table: FLOPs of both (or "not counted" where the flop counter cannot see the
    peer's kernels), what each recomputes, the step-time ratio ours / peer, the units kept and
    re-gathered and the bytes each re-gathers ("-" for the peer in files made before it was recorded);
    a peer that failed is a row saying so, not a missing row."""
    from benchmarks.fsdp_peers import PEERS, format_table

    row = {"workload": "gpt2", "peer": PEERS[0], "rank": 0, "peer_peak": 2_000_000, "budget": 2_000_100,
           "predicted": 1_900_000, "measured": 1_900_000, "peer_flops": 3.0e9, "compiled_flops": 2.5e9,
           "regather_bytes": 4096, "peer_regather_bytes": 8192, "peer_step_s": 0.2, "compiled_step_s": 0.19,
           "peer_recompute_flops": 1.0e9, "recompute_flops": 0.5e9,
           "units": {"(root)": "kept", "transformer.h.0": "re-gathered"}}
    compiled_peer = {**row, "peer": PEERS[3], "peer_flops": None, "peer_recompute_flops": None}
    failed = {"workload": "mixtral", "peer": PEERS[3], "rank": 1, "error": "Unsupported: data-dependent op"}
    older = {k: v for k, v in row.items() if k != "peer_regather_bytes"}
    lines = format_table([row, compiled_peer, failed, older]).splitlines()
    assert len(lines) == 6
    assert "| 3.000 G / 2.500 G | 1.000 G / 0.500 G | 8,192 / 4,096 | 0.95 | 1 / 1 |" in lines[2]
    assert "| not counted / 2.500 G | not counted / 0.500 G |" in lines[3]
    assert "does not run: Unsupported: data-dependent op" in lines[4] and lines[4].count("|") == lines[0].count("|")
    assert "| 1.000 G / 0.500 G | - / 4,096 |" in lines[5]


def test_real_sizes_names_an_infeasible_budget_and_the_floor_found():
    """A budget below every plan found (issue 33's 0.3 of the no-recompute peak at 70B, seq 8192) is a
    row naming the smallest plan found and whether it is proven, not a missing point."""
    from benchmarks.real_sizes import GIB, format_markdown

    doc = {"shape": "70b", "seq": 8192, "trace_s": 10.0, "time_limit_s": 120.0, "planner_peak_rss_bytes": GIB,
           "no_recompute": {"peak_bytes": 273 * GIB}, "checkpoint": {"peak_bytes": 130 * GIB, "flop_ratio": 1.24},
           "plans": [{"fraction": None, "label": "0.3 of no-recompute", "budget_bytes": 82 * GIB, "infeasible": True,
                      "min_feasible_bytes": 130 * GIB, "proven": False, "solve_s": 30.0, "solve_limit_s": 108.0}]}
    (row,) = format_markdown([doc]).splitlines()[2:]
    assert "0.3 of no-recompute: 82.00 | infeasible: the smallest plan found is 130.00 (not proven)" in row
    assert row.count("|") == 13  # the table's 12 columns


def test_fsdp_peers_counts_what_fsdp2_gathers_again():
    """FSDP2 all-gathers again in backward every unit that reshards after forward, a rank sending its
    padded shard to each other rank: under reshard_after_forward=True the root too, under its
    default (None) every unit but the root, under False none."""
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    from benchmarks.fsdp_peers import peer_regather_bytes
    from remat_compiler.fsdp.planning import fake_process_group

    sent = {}
    with fake_process_group(4):
        for reshard in (True, None, False):
            model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 3), nn.Linear(3, 2))
            kwargs = {} if reshard is None else {"reshard_after_forward": reshard}
            for block in model[:2]:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)  # the root holds the last Linear
            model._get_fsdp_state()._lazy_init()  # as the first forward does: the root's setting is decided
            sent[reshard] = peer_regather_bytes(model)
    # padded shards on 4 ranks: weight rows ceil(10/4)=3 x 6 and bias 3; 1 x 10 and 1; 1 x 3 and 1
    blocks = 3 * 4 * ((3 * 6 + 3) + (1 * 10 + 1))
    assert sent == {True: blocks + 3 * 4 * (1 * 3 + 1), None: blocks, False: 0}
