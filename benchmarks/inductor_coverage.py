"""Does ``backend="inductor"`` work on every model the eager backend supports? A table per model:
gradients against eager's, the planner's peak, the walk of Inductor's code, the measured peak.

::

    python -m benchmarks.inductor_coverage                  # mlp, gpt2, mixtral, moe, moe-2ranks
    python -m benchmarks.inductor_coverage --cases moe-2ranks

Each model is built as users build it (library defaults, sizes shrunk), planned at ``--budget`` (a
fraction of its no-recompute peak), run once (tracing, planning and compiling), then run again under a
:class:`~remat_compiler.memory.LiveStorageTracker` that also sees Inductor's buffers
(:func:`remat_compiler.inductor.watch`); inputs and gradient seeds are made before the tracker starts
(so a step seeded by the caller measures below the walk by the seed, which the plan counts as the
step's). "planned under" is the budget the plan was made under: lower than the one asked for when
Inductor's code for the first plan peaked above it and the step was re-planned.
The gradients are compared with the uncompiled model's (same seed, so dropout draws the same masks).
About 3 minutes on an idle 2-core machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

__all__ = ["CASES", "run_case", "main"]

CASES = ("mlp", "gpt2", "mixtral", "moe", "moe-2ranks")
#: Budgets other than ``--budget``: this MLP chain needs all but its GELUs' inputs (bytes, as in the tests).
CASE_BUDGETS = {"mlp": 180_000}


def _build(case: str, group=None):
    """(model, make_inputs() -> (args, seed of backward or None), tolerance)."""
    if case == "mlp":
        from remat_compiler.examples.models import build_mlp

        model, (x,), loss_fn = build_mlp(width=64, depth=4, batch=64)
        return model, lambda: ((x,), None), loss_fn, dict(rtol=1e-5, atol=1e-6)
    if case == "gpt2":
        from remat_compiler.examples.zoo import _gpt2

        torch.manual_seed(0)
        model, _ = _gpt2()
        ids = torch.randint(0, 128, (2, 32))
        return model, lambda: ((ids,), None), None, dict(rtol=1e-4, atol=1e-6), {"labels": ids}
    if case == "mixtral":
        import transformers

        torch.manual_seed(0)
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=64)
        model = transformers.MixtralForCausalLM(config).train()
        ids = torch.randint(0, 64, (2, 16))
        return model, lambda: ((ids,), None), None, dict(rtol=1e-4, atol=1e-5), {"labels": ids}
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import moe_compile_worker as worker

    world = 1 if group is None else torch.distributed.get_world_size()
    rank = 0 if group is None else torch.distributed.get_rank()
    model = worker.make_model(group)
    x, g = worker.make_batch(world, rank)
    return model, lambda: ((x.detach().clone().requires_grad_(True),), g.clone()), None, \
        dict(rtol=1e-10, atol=1e-12)


def _step(model, args, seed, loss_fn, kwargs):
    out = model(*args, **kwargs)
    if seed is not None:
        out.backward(seed)
    elif loss_fn is not None:
        loss_fn(out).backward()
    else:
        out.loss.backward()


def run_case(case: str, budget: float, time_limit_s: float, group=None) -> dict:
    """Plan, compile and measure one case (``group``: its process group on ranks)."""
    import remat_compiler
    from remat_compiler.inductor import watch
    from remat_compiler.memory import LiveStorageTracker

    built = _build(case.removesuffix("-2ranks"), group)
    model, inputs, loss_fn, tol = built[:4]
    kwargs = built[4] if len(built) > 4 else {}
    reference = _build(case.removesuffix("-2ranks"), group)[0]  # the same seeded build, uncompiled
    args, seed = inputs()
    torch.manual_seed(1)
    _step(reference, args, seed, loss_fn, kwargs)
    m = remat_compiler.compile(model, memory_budget=budget, backend="inductor", time_limit_s=time_limit_s,
                               num_workers=1)
    args, seed = inputs()
    t0 = time.perf_counter()
    torch.manual_seed(1)
    _step(m, args, seed, loss_fn, kwargs)
    first_s = time.perf_counter() - t0
    errors = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
              if q.grad is not None]
    same = all(torch.allclose(p.grad, q.grad, **tol) for p, q in zip(model.parameters(), reference.parameters())
               if q.grad is not None)
    for p in model.parameters():
        p.grad = None
    args, seed = inputs()
    tracker = LiveStorageTracker()
    with tracker, watch(tracker, m.planned.inductor):
        _step(m, args, seed, loss_fn, kwargs)
    from remat_compiler.budget import parse_budget
    from remat_compiler.solvers import resolve_budget

    compiled = m.planned.compiled
    # the budget asked for, in bytes (after a re-plan, m.plan.budget_bytes is the lower one it was made under)
    asked = resolve_budget(m.planned.cg, parse_budget(budget))
    return {"case": case, "runs as": m.planned.backend, "grads allclose": same, "max grad error": max(errors),
            "budget": asked, "planned under": m.plan.budget_bytes, "plan peak": m.plan.peak_bytes,
            "walked": compiled.peak_bytes if compiled else None, "measured": tracker.peak_bytes,
            "first call s": round(first_s, 1), "plan digest": m.plan.fingerprint}


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    args = json.loads(os.environ["REMAT_COVERAGE_ARGS"])
    result = run_case("moe-2ranks", args["budget"], args["time_limit_s"], dist.group.WORLD)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _on_two_ranks(budget: float, time_limit_s: float) -> list[dict]:
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import dist_spawn

    os.environ["REMAT_COVERAGE_ARGS"] = json.dumps({"budget": budget, "time_limit_s": time_limit_s})
    with tempfile.TemporaryDirectory() as out:
        dist_spawn.spawn_ranks(_rank, 2, out, timeout_s=900)
        results = []
        for r in range(2):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append({**json.load(f), "case": f"moe rank {r} of 2"})
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    p.add_argument("--budget", type=float, default=0.8,
                   help="fraction of the no-recompute peak (0.8; the MLP: 180,000 bytes)")
    p.add_argument("--time-limit", type=float, default=5.0, help="CP-SAT seconds per solve (5)")
    args = p.parse_args(argv)
    rows = []
    for case in args.cases.split(","):
        if case == "moe-2ranks":
            rows.extend(_on_two_ranks(args.budget, args.time_limit))
        else:
            rows.append(run_case(case, CASE_BUDGETS.get(case, args.budget), args.time_limit))
    cols = ["case", "runs as", "grads allclose", "max grad error", "budget", "planned under", "plan peak", "walked",
            "measured", "first call s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1e}" if c == "max grad error" else str(r[c]) for c in cols) + " |")
    return 0 if all(r["grads allclose"] and r["measured"] <= r["budget"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
