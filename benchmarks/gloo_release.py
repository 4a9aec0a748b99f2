"""How often a sharded step on gloo measures above its plan: the collectives' release, checked.

::

    python -m benchmarks.gloo_release                  # 2 ranks, 1,000 steps each, one busy process beside
    python -m benchmarks.gloo_release --steps 200 --load 0

Two gloo ranks compile a chain of four Linear+GELU blocks, each a ``fully_shard`` unit, at 0.6 of its
no-recompute peak (one unit re-gathered), then run ``--steps`` steps each measured by
:class:`remat_compiler.AllocatorPeak`. ``--load`` processes spin on the CPU meanwhile: a collective's
work then finishes on gloo's thread while this one runs, which is where its tensors used to be freed
late (after the graph had let go of them, at the next GIL switch; see
:func:`remat_compiler.collectives.release_collective_inputs`). One row a rank: steps measured, steps
at the plan's peak, above it, below it, and the largest excess in bytes.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

WIDTH = 64
BUDGET = 0.6


def _spin() -> None:
    while True:
        pass


def _rank(rank: int, world: int, port: int, steps: int, out) -> None:
    from torch.distributed.fsdp import fully_shard

    import remat_compiler
    from remat_compiler.memory import AllocatorPeak

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                                for _ in range(4)])
        for block in model:
            fully_shard(block)
        fully_shard(model)
        gen = torch.Generator().manual_seed(100 + rank)
        x, g = torch.randn(64, WIDTH, generator=gen), torch.randn(64, WIDTH, generator=gen)
        compiled = remat_compiler.compile(model, memory_budget=BUDGET, time_limit_s=5, num_workers=1)
        def step():  # the output's gradient made in the step, as the plan counts it
            compiled(x).backward(g.clone())

        step()  # traces and plans
        predicted = compiled.plan.peak_bytes
        excess = []
        for _ in range(steps):
            for p in compiled.parameters():
                p.grad = None
            with AllocatorPeak() as mem:
                step()
            excess.append(mem.peak_bytes - predicted)
        units = [u["choice"] for u in compiled.plan.extras["fsdp_units"]]
        out.put((rank, predicted, units, excess))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    from benchmarks.run import _free_port

    parser = argparse.ArgumentParser(prog="python -m benchmarks.gloo_release", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="measured steps a rank (default 1000)")
    parser.add_argument("--load", type=int, default=1, help="busy processes beside the ranks (default 1)")
    opts = parser.parse_args(argv)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(opts.load)]
    for s in spinners:
        s.start()
    try:
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        ranks = mp.start_processes(_rank, args=(2, _free_port(), opts.steps, out), nprocs=2, join=False,
                                   start_method="spawn")
        rows = sorted(out.get() for _ in range(2))  # read before the join: a full pipe would block the ranks
        while not ranks.join():
            pass
    finally:
        for s in spinners:
            s.terminate()
    print(f"4 Linear+GELU units (width {WIDTH}), budget {BUDGET} of the no-recompute peak, "
          f"{opts.load} busy process(es) beside the 2 ranks; units: {rows[0][2]}")
    print("| rank | plan's peak | steps | at the plan | above | below | largest excess (bytes) |")
    print("|---|---|---|---|---|---|---|")
    for rank, predicted, _, excess in rows:
        above, below = sum(e > 0 for e in excess), sum(e < 0 for e in excess)
        print(f"| {rank} | {predicted:,} | {len(excess)} | {len(excess) - above - below} | {above} | {below} "
              f"| {max(excess):,} |")


if __name__ == "__main__":
    main()
