"""Rank entry point of the multi-rank workloads (``moe2``), spawned by :mod:`benchmarks.run`.

Every rank builds the same seeded MoE stack (keeping its expert shard) on its own tokens and runs
:func:`benchmarks.bench.bench_workload` in lock step with the others: CP-SAT plans and the smallest
feasible budget are computed on rank 0 and broadcast (a plan that differed between ranks would
deadlock the all-to-alls), peaks are the largest over ranks, FLOPs are summed. Rank 0 writes the
result document to ``out_path``.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.bench import BenchOptions, bench_workload
from benchmarks.strategies import Comm
from benchmarks.workloads import WORKLOADS

__all__ = ["DistComm", "run_rank"]


class DistComm(Comm):
    """:class:`benchmarks.strategies.Comm` over the default process group."""

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, broadcast; an error on rank 0 is raised on every rank (none waits forever)."""
        payload: list = [None]
        error = None
        if self.rank == 0:
            try:
                payload = [("ok", fn())]
            except Exception as exc:  # re-raised below, after the other ranks have been told
                error = exc
                payload = [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(payload, src=0)
        status, value = payload[0]
        if error is not None:
            raise error
        if status == "error":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value

    def gather(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def max_int(self, value: int) -> int:
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())


def run_rank(rank: int, world: int, port: int, workload: str, options: dict, out_path: str,
             timeout_s: float) -> None:
    """Join the gloo group, benchmark ``workload`` and (rank 0) write its result as JSON to ``out_path``."""
    torch.set_num_threads(1)  # one core per rank on the 2-core machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = bench_workload(WORKLOADS[workload], BenchOptions(**options), DistComm(), dist.group.WORLD)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
