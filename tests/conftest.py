"""The suite's set-up: the import path, one torch thread, and the files' order (the helpers to step,
measure and compare a model are in helpers.py)."""
from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# One torch thread per test process, and the same for the processes tests spawn: the README's command
# runs two workers on a 2-core machine, and two OpenMP teams of two threads there wait on each other at
# every parallel op (measured on a loaded machine: a tiny Qwen2 eager step, 17 ms on one thread, 1.49 s
# on two).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# Likewise CP-SAT: a solve given no ``num_workers`` runs 8 search threads by default, and those on two
# cores starve the other worker's tracing. One worker here, in this process and the ones it spawns:
# each of the suite's two processes then holds one core whether it traces or solves (one run each, not
# interleaved, on a machine whose speed drifts: 8 threads 650 s, 2 threads 446 s, 1 thread 398 s, every
# test passing; the solves' own time summed over the suite moved from 235 s to 209 s, as the graphs are
# small). Tests about the worker count pass ``num_workers`` themselves.
os.environ.setdefault("REMAT_COMPILER_CPSAT_WORKERS", "1")

# The README's command runs the files on two workers (``-n 2 --dist loadfile``), handed out in
# collection order: with the longest files first, neither worker is left running one alone at the end.
# Measured by --durations=0 (session 25: test_zoo.py 113 s, test_moe_compile.py and test_moe_choice.py
# 77 s, test_dynamic_lengths.py 57 s, test_fsdp.py 54 s, ... summed per file; the files below 12 s keep
# their order). The two files that spawn gloo ranks go first and one after the other on the same worker
# (test_fsdp.py's one job, then test_moe_compile.py's two), while the other runs test_zoo.py. With
# both files' ranks on the 2 cores at once the three jobs took 34, 46 and 30 s and the suite 558 s;
# apart, 29, 34 and 19 s and 445 s (idle machine, one run each).
LONGEST_FIRST = ("test_fsdp.py", "test_zoo.py", "test_moe_compile.py", "test_moe_choice.py",
                 "test_dynamic_lengths.py", "test_blockbound.py",
                 "test_inductor.py", "test_cli.py", "test_hf_combine_choice.py",
                 "test_optimality.py", "test_users_third_round.py", "test_choice_model_agrees.py",
                 "test_gpt2.py", "test_plan_cache.py", "test_rerun.py", "test_meta.py",
                 "test_cli_hf.py", "test_determinism.py", "test_loss_fusion.py",
                 "test_benchmarks.py", "test_fuzz.py", "test_stamp.py", "test_check.py",
                 "test_hf_fused_combine.py", "test_compile_api.py")


def pytest_configure(config):
    # xdist's loadfile scheduler re-sorts the files by their number of tests unless told not to, which
    # put the few long tests of test_moe_compile.py and test_moe_custom_peak.py last; keep the order above
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
