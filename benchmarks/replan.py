"""The Inductor backend's first call when its first plan's code walks above the budget (issue 36,
item 3: "nothing is traced twice"): the test GPT-2 (4 layers, width 128, batch 4 x 128) compiled at
the budget the eager backend's plan at 0.6 of the no-recompute peak was made under, with the walk of
the first plan's code made to read 1 byte over it, so the backend re-plans once. Each round: the
first call's seconds, how many times AOTAutograd captured the step (its first stage), and how many
plans' code was walked.

    python -m benchmarks.replan --rounds 4

To compare with the backend before the re-plan reused its capture (ecc4b1d), run the same command
with that commit's ``remat_compiler/inductor/backend.py`` in place, one round of each in turn.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["first_call_with_replan", "main"]


def first_call_with_replan() -> dict:
    """One first call as described above: ``{"seconds", "captures", "walks", "runs_as"}``."""
    import torch._functorch.aot_autograd as aot_autograd
    import torch._functorch._aot_autograd.graph_compile as graph_compile

    import remat_compiler as rc
    import remat_compiler.inductor.compile as inductor_compile
    from remat_compiler.examples.gpt2 import build

    model, inputs, loss_fn = build(n_layer=4, n_embd=128, n_head=4, vocab_size=512, batch=4, seq=128)
    eager = rc.compile(model, memory_budget=0.6, time_limit_s=2)
    loss_fn(eager(**inputs)).backward()
    budget = eager.plan.budget_bytes
    captures, walks = [0], []
    capture, walk = graph_compile.aot_stage1_graph_capture, inductor_compile.compiled_peak

    def counted(*args, **kwargs):
        captures[0] += 1
        return capture(*args, **kwargs)

    def over_once(*args, **kwargs):
        peak = walk(*args, **kwargs)
        walks.append(peak.peak_bytes)
        if len(walks) == 1:
            peak.record("forward:pretend", budget + 1)
        return peak
    graph_compile.aot_stage1_graph_capture = aot_autograd.aot_stage1_graph_capture = counted
    inductor_compile.compiled_peak = over_once
    try:
        m = rc.compile(model, memory_budget=budget, backend="inductor", time_limit_s=2)
        start = time.perf_counter()
        loss_fn(m(**inputs)).backward()
        seconds = time.perf_counter() - start
    finally:
        graph_compile.aot_stage1_graph_capture = aot_autograd.aot_stage1_graph_capture = capture
        inductor_compile.compiled_peak = walk
    return {"seconds": seconds, "captures": captures[0], "walks": len(walks), "runs_as": m.planned.backend}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1, help="first calls, each of a fresh model")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| round | first call s | captures | plans walked | runs as |")
    print("|---|---|---|---|---|")
    for i in range(args.rounds):
        r = first_call_with_replan()
        print(f"| {i + 1} | {r['seconds']:.1f} | {r['captures']} | {r['walks']} | {r['runs_as']} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
