"""GPT-2 (4 layers, width 128, batch 4 x 128, vocab 512) at a few budgets: predicted vs measured peak.

    python -m benchmarks.gpt2_budgets [--budgets 0.6,0.4] [--time-limit 30]

Prints one row per budget: predicted peak, measured peak (live-storage tracker), FLOP overhead, solve
time, status and gap, and the max gradient error against eager.
"""
from __future__ import annotations

import argparse

import torch

import remat_compiler as rc
from remat_compiler.examples.gpt2 import build
from remat_compiler.memory import LiveStorageTracker


def _step(model, call, loss_fn):
    for p in model.parameters():
        p.grad = None
    with LiveStorageTracker() as mem:
        out = call()  # held through backward, as a training loop that logs the output does
        loss_fn(out).backward()
    return mem.peak_bytes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="0.6,0.4")
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args()
    model, inputs, loss_fn = build(n_layer=4, n_embd=128, n_head=4, vocab_size=512, batch=4, seq=128)
    eager_peak, eager = _step(model, lambda: model(**inputs), loss_fn)
    print(f"eager step peak {eager_peak / 2**20:.2f} MiB; CP-SAT time limit {args.time_limit} s, 8 workers")
    print("| budget | budget MiB | predicted MiB | measured MiB | meas/pred | FLOP overhead | "
          "solve s | status | gap | max grad err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for text in args.budgets.split(","):
        budget = float(text)
        m = rc.compile(model, memory_budget=budget, time_limit_s=args.time_limit)
        _step(model, lambda: m(**inputs), loss_fn)
        peak, grads = _step(model, lambda: m(**inputs), loss_fn)
        p = m.plan
        err = max((grads[n] - eager[n]).abs().max().item() for n in eager)
        print(f"| {budget} | {p.budget_bytes / 2**20:.2f} | {p.peak_bytes / 2**20:.2f} | {peak / 2**20:.2f} | "
              f"{peak / p.peak_bytes:.4f} | {p.flop_overhead:.1%} | {p.solve_time_s:.1f} | {p.status} | "
              f"{p.gap:.1%} | {err:.1e} |")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
