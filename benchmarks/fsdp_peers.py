"""FSDP2's peers against remat_compiler's plan at each peer's measured per-rank peak (issue 35's targets),
on 2 gloo ranks (CPU), one process per rank.

The workload: a default-config ``LlamaForCausalLM`` with its sizes shrunk (hidden 128, 4 layers, loss
inside via labels), batch 2 x seq 256 per rank, fp32, every decoder layer a ``fully_shard`` unit and
then the root. Peers, each run eagerly by FSDP2:

- ``reshard_after_forward=True`` (FSDP2's default): every layer gathered again in backward;
- ``reshard_after_forward=False``: every layer kept gathered from forward to backward;
- ``True`` + activation checkpointing of every layer (transformers' ``gradient_checkpointing_enable``).

Each peer's per-rank peak is measured over steps 2..(STEPS) with :class:`ResizeAwareTracker`
(:class:`~remat_compiler.memory.LiveStorageTracker` that also counts storages FSDP2 re-allocates and frees
with ``untyped_storage().resize_``, which no dispatch mode sees), the larger rank's taken. Then
``remat_compiler.compile`` of the same sharded model under that peak as its budget: predicted and
measured peak per rank, recomputed FLOPs, bytes re-gathered (per rank, the all-gather inputs sent
again). Step times are the medians of the rounds, peer and compiled interleaved in one process per
rank (CPU times on 2 shared cores: indicative); FLOPs and bytes are exact.

    python -m benchmarks.fsdp_peers            # about 3 minutes on 2 cores; prints the table
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from remat_compiler.memory import LiveStorageTracker

__all__ = ["ResizeAwareTracker", "run_rank", "main"]

SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4)
BATCH, SEQ, STEPS, ROUNDS = 2, 256, 3, 3
PEERS = ("reshard_after_forward=True", "reshard_after_forward=False", "True + checkpoint every layer")


class ResizeAwareTracker(LiveStorageTracker):
    """LiveStorageTracker that also counts a storage grown with ``UntypedStorage.resize_`` inside
    the block (FSDP2's unshard re-allocates its unsharded parameters so) until it is resized to 0."""

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, nbytes):
            key, before = storage._cdata, storage.nbytes()
            out = tracker._orig_resize(storage, nbytes)
            if key in tracker._live:
                tracker.current_bytes += nbytes - tracker._live[key]
                tracker._live[key] = nbytes
                if nbytes == 0:
                    tracker._live.pop(key)
            elif nbytes > before and storage.device.type != "meta":
                tracker._live[key] = nbytes - before
                tracker.current_bytes += nbytes - before
            tracker.peak_bytes = max(tracker.peak_bytes, tracker.current_bytes)
            return out
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)


def _model(peer: str):
    import transformers
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    if peer == PEERS[2]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reshard = peer != PEERS[1]
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def _step(model, ids):
    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def _measure(step) -> tuple[int, float]:
    peaks, times = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        with ResizeAwareTracker() as mem:
            step()
        times.append(time.perf_counter() - t0)
        if i:
            peaks.append(mem.peak_bytes)
    return max(peaks), statistics.median(times[1:])


def _flops(step) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        step()
    return fc.get_total_flops()


def _max_over_ranks(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import remat_compiler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=gen)
    rows = []
    base_flops = None
    for peer in PEERS:
        model = _model(peer)
        step = _step(model, ids)
        step()
        peak, _ = _measure(step)
        budget = _max_over_ranks(peak)
        peer_flops = _flops(step)
        cm = remat_compiler.compile(_model(PEERS[0]), memory_budget=budget, hold_outputs=False,
                                    time_limit_s=20, num_workers=1)
        cstep = _step(cm, ids)
        cstep()
        plan = cm.plan
        base_flops = plan.baseline_flops
        times = {"peer": [], "compiled": []}
        cpeaks = []
        for _ in range(ROUNDS):  # interleaved
            times["peer"].append(_measure(step)[1])
            p, t = _measure(cstep)
            times["compiled"].append(t)
            cpeaks.append(p)
        rows.append({"peer": peer, "rank": rank, "peer_peak": peak, "budget": budget,
                     "predicted": plan.peak_bytes, "measured": max(cpeaks),
                     "peer_step_s": statistics.median(times["peer"]),
                     "compiled_step_s": statistics.median(times["compiled"]),
                     "peer_flops": peer_flops, "compiled_flops": plan.baseline_flops + plan.recompute_flops,
                     "recompute_flops": plan.recompute_flops, "regather_bytes": plan.recompute_comm_bytes,
                     "units": {u["unit"]: u["choice"] for u in plan.extras.get("fsdp_units", [])}})
    torch.save({"rows": rows, "base_flops": base_flops}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import dist_spawn

    with tempfile.TemporaryDirectory() as out:
        dist_spawn.spawn_ranks(run_rank, 2, out, timeout_s=1200)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    print("| peer (FSDP2 eager) | rank | peer's peak | budget (max over ranks) | remat_compiler predicted "
          "| measured | peer FLOPs | remat_compiler FLOPs | re-gathered bytes | step time, ours / peer | units kept / re-gathered |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i in range(len(PEERS)):
        for res in ranks:
            r = res["rows"][i]
            kept = sum(c == "kept" for c in r["units"].values())
            print(f"| {r['peer']} | {r['rank']} | {r['peer_peak']} | {r['budget']} | {r['predicted']} | "
                  f"{r['measured']} | {r['peer_flops']:,} | {r['compiled_flops']:,} | {r['regather_bytes']} | "
                  f"{r['compiled_step_s'] / r['peer_step_s']:.2f} | {kept} / {len(r['units']) - kept} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
