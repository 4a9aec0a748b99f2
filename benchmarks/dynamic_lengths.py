"""Issue 36's target for dynamic padding: a loop of steps at random lengths, planned once.

    python -m benchmarks.dynamic_lengths                      # 50 steps, lengths in [16, 512], gpt2 and llama
    python -m benchmarks.dynamic_lengths --steps 10 --quick   # the quick shapes, lengths in [16, 64]
    python -m benchmarks.dynamic_lengths --backend inductor   # Inductor compiles the range's plan once

Each workload is compiled with ``max_seq_len`` at the top of the range (and the budget a fraction of
the no-recompute peak at that bound, resolved there once); then ``--steps`` training steps run at
lengths drawn uniformly from the range (one seeded generator), the first at a random length too.
Per step it records the wall time spent tracing and planning (``CompiledModule._first_call``: zero
for a step the range's plan serves), the step's wall time, and its peak measured with
:class:`remat_compiler.LiveStorageTracker` (with ``--backend inductor``, Inductor's own buffers
shown to it by :func:`remat_compiler.inductor.watch`; the first step's is the backend's own
first-step measure, taken while the code is being made). The table gives the first call's planning time, the
planning time of all later steps (the target: <= 10% of the first call's), how many solves were
made, and the largest measured peak against the budget (the target: every step <= budget).

Workloads: ``gpt2`` (:data:`benchmarks.workloads.GPT2`: 6 layers, width 256, batch 4) and ``llama``
(:data:`benchmarks.gpu_check.LLAMA`: 4 layers, hidden 512, batch 4), both with their position
tables at least the bound.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch


def _gpt2(quick: bool, bound: int):
    from benchmarks.workloads import build_gpt2

    model, _, inputs = build_gpt2(quick, seq=bound)
    return model.train(), inputs["input_ids"].shape[0], model.config.vocab_size


def _llama(quick: bool, bound: int):
    import transformers
    from benchmarks.gpu_check import LLAMA, LLAMA_QUICK, llama_config

    c = LLAMA_QUICK if quick else LLAMA
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(c, bound))
    return model.train(), c["batch"], c["vocab"]


WORKLOADS = {"gpt2": _gpt2, "llama": _llama}


def run(name: str, *, quick: bool, steps: int, low: int, high: int, budget: float, time_limit_s: float,
        seed: int, backend: str = "eager") -> dict:
    """Compile one workload for lengths up to ``high`` and step it at random lengths; the figures."""
    import contextlib

    import remat_compiler as rc
    from remat_compiler.api import CompiledModule
    from remat_compiler.inductor import watch

    model, batch, vocab = WORKLOADS[name](quick, high)
    m = rc.compile(model, memory_budget=budget, max_seq_len=high, time_limit_s=time_limit_s, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    planning, first_call = [], CompiledModule._first_call

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return first_call(self, *args, **kwargs)
        finally:
            planning.append(time.perf_counter() - t0)
    CompiledModule._first_call = timed
    rnd = random.Random(seed)
    rows = []
    try:
        for i in range(steps):
            length = rnd.randint(low, high)
            ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed + i))
            before = len(planning)
            t0 = time.perf_counter()
            mem = rc.LiveStorageTracker()
            with contextlib.ExitStack() as stack:
                for e in m._entries.values():  # every entry's Inductor code: any may serve this call
                    if e.planned is not None and e.planned.backend == "inductor":
                        stack.enter_context(watch(mem, e.planned.inductor))
                stack.enter_context(mem)
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
            step_s = time.perf_counter() - t0
            peak = mem.peak_bytes
            if len(planning) > before and m.planned.backend == "inductor":
                # the code did not exist when the step began: the backend's own measure of it
                peak = m.planned.first_step_bytes if m.planned.first_step_bytes is not None else peak
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append((length, sum(planning[before:]), step_s, peak))
    finally:
        CompiledModule._first_call = first_call
    limit = m.plan.budget_bytes
    over = [(length, peak) for length, _, _, peak in rows if peak > limit]
    return {"name": name, "steps": steps, "first_plan_s": rows[0][1], "first_step_s": rows[0][2],
            "later_plan_s": sum(r[1] for r in rows[1:]), "replans": sum(1 for r in rows[1:] if r[1] > 0),
            "median_step_s": statistics.median(r[2] for r in rows[1:]) if steps > 1 else float("nan"),
            "budget_bytes": limit, "plan_peak_bytes": m.plan.peak_bytes,
            "max_peak_bytes": max(r[3] for r in rows), "over": over,
            "max_peak_length": max(rows, key=lambda r: r[3])[0], "lengths": (min(r[0] for r in rows),
                                                                            max(r[0] for r in rows))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt2,llama", help="comma-separated: " + ",".join(WORKLOADS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--low", type=int, default=16)
    p.add_argument("--high", type=int, default=None, help="the bound (default 512; 64 with --quick)")
    p.add_argument("--budget", type=float, default=0.6, help="fraction of the no-recompute peak at the bound")
    p.add_argument("--time-limit", type=float, default=30.0, help="CP-SAT's time_limit_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager")
    a = p.parse_args(argv)
    high = a.high or (64 if a.quick else 512)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = [run(w, quick=a.quick, steps=a.steps, low=a.low, high=high, budget=a.budget,
                   time_limit_s=a.time_limit, seed=a.seed, backend=a.backend) for w in a.workloads.split(",")]
    mib = 2 ** 20
    print(f"\n{a.steps} steps at lengths in [{a.low}, {high}] (max_seq_len={high}), budget {a.budget} of the "
          f"no-recompute peak at the bound, time_limit_s={a.time_limit}, backend={a.backend!r}"
          f"{', quick shapes' if a.quick else ''}\n")
    print("| workload | first call: planning s | later steps: planning s (re-plans) | later / first | "
          "median step s | budget MiB | plan peak MiB | max measured MiB (at length) | steps over budget |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in results:
        ratio = r["later_plan_s"] / r["first_plan_s"]
        ok &= ratio <= 0.10 and not r["over"]
        print(f"| {r['name']} | {r['first_plan_s']:.1f} | {r['later_plan_s']:.2f} ({r['replans']}) | {ratio:.1%} | "
              f"{r['median_step_s']:.2f} | {r['budget_bytes'] / mib:.2f} | {r['plan_peak_bytes'] / mib:.2f} | "
              f"{r['max_peak_bytes'] / mib:.2f} ({r['max_peak_length']}) | {len(r['over'])} |")
    print(f"\ntargets (later planning <= 10% of the first call's, every step <= budget): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
