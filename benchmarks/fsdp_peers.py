"""FSDP2's peers against remat_compiler's plan at each peer's measured per-rank peak (issue 35's targets),
on 2 gloo ranks (CPU), one process per rank.

Workloads (``--workloads``, each with every block a ``fully_shard`` unit and then the root, fp32,
loss inside via labels, each rank its own token ids):

- ``llama``: a default-config ``LlamaForCausalLM`` with its sizes shrunk (hidden 128, 4 layers),
  batch 2 x seq 256 a rank;
- ``gpt2``, ``mixtral``: the benchmark workloads of :mod:`benchmarks.workloads` (GPT-2: 6 layers,
  width 256, batch 4 x seq 256 a rank; Mixtral: 2 layers, hidden 256, 8 experts, batch 4 x seq 128).

Peers, each run by FSDP2:

- ``reshard_after_forward=True`` on every unit, the root included (FSDP2's default, None, keeps the
  root gathered): every unit gathered again in backward;
- ``reshard_after_forward=False``: every block kept gathered from forward to backward;
- ``True`` + activation checkpointing of every block (transformers' ``gradient_checkpointing_enable``);
- ``True`` + ``torch.compile`` of every block (torchtitan's way) with
  ``torch._functorch.config.activation_memory_budget`` = :data:`COMPILE_MEMORY_BUDGET`.

Each peer's per-rank peak is measured over steps 2..(STEPS) by
:class:`~remat_compiler.memory.AllocatorPeak` (the allocator's profiler events, which see FSDP2's
storage resizes, kernels' temporaries and what gloo allocates inside a collective; ``--meter tracker``
measures the eager rows with :class:`ResizeAwareTracker` instead, the step's own ops only), the
smaller rank's taken (every rank runs the same plan, and ours must peak at or below each rank's
peer). Then ``remat_compiler.compile`` of the same sharded model under that peak as its budget: predicted and
measured peak per rank, recomputed FLOPs, bytes re-gathered (what a rank sends again, the peer's
and ours: :func:`peer_regather_bytes`, :func:`passes.costs.sent_bytes`). Step times are
the medians of the rounds, peer and compiled interleaved in one process per rank (CPU times on 2
shared cores); FLOPs and bytes are exact: both steps' FLOPs are counted by
``torch.utils.flop_counter`` as they run (the plan's own count is saved beside as ``plan_flops``).

The ``torch.compile`` peer runs its compiled code only where no dispatch mode is on, so its peak,
and ours beside it, are measured by ``AllocatorPeak`` whatever ``--meter`` says, and its FLOPs (inside
Inductor's kernels, which the flop counter does not see) are not given; its row says how many
graphs Dynamo compiled. What each peer recomputes is given for every row: its counted FLOPs less
FSDP2 eager's, the ``torch.compile`` peer's counted on a twin that runs its partitioner's graphs op
by op (:func:`_recomputed_by_peer`); ours is the plan's count.

    python -m benchmarks.fsdp_peers                              # all three workloads, ~10 minutes
    python -m benchmarks.fsdp_peers --workloads llama --json out.json
    python -m benchmarks.fsdp_peers --workloads gpt2 --peers 3 --backend inductor   # ours under Inductor
    python -m benchmarks.fsdp_peers --peers 3 --backend inductor --objective flops   # least FLOPs first
    python -m benchmarks.fsdp_peers --workloads llama --peers 3 --budget 12141576     # at a peak seen before

With ``--backend inductor`` our step runs Inductor's code: every row is then measured by
``AllocatorPeak`` (a dispatch-mode tracker sees none of Inductor's buffers) and our FLOPs are not
counted (the flop counter sees none inside Inductor's kernels); its "predicted" is the walk of the
code Inductor wrote (``plan_peak`` keeps the plan's own, on the backend's view of the graph), and
``walks`` lists each try's. ``--peers`` picks peers by their index in :data:`PEERS` (0-3,
comma-separated); ``--objective`` is the solve's (``compile(..., objective=)``); ``--budget`` plans
ours under that many bytes instead of each peer's peak (the peers' peaks move between runs). Our
solve runs with the library's defaults (CP-SAT's own worker count) and ``time_limit_s``
:data:`TIME_LIMIT_S` (``--time-limit``).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist

from remat_compiler.memory import LiveStorageTracker

__all__ = ["ResizeAwareTracker", "run_rank", "main", "recomputed_by_compile", "walked_peaks", "peer_regather_bytes",
           "WORKLOADS", "PEERS"]

SIZES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4)
BATCH, SEQ, STEPS, ROUNDS = 2, 256, 3, 5
PEERS = ("reshard_after_forward=True", "reshard_after_forward=False", "True + checkpoint every layer",
         "True + torch.compile every layer")
#: ``torch._functorch.config.activation_memory_budget`` of the ``torch.compile`` peer (1.0: no
#: recomputation; PyTorch's knob is a fraction of the saved activations' bytes)
COMPILE_MEMORY_BUDGET = 0.5
#: Our solve's ``time_limit_s`` (``--time-limit``)
TIME_LIMIT_S = 20.0
WORKLOADS = ("llama", "gpt2", "mixtral")


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


def _build(workload: str):
    """A fresh model of ``workload`` and the dotted path of its blocks."""
    import transformers

    from benchmarks.workloads import WORKLOADS as SPECS

    if workload == "llama":
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)), "model.layers"
    spec = SPECS[workload]
    return spec.build()[0], spec.blocks


def _token_ids(workload: str, rank: int) -> torch.Tensor:
    """This rank's token ids for ``workload``, of its vocabulary and (batch, seq)."""
    from benchmarks.workloads import GPT2, MIXTRAL

    vocab, shape = {"llama": (SIZES["vocab_size"], (BATCH, SEQ)),
                    "gpt2": (GPT2["vocab_size"], (GPT2["batch"], GPT2["seq"])),
                    "mixtral": (MIXTRAL["vocab"], (MIXTRAL["batch"], MIXTRAL["seq"]))}[workload]
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(rank))


def _model(peer: str, workload: str = "llama", compile_backend="inductor"):
    from torch.distributed.fsdp import fully_shard

    model, blocks = _build(workload)
    if peer == PEERS[2]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = model.get_submodule(blocks)
    if peer == PEERS[3]:  # torchtitan: each block compiled, then sharded
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer, backend=compile_backend)
    reshard = peer != PEERS[1]
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def peer_regather_bytes(model) -> int:
    """The bytes one rank sends in a step to all-gather again in backward what FSDP2 freed after
    forward: ``world - 1`` padded shards of every unit that reshards after forward, in the gather's
    dtype, as :func:`passes.costs.sent_bytes` charges our re-gathers.

    Parameters
    ----------
    model : torch.nn.Module
        An FSDP2 model after its first forward (FSDP2 decides the root's resharding then:
        ``reshard_after_forward=None``, its default, keeps the root gathered; ``True`` reshards it too).

    Returns
    -------
    int
        0 where no unit reshards (``reshard_after_forward=False``).
    """
    from remat_compiler.fsdp.units import fsdp_units

    total = 0
    for unit in fsdp_units(model):
        if unit.group is None or unit.group.post_forward_mesh_info is None:
            continue
        dtype = unit.param_dtype
        for up in unit.params:
            total += (unit.world - 1) * up.padded_numel * (dtype or up.fsdp_param._sharded_param_data.dtype).itemsize
    return total


def _step(model, ids):
    def step():
        loss = model(ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def _measure(step, meter=None) -> tuple[int, float]:
    """The step's peak over steps 2..STEPS (``meter``: ResizeAwareTracker, or AllocatorPeak where the
    step runs compiled code, which a dispatch-mode tracker would make run eagerly) and its median time."""
    meter = meter or ResizeAwareTracker
    peaks, times = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        with meter() as mem:
            step()
        times.append(time.perf_counter() - t0)
        if i:
            peaks.append(mem.peak_bytes)
    return max(peaks), statistics.median(times[1:])


def count_grouped_mm() -> None:
    """Give ``torch.utils.flop_counter`` the formulas it lacks for grouped matmuls (the planner's,
    :func:`remat_compiler.passes.costs.grouped_mm_flops`): ``aten._grouped_mm``, which FSDP2 eager's
    Mixtral experts run, and transformers' ``grouped_mm_fallback`` and its backward, which our traced
    step runs (a dispatch mode sees a custom op whole, not the ``mm`` loop inside it)."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    from remat_compiler.passes.costs import grouped_mm_backward_flops, grouped_mm_flops

    def forward(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return grouped_mm_flops(a_shape, b_shape, out_shape)

    def backward(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
        return grouped_mm_backward_flops(a_shape, b_shape)

    ops = getattr(torch.ops, "transformers", None)  # transformers' MoE integration, where imported
    formulas = [(torch.ops.aten._grouped_mm, forward),
                (getattr(ops, "grouped_mm_fallback", None), forward),
                (getattr(ops, "grouped_mm_fallback_backward", None), backward)]
    for op, formula in formulas:
        if op is not None and op not in flop_registry:
            register_flop_formula(op)(formula)


def _flops(step) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    count_grouped_mm()
    with FlopCounterMode(display=False) as fc:
        step()
    return fc.get_total_flops()


def _counting_backend(total: list[int]):
    """A ``torch.compile`` backend that plans as Inductor does (its decompositions, its partitioner with
    ``activation_memory_budget``) and runs the partitioned graphs op by op, adding each run's counted
    FLOPs to ``total[0]`` (a dispatch mode around a compiled call would not see inside it)."""
    from functools import partial

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from torch.utils.flop_counter import FlopCounterMode

    def compiler(gm, _example_inputs):
        def run(*args):
            with FlopCounterMode(display=False) as fc:
                out = gm(*args)
            total[0] += fc.get_total_flops()
            return out
        return make_boxed_func(run)
    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=select_decomp_table(),
                        partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))


#: FSDP2 eager's counted FLOPs a step, by workload (this rank's ids): counted once per process.
_EAGER_FLOPS: dict[str, int] = {}


def _recomputed_by_peer(peer: str, workload: str, ids, peer_flops: int | None) -> int:
    """The FLOPs ``peer`` recomputes in a step: its counted FLOPs less FSDP2 eager's (``peer_flops``,
    counted as it ran). The ``torch.compile`` peer's run inside Inductor's kernels, where the flop
    counter sees nothing: its blocks' graphs are counted on a twin that plans as Inductor does and
    runs the graphs op by op (:func:`_counting_backend`), less the same twin's at
    ``activation_memory_budget=1.0`` (no recompute asked). Dynamo's caches are reset before each twin
    (the budget is not one of its guards): run after the peer's own timed steps."""
    if peer != PEERS[3]:
        if peer == PEERS[0]:  # FSDP2 eager itself: counted as it ran
            _EAGER_FLOPS[workload] = peer_flops
        if workload not in _EAGER_FLOPS:
            _EAGER_FLOPS[workload] = _flops(_step(_model(PEERS[0], workload), ids))
        return peer_flops - _EAGER_FLOPS[workload]

    return recomputed_by_compile(lambda backend: _step(_model(peer, workload, compile_backend=backend), ids),
                                 COMPILE_MEMORY_BUDGET)


def recomputed_by_compile(make_step: Callable[[Callable], Callable[[], None]], budget: float) -> int:
    """The FLOPs ``torch.compile``'s partitioner recomputes in a step at ``activation_memory_budget=budget``:
    the counted FLOPs of a twin (``make_step(backend)``: the model compiled with ``backend``, its step)
    whose backend is :func:`_counting_backend`, less the same twin's at 1.0 (no recompute asked).
    Dynamo's caches are reset before each twin (the budget is not one of its guards)."""
    def twin_flops(at: float) -> int:
        torch._dynamo.reset()
        total = [0]
        with torch._functorch.config.patch(activation_memory_budget=at):
            step = make_step(_counting_backend(total))
            step()  # compiles
            total[0] = 0
            step()
        return total[0]
    return twin_flops(budget) - twin_flops(1.0)


@contextlib.contextmanager
def walked_peaks():
    """Each walk of Inductor's code made inside (an EmittedPeak per try of the backend's first call)."""
    import remat_compiler.inductor.compile as inductor_compile

    walks, walk = [], inductor_compile.compiled_peak

    def walked(*args, **kwargs):
        peak = walk(*args, **kwargs)
        walks.append(peak)
        return peak
    inductor_compile.compiled_peak = walked
    try:
        yield walks
    finally:
        inductor_compile.compiled_peak = walk


def _min_over_ranks(x: int) -> int:
    """The least of the ranks' ``x``: the budget of the one plan every rank runs, which must peak at or
    below each rank's peer (Mixtral's ranks route their own tokens, so the peers' peaks differ: the
    `torch.compile` peer's by 13 MB in one run)."""
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _peer_context(peer: str):
    import contextlib

    if peer != PEERS[3]:
        return contextlib.nullcontext()
    return torch._functorch.config.patch(activation_memory_budget=COMPILE_MEMORY_BUDGET)


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import remat_compiler

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))
    torch.set_num_threads(1)
    workloads = os.environ["FSDP_PEERS_WORKLOADS"].split(",")
    peers = [PEERS[int(i)] for i in os.environ.get("FSDP_PEERS_PEERS", "0,1,2,3").split(",")]
    backend = os.environ.get("FSDP_PEERS_BACKEND", "eager")
    objective = os.environ.get("FSDP_PEERS_OBJECTIVE", "runtime")
    rows = []
    for workload in workloads:
        ids = _token_ids(workload, rank)
        for peer in peers:
            with _peer_context(peer):
                rows.append(_compare(remat_compiler, workload, peer, rank, ids, backend, objective))
    torch.save({"rows": rows}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _compare(remat_compiler, workload: str, peer: str, rank: int, ids, backend: str = "eager",
             objective: str = "runtime") -> dict:
    from torch._dynamo.utils import counters

    from remat_compiler.memory import AllocatorPeak

    # torch.compile's code runs only with no dispatch mode on: its peer, and ours beside it, are measured
    # by the allocator's profiler events (which also see FSDP2's storage resizes and kernels' temporaries)
    by_tracker = os.environ.get("FSDP_PEERS_METER", "allocator") == "tracker"
    meter = ResizeAwareTracker if by_tracker and peer != PEERS[3] and backend == "eager" else AllocatorPeak
    counters.clear()
    try:
        model = _model(peer, workload)
        step = _step(model, ids)
        step()
        peak, _ = _measure(step, meter)
    except Exception as exc:  # noqa: BLE001 - a peer that does not compose is a row saying so
        return {"workload": workload, "peer": peer, "rank": rank, "error": f"{type(exc).__name__}: {exc}"[:300]}
    graphs = counters["stats"].get("unique_graphs", 0)
    peer_regather = peer_regather_bytes(model)
    budget = int(os.environ.get("FSDP_PEERS_BUDGET") or 0) or _min_over_ranks(peak)
    peer_flops = None if peer == PEERS[3] else _flops(step)
    cm = remat_compiler.compile(_model(PEERS[0], workload), memory_budget=budget, hold_outputs=False,
                                time_limit_s=float(os.environ.get("FSDP_PEERS_TIME_LIMIT") or TIME_LIMIT_S),
                                backend=backend, objective=objective)
    cstep = _step(cm, ids)
    with walked_peaks() as walks:  # each try's walk of Inductor's code, under the Inductor backend
        cstep()
    plan = cm.plan
    times = {"peer": [], "compiled": []}
    cpeaks = []
    for _ in range(ROUNDS):  # interleaved
        times["peer"].append(_measure(step, meter)[1])
        p, t = _measure(cstep, meter)
        times["compiled"].append(t)
        cpeaks.append(p)
    compiled_flops = _flops(cstep) if backend == "eager" else None
    peer_recomputed = _recomputed_by_peer(peer, workload, ids, peer_flops)
    return {"workload": workload, "peer": peer, "rank": rank, "peer_peak": peak, "budget": budget,
            "meter": meter.__name__, "peer_graphs": graphs,
            # under Inductor the prediction is the walk of the code Inductor wrote
            "predicted": plan.peak_bytes if cm.planned.compiled is None else cm.planned.compiled.peak_bytes,
            "plan_peak": plan.peak_bytes, "measured": max(cpeaks),
            "first_step": cm.planned.first_step_bytes, "peaks": cpeaks,
            "walks": [w.peak_bytes for w in walks],
            "peer_step_s": statistics.median(times["peer"]),
            "compiled_step_s": statistics.median(times["compiled"]),
            "peer_flops": peer_flops, "compiled_flops": compiled_flops, "peer_recompute_flops": peer_recomputed,
            "backend": backend, "objective": objective,
            "plan_flops": plan.baseline_flops + plan.recompute_flops,
            "recompute_flops": plan.recompute_flops, "regather_bytes": plan.recompute_comm_bytes,
            "peer_regather_bytes": peer_regather,
            "units": {u["unit"]: u["choice"] for u in plan.extras.get("fsdp_units", [])}}


def format_table(rows: list[dict]) -> str:
    """The Markdown table of both ranks' rows."""
    lines = ["| workload | peer (FSDP2) | rank | peer's peak | budget (least over ranks) | remat_compiler predicted "
             "| measured | FLOPs, peer / ours | recomputed FLOPs, peer / ours | bytes re-gathered, peer / ours | step time, ours / peer "
             "| units kept / re-gathered |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['peer']} | {r['rank']} | does not run: {r['error']} |  |  |  |  |  |  |  |  |")
            continue
        kept = sum(c == "kept" for c in r["units"].values())
        flops = (f"{r['peer_flops'] / 1e9:.3f} G / " if r["peer_flops"] is not None else "not counted / ") + \
            (f"{r['compiled_flops'] / 1e9:.3f} G" if r.get("compiled_flops") is not None else "not counted")
        recomputed = (f"{r['peer_recompute_flops'] / 1e9:.3f} G" if r.get("peer_recompute_flops") is not None
                      else "not counted") + f" / {r['recompute_flops'] / 1e9:.3f} G"
        peer = r["peer"] + (f" ({r['peer_graphs']} graphs compiled)" if r.get("peer_graphs") else "")
        regathered = (f"{r['peer_regather_bytes']:,}" if r.get("peer_regather_bytes") is not None else "-") + \
            f" / {r['regather_bytes']:,}"
        lines.append(f"| {r['workload']} | {peer} | {r['rank']} | {r['peer_peak']:,} | {r['budget']:,} | "
                     f"{r['predicted']:,} | {r['measured']:,} | {flops} | {recomputed} | {regathered} | "
                     f"{r['compiled_step_s'] / r['peer_step_s']:.2f} | {kept} / {len(r['units']) - kept} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp_peers", description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--json", help="also write the rows here (benchmarks/data/fsdp_peers.json for RESULTS.md)")
    parser.add_argument("--peers", default="0,1,2,3", help="indices into PEERS, comma-separated (default: all)")
    parser.add_argument("--backend", choices=("eager", "inductor"), default="eager",
                        help="what runs our step (default eager)")
    parser.add_argument("--budget", type=int, default=0,
                        help="plan ours under this many bytes instead of each peer's peak (to reproduce a row)")
    parser.add_argument("--objective", choices=("runtime", "flops"), default="runtime",
                        help="the solve's objective (compile's objective=; default runtime, the library's)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help=f"our solve's time_limit_s (default {TIME_LIMIT_S:g})")
    parser.add_argument("--meter", choices=("allocator", "tracker"), default="allocator",
                        help="what measures the eager rows: the allocator's events (default; they also see what "
                             "gloo allocates inside a collective) or ResizeAwareTracker (the step's own ops only)")
    args = parser.parse_args(argv)
    if not set(args.peers.split(",")) <= {str(i) for i in range(len(PEERS))}:
        parser.error(f"--peers takes indices 0-{len(PEERS) - 1} of {PEERS}")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import dist_spawn

    os.environ.update(FSDP_PEERS_WORKLOADS=args.workloads, FSDP_PEERS_PEERS=args.peers,
                      FSDP_PEERS_BACKEND=args.backend, FSDP_PEERS_OBJECTIVE=args.objective,
                      FSDP_PEERS_BUDGET=str(args.budget), FSDP_PEERS_TIME_LIMIT=str(args.time_limit),
                      FSDP_PEERS_METER=args.meter)
    with tempfile.TemporaryDirectory() as out:
        dist_spawn.spawn_ranks(run_rank, 2, out, timeout_s=3600, start_method="spawn")
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    rows = [r for pair in zip(*(res["rows"] for res in ranks)) for r in pair]
    print(format_table(rows))
    if args.json:
        from benchmarks.report import atomic_write_text

        commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or None
        atomic_write_text(args.json, json.dumps({"commit": commit, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
