"""Spawn gloo ranks on localhost for a test, bounded in time: a failing or hanging rank fails the test."""
from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp

__all__ = ["free_port", "spawn_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(run_rank, world: int, out_dir, timeout_s: float, start_method: str = "fork") -> None:
    """Run ``run_rank(rank, world, port, out_dir)`` in ``world`` processes; assert all exit 0.

    The ranks are forked by default: they start with the test process's imports (torch, transformers
    and the library: about 5 s of CPU a rank when spawned), as DataLoader workers do on Linux. The
    test process has no process group and no CUDA, and its CP-SAT threads are joined when a solve
    returns, so nothing a rank needs is lost in the fork. ``start_method="spawn"`` starts them fresh.
    """
    ctx = mp.get_context(start_method)
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(rank, world, port, str(out_dir))) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.is_alive() for p in procs):
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not failed, f"a rank failed with exit code {failed}"
            assert time.monotonic() < deadline, f"{world} ranks still running after {timeout_s} s"
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world, f"rank exit codes {codes}"
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
