"""The CUDA check: predicted peak against ``torch.cuda.max_memory_allocated()``, step time against
``torch.compile``, and plan files made on a CPU-only machine applied on the GPU (issue 15).

On a GPU machine (about 5 minutes on one H100/H200)::

    python -m benchmarks.gpu_check --plans benchmarks/data/cuda_plans --out benchmarks/data/gpu_check.md

For each workload (the GPT-2 benchmark config and a small Llama, fp32, eager attention, on cuda):

- **eager** and **torch.compile** (``torch.compile(model)``, Inductor): measured peak and step time;
- **remat_compiler** at each ``--budgets`` fraction of the no-recompute peak (CP-SAT, the GPU's cost
  preset, ``hold_outputs=False``: the step is ``model(**inputs).loss.backward()``): measured peak
  against the plan's prediction, and step time; with ``--inductor`` also ``backend="inductor"``
  (its walk of Inductor's code was written against CPU wrappers: where it cannot read CUDA's, the
  row says it ran the eager plan);
- **transfer**: each plan file in ``--plans`` (written on a CPU-only machine by ``--dry-run
  --write-plans DIR``) applied with ``compile(model, plan=Plan.load(path))``: accepted or refused,
  and measured against its prediction.

The measured peak of a step is ``max_memory_allocated()`` over it minus ``memory_allocated()`` before
it (after ``synchronize`` and ``reset_peak_memory_stats``, parameter gradients set to None, one
warm-up step before so cuBLAS's workspace and the cached blocks are in place): the plan's budget in
the units of CUDA's caching allocator (512-byte blocks, :mod:`passes.allocator`). The measurement may
exceed the prediction by under 1 MiB per large-pool block live at the peak (unsplit blocks); it is
printed in KiB. Step time: the median of ``--steps`` timed steps (``synchronize`` around each).

``--dry-run`` needs no GPU: it builds the models on the meta device, plans them for CUDA on the CPU
(:func:`remat_compiler.trace.trace_device`), prints the table with the predicted column filled, and with
``--write-plans DIR`` writes the plan files the GPU run's transfer rows apply.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

__all__ = ["main", "WORKLOADS", "measure_step", "llama_config"]

MiB = 2 ** 20
GPT2 = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, batch=4, seq=256)  # benchmarks.workloads.GPT2
GPT2_QUICK = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, batch=2, seq=64)
LLAMA = dict(layers=4, hidden=512, ffn=1376, heads=8, kv_heads=4, vocab=4096, batch=4, seq=512)
LLAMA_QUICK = dict(layers=2, hidden=32, ffn=64, heads=2, kv_heads=2, vocab=64, batch=2, seq=32)


def build_gpt2(device: str, quick: bool):
    from remat_compiler.examples.gpt2 import make_gpt2

    c = GPT2_QUICK if quick else GPT2
    with torch.device(device):
        model = make_gpt2(c["n_layer"], c["n_embd"], c["n_head"], c["vocab_size"], max(c["seq"], 128), 0.0, 0)
    return model.train(), _ids(c["vocab_size"], c["batch"], c["seq"], device)


def llama_config(c: dict, seq: int):
    """The benchmark Llama's config (``c``: :data:`LLAMA` or :data:`LLAMA_QUICK`) for sequences up to
    ``seq``, transformers' defaults otherwise."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        max_position_embeddings=max(128, seq), bos_token_id=c["vocab"] - 1, eos_token_id=c["vocab"] - 1)


def build_llama(device: str, quick: bool):
    import transformers

    c = LLAMA_QUICK if quick else LLAMA
    torch.manual_seed(0)
    config = llama_config(c, c["seq"])
    # the attention the plan files in data/cuda_plans were traced with (sdpa's graph differs between
    # devices): applying them needs the same graph
    config._attn_implementation = "eager"
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model.train(), _ids(c["vocab"], c["batch"], c["seq"], device)


def _ids(vocab: int, batch: int, seq: int, device: str) -> dict:
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device) if device != "meta" else torch.zeros((batch, seq), dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


WORKLOADS = {"gpt2": build_gpt2, "llama": build_llama}


def preset_name() -> str:
    """The cost preset of this machine's GPU (``"h100"`` when the name matches none)."""
    from remat_compiler.passes.costs import DEVICE_PRESETS

    name = torch.cuda.get_device_name().lower().replace("-", "").replace(" ", "") if torch.cuda.is_available() else ""
    return next((k for k in DEVICE_PRESETS if k in name), "h100")


def measure_step(run_step, model, steps: int) -> tuple[int, float]:
    """One warm-up step, then: the peak of one step above what was allocated before it (bytes, in
    ``max_memory_allocated`` units) and the median time of ``steps`` steps (seconds)."""
    def step():
        model.zero_grad(set_to_none=True)
        run_step()

    step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return peak, statistics.median(times)


SECTION = """## CUDA: predicted peak against `torch.cuda.max_memory_allocated()`, step time against torch.compile

`benchmarks/gpu_check.py` (its docstring says how each number is taken): measured = the most bytes
`max_memory_allocated()` saw over one step above `memory_allocated()` before it (gradients set to None,
after a warm-up step); predicted = the plan's peak, in CUDA caching-allocator blocks (512 B); step time =
the median of the timed steps, with `synchronize`. Transfer rows apply plan files made on a CPU-only
machine (`--dry-run --write-plans`, kept in `data/cuda_plans/`) with `compile(model, plan=Plan.load(path))`."""

HEADER = ("| workload | strategy | setting | budget (MiB) | measured peak (MiB) | predicted peak (MiB) | "
          "measured - predicted (KiB) | step time (ms) | vs eager | vs torch.compile | plan / compile (s) | "
          "status |")


def row(workload, strategy, setting, budget=None, measured=None, predicted=None, step_s=None, eager_s=None,
        inductor_s=None, plan_s=None, status="ok") -> str:
    def mib(b):
        return "-" if b is None else f"{b / MiB:.2f}"

    cells = [workload, strategy, setting, mib(budget), mib(measured), mib(predicted),
             "-" if measured is None or predicted is None else f"{(measured - predicted) / 1024:+.1f}",
             "-" if step_s is None else f"{step_s * 1e3:.2f}",
             "-" if step_s is None or not eager_s else f"{step_s / eager_s:.2f}",
             "-" if step_s is None or not inductor_s else f"{step_s / inductor_s:.2f}",
             "-" if plan_s is None else f"{plan_s:.1f}", status]
    return "| " + " | ".join(cells) + " |"


def dry_run(args, emit) -> None:
    """Plan every workload for CUDA from the meta device and print the table's predicted column."""
    import remat_compiler as rc
    from remat_compiler.passes import CostModel
    from remat_compiler.trace import DeviceTraceWarning

    cost_model = CostModel.preset(args.device)
    for name in args.workloads:
        model, inputs = WORKLOADS[name]("meta", args.quick)
        for fraction in args.budgets:
            t0 = time.perf_counter()
            setting = f"@ {fraction} x no-recompute"
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", category=DeviceTraceWarning)  # a plan that cannot transfer
                    planned = rc.plan_model(model, (), inputs, fraction, cost_model=cost_model,
                                            hold_outputs=False, solver=args.solver, **_solver_options(args))
            except (rc.InfeasibleBudgetError, DeviceTraceWarning) as exc:  # a row, and the run goes on
                emit(row(name, "remat_compiler", setting, status=f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            plan = planned.plan
            graph = planned.cg.g.graph
            emit(row(name, "remat_compiler", setting, plan.budget_bytes, None, plan.peak_bytes,
                     plan_s=time.perf_counter() - t0,
                     status=f"{plan.status}, for {graph['device']} traced on {graph['traced_on'] or graph['device']}"))
            if args.write_plans:
                os.makedirs(args.write_plans, exist_ok=True)
                plan.save(os.path.join(args.write_plans, f"{name}{'.quick' if args.quick else ''}.{fraction}.plan.json"))


def _solver_options(args) -> dict:
    return dict(time_limit_s=args.time_limit, num_workers=args.workers) if args.solver == "cpsat" else {}


def gpu_run(args, emit) -> None:
    """Measure every workload on the GPU."""
    import remat_compiler as rc
    from remat_compiler.passes import CostModel
    from remat_compiler.plan import Plan

    cost_model = CostModel.preset(args.device)
    for name in args.workloads:
        model, inputs = WORKLOADS[name]("cuda", args.quick)

        def eager_step():
            model(**inputs).loss.backward()
        eager_peak, eager_s = measure_step(eager_step, model, args.steps)
        emit(row(name, "eager", "-", measured=eager_peak, step_s=eager_s, eager_s=eager_s))

        torch._dynamo.reset()
        inductor = torch.compile(model)
        t0 = time.perf_counter()
        inductor(**inputs).loss.backward()
        compile_s = time.perf_counter() - t0
        ind_peak, ind_s = measure_step(lambda: inductor(**inputs).loss.backward(), model, args.steps)
        emit(row(name, "torch.compile", "inductor", measured=ind_peak, step_s=ind_s, eager_s=eager_s,
                 inductor_s=ind_s, plan_s=compile_s))

        def planned_rows(setting, make):
            t0 = time.perf_counter()
            try:
                compiled = make()
                compiled(**inputs).loss.backward()
            except Exception as exc:  # reported in the table, never hidden: the run goes on
                emit(row(name, "remat_compiler", setting, status=f"{type(exc).__name__}: {str(exc)[:120]}"))
                return
            plan_s = time.perf_counter() - t0
            peak, step_s = measure_step(lambda: compiled(**inputs).loss.backward(), model, args.steps)
            plan = compiled.plan
            ran = compiled.planned.backend  # "eager" where the Inductor backend fell back to it
            emit(row(name, "remat_compiler", setting, plan.budget_bytes, peak, plan.peak_bytes, step_s,
                     eager_s, ind_s, plan_s, f"{plan.status}, {compiled.planned.source}, ran {ran}"))

        for fraction in args.budgets:
            for backend in ("eager", "inductor") if args.inductor else ("eager",):
                planned_rows(f"@ {fraction} x no-recompute" + (", backend inductor" if backend == "inductor" else ""),
                             lambda: rc.compile(model, fraction, cost_model=cost_model, hold_outputs=False,
                                                solver=args.solver, backend=backend, **_solver_options(args)))
        if args.plans:
            prefix = f"{name}{'.quick' if args.quick else ''}."
            for file in sorted(f for f in os.listdir(args.plans) if f.startswith(prefix)
                               and f.removeprefix(prefix).count(".") == 3):
                path = os.path.join(args.plans, file)
                planned_rows(f"transfer {file}", lambda: rc.compile(model, plan=Plan.load(path), hold_outputs=False))
        model = inputs = inductor = None  # free this workload before the next (the closures above read them)
        torch.cuda.empty_cache()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt2,llama", help="comma-separated: " + ",".join(WORKLOADS))
    p.add_argument("--budgets", default="1.0,0.6,0.4", help="fractions of the no-recompute peak")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (median)")
    p.add_argument("--solver", default="cpsat", help="remat_compiler solver (cpsat, greedy, save_all, ...)")
    p.add_argument("--time-limit", type=float, default=20.0, help="CP-SAT seconds per plan")
    p.add_argument("--workers", type=int, default=8, help="CP-SAT workers")
    p.add_argument("--device", default=None, help="cost preset (default: from the GPU's name; h100 in --dry-run)")
    p.add_argument("--inductor", action="store_true",
                   help="also remat_compiler's backend='inductor' at each budget (about 1 min of compiling each)")
    p.add_argument("--quick", action="store_true", help="tiny configs (seconds)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: plan for cuda on the CPU, print predictions")
    p.add_argument("--write-plans", default=None, help="with --dry-run: write each plan file here")
    p.add_argument("--plans", default=None, help="apply the plan files in this folder (transfer rows)")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    try:
        args.budgets = [float(b) for b in args.budgets.split(",") if b]
    except ValueError:
        p.error(f"--budgets takes comma-separated fractions, got {args.budgets!r}")
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: run on a GPU machine, or pass --dry-run")
    args.device = args.device or (preset_name() if not args.dry_run else "h100")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    lines = []

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    where = "Dry run on a CPU-only machine: planned for cuda, nothing measured" if args.dry_run else \
        f"{torch.cuda.get_device_name()}, cost preset {args.device}"
    command = " ".join(argv if argv is not None else sys.argv[1:])
    emit(SECTION)
    emit("")
    emit(f"{where}; torch {torch.__version__}; command: `python -m benchmarks.gpu_check {command}`.")
    emit("")
    emit(HEADER)
    emit("|" + "---|" * (HEADER.count("|") - 1))
    (dry_run if args.dry_run else gpu_run)(args, emit)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
