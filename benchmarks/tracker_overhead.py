"""What measuring a step with :class:`remat_compiler.memory.LiveStorageTracker` costs: a small GPT-2's
eager step (4 layers, width 64, batch 2 x 16, one torch thread), best of ``--rounds`` rounds of 10
steps, with and without the tracker, and the peak it measured.

    python -m benchmarks.tracker_overhead
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    from remat_compiler.examples.gpt2 import build
    from remat_compiler.memory import LiveStorageTracker

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, inputs, loss_fn = build(n_layer=4, n_embd=64, n_head=4, vocab_size=128, batch=2, seq=16)

    def step():
        loss_fn(model(**inputs)).backward()
    step()
    plain = tracked = float("inf")
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(10):
            step()
        plain = min(plain, (time.perf_counter() - start) / 10)
        start = time.perf_counter()
        for _ in range(10):
            with LiveStorageTracker() as mem:
                step()
        tracked = min(tracked, (time.perf_counter() - start) / 10)
    print("| step | seconds | peak bytes |")
    print("|---|---|---|")
    print(f"| untracked | {plain:.4f} | |")
    print(f"| tracked | {tracked:.4f} | {mem.peak_bytes} |")


if __name__ == "__main__":
    main(sys.argv[1:])
