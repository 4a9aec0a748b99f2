"""The bandwidth a collective gets between two gloo ranks on this machine: what the CPU cost model's
``link_bytes_per_s`` (:class:`passes.costs.CostModel`) stands for.

::

    python -m benchmarks.link_rate            # a table: bytes gathered, bytes a rank sends, ms, GB/s sent

Two processes (one torch thread each, as the FSDP2 benchmark's ranks run) all-gather a flat buffer
of each size with ``all_gather_into_tensor``, 5 times unmeasured, then 40 times timed on rank 0.
The rate is of the bytes a rank sends (its shard to the other rank: half the gathered bytes), the
unit the cost model charges a collective in (:func:`passes.costs.sent_bytes`).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (100_000, 1_579_520, 6_000_000)  # bytes gathered; 1,579,520: one GPT-2 block of the FSDP2 benchmark


def _rank(rank: int, world: int, port: int, sizes: tuple, rounds: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for nbytes in sizes:
        shard = torch.randn(nbytes // 4 // world)
        gathered = torch.empty(shard.numel() * world)
        for _ in range(5):
            dist.all_gather_into_tensor(gathered, shard)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            dist.all_gather_into_tensor(gathered, shard)
        seconds = (time.perf_counter() - t0) / rounds
        if rank == 0:
            out.put((gathered.numel() * 4, seconds))
    dist.destroy_process_group()


def main(argv=None) -> None:
    from benchmarks.run import _free_port

    parser = argparse.ArgumentParser(prog="python -m benchmarks.link_rate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    opts = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(2, _free_port(), SIZES, opts.rounds, out), nprocs=2, start_method="spawn")
    print("| bytes gathered | bytes a rank sends | ms per all-gather | GB/s sent |\n|---|---|---|---|")
    for _ in SIZES:
        nbytes, seconds = out.get()
        sent = nbytes // 2  # 2 ranks: each sends its shard
        print(f"| {nbytes:,} | {sent:,} | {seconds * 1e3:.2f} | {sent / seconds / 1e9:.2f} |")


if __name__ == "__main__":
    main()
