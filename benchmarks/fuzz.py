"""Differential fuzzing: random training steps, compiled at several budgets, against eager PyTorch.

A seeded generator (:func:`random_model`) builds a module from a random program over values of
shape (batch, width): linear layers (some parameters shared, some unused), matmuls of two values,
a convolution, activations, softmax / log-softmax, layer norm, training-mode BatchNorm, aliasing
views and slices, in-place ops (on fresh values, on a slice, on a buffer), constants made in
forward (empty ones too), extra outputs, in float32 or float64. :func:`check_model` plans it at
no limit, at the no-recompute peak, at the smallest feasible budget and at random budgets between,
and checks every run against eager: the loss and every gradient (bit-exact in float64, allclose in
float32, None where eager's is None), buffers, the measured peak under the budget and equal to the
prediction, and a smaller budget never planning a larger peak.

The test suite runs a few seeds (``tests/test_fuzz.py``); a soak runs thousands::

    python -m benchmarks.fuzz --seeds 0:2000 --out /tmp/fuzz.jsonl     # one JSON line per model

It prints a summary table (models, runs, mismatches by kind) at the end; every failure's line
names its seed, so ``python -m benchmarks.fuzz --seeds N:N+1 -v`` reproduces it.
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["random_model", "check_model", "FuzzResult", "main"]

ACTIVATIONS = ("tanh", "relu", "gelu", "sigmoid", "silu")


class RandomNet(nn.Module):
    """A module whose forward interprets a random program (a list of op tuples) over a value pool."""

    def __init__(self, program: list[tuple], width: int, n_linear: int, n_outputs: int, dtype):
        super().__init__()
        self.program, self.width, self.n_outputs = program, width, n_outputs
        self.linears = nn.ModuleList(nn.Linear(width, width) for _ in range(n_linear))
        self.unused = nn.Linear(width, width)  # reached only by an output the loss ignores
        self.norm = nn.LayerNorm(width)
        self.bn = nn.BatchNorm1d(width)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("counter", torch.zeros(width))
        self.to(dtype)

    def forward(self, x):
        pool = [x]
        for op in self.program:
            pool.append(self._run(op, pool))
        outs = pool[-self.n_outputs:]
        # the loss always reaches a parameter (a program may use none), and the step's last value
        loss = outs[0].pow(2).mean() + self.linears[0](pool[-1]).tanh().mean()
        # an extra output through a parameter the loss never reaches: eager leaves its grad None
        return (loss, *outs[1:], self.unused(x)) if self.n_outputs > 1 else loss

    def _run(self, op, pool):
        kind, a, b = op[0], pool[op[1]], pool[op[2]] if len(op) > 2 and isinstance(op[2], int) else None
        w = self.width
        if kind == "linear":
            return self.linears[op[3]](a)
        if kind == "matmul":
            return (a @ b.t()) @ b / w
        if kind == "act":
            return getattr(torch, op[3])(a) if op[3] in ("tanh", "relu", "sigmoid") else getattr(F, op[3])(a)
        if kind == "add":
            return a + b
        if kind == "mul":
            return a * b
        if kind == "softmax":
            return torch.softmax(a, dim=-1) if op[3] else torch.log_softmax(a, dim=-1)
        if kind == "layer_norm":
            return self.norm(a)
        if kind == "batch_norm":
            return self.bn(a)
        if kind == "conv":
            img = a.reshape(a.shape[0], 1, 1, w)
            return self.conv(img).mean(dim=1).reshape(a.shape[0], w)
        if kind == "view":
            return a.t().contiguous().t().reshape(a.shape[0], w)
        if kind == "slice_cat":
            h = a[:, : w // 2]
            return torch.cat([h, a[:, ::2]], dim=1)
        if kind == "inplace":
            y = a * 1.5
            return getattr(y, op[3])() if op[3] in ("relu_", "sigmoid_") else y.add_(b)
        if kind == "inplace_slice":
            y = a + 0.0
            y[:, : w // 2].mul_(2.0)
            return y
        if kind == "const":
            return a * torch.tensor([2.0], dtype=a.dtype) + torch.ones(w, dtype=a.dtype)
        if kind == "empty_const":
            return torch.cat([torch.tensor([], dtype=a.dtype), a.flatten()]).reshape(a.shape)
        if kind == "buffer":
            return a * self.scale
        if kind == "buffer_inplace":
            self.counter.add_(1.0)
            return a * (1.0 + self.counter / 100)
        raise ValueError(kind)


@dataclass
class FuzzCase:
    seed: int
    model: nn.Module
    x: torch.Tensor
    dtype: torch.dtype
    ops: list[str]


def random_model(seed: int) -> FuzzCase:
    """A random module and input, fully determined by ``seed``."""
    rng = random.Random(seed)
    dtype = rng.choice((torch.float32, torch.float64))
    width, batch = rng.choice((8, 16)), rng.choice((4, 8, 16))
    n_linear = rng.randint(1, 3)
    kinds = ["linear", "linear", "matmul", "act", "act", "add", "mul", "softmax", "layer_norm", "batch_norm",
             "conv", "view", "slice_cat", "inplace", "inplace_slice", "const", "empty_const", "buffer",
             "buffer_inplace"]
    program = []
    for i in range(rng.randint(4, 14)):
        n = i + 1  # values in the pool
        kind = rng.choice(kinds)
        a, b = rng.randrange(n), rng.randrange(n)
        if kind == "linear":
            program.append((kind, a, b, rng.randrange(n_linear)))
        elif kind == "act":
            program.append((kind, a, b, rng.choice(ACTIVATIONS)))
        elif kind == "softmax":
            program.append((kind, a, b, rng.random() < 0.5))
        elif kind == "inplace":
            program.append((kind, a, b, rng.choice(("relu_", "sigmoid_", "add_"))))
        else:
            program.append((kind, a, b))
    n_outputs = rng.choice((1, 1, 2, 3))
    torch.manual_seed(seed)
    model = RandomNet(program, width, n_linear, n_outputs, dtype).train()
    x = torch.randn(batch, width, dtype=dtype, generator=torch.Generator().manual_seed(seed))
    if rng.random() < 0.2:
        x.requires_grad_(True)
    return FuzzCase(seed, model, x, dtype, [op[0] for op in program])


@dataclass
class FuzzResult:
    seed: int
    dtype: str
    ops: list[str]
    runs: list[dict] = field(default_factory=list)   # one per budget: budget, predicted, measured, ok
    failures: list[str] = field(default_factory=list)
    skipped: str | None = None                       # eager itself cannot train it
    aot_rounding: bool = False                       # AOTAutograd's own capture rounds unlike eager


def _train_step(model, call, x) -> torch.Tensor:
    """One training step (gradients cleared, forward, backward); returns the loss. This is what the
    tracker measures, and all it measures."""
    for p in model.parameters():
        p.grad = None
    if x.grad is not None:
        x.grad = None
    out = call(x)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss


def _results(model, loss, x):
    """Copies of the loss, the parameter gradients and the input's gradient. Take them outside the
    tracker: the copies are the fuzzer's allocations, not the step's (inside it, cloning every gradient
    at the end of backward adds their bytes to the measured peak; a model whose weights outweigh its
    activations then measures above its plan)."""
    return loss.detach().clone(), {n: None if p.grad is None else p.grad.clone()
                                   for n, p in model.named_parameters()}, \
        None if x.grad is None else x.grad.clone()


def _step(model, call, x):
    return _results(model, _train_step(model, call, x), x)


def _same(a, b, exact: bool) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _agrees(loss, grads, xg, ref, exact: bool) -> bool:
    return _same(loss, ref[0], exact) and _same(xg, ref[2], exact) and \
        all(_same(grads[n], ref[1][n], exact) for n in ref[1])


def check_model(case: FuzzCase, *, time_limit_s: float = 1.0, n_random: int = 2) -> FuzzResult:
    """Plan ``case`` at several budgets and compare each run with eager (see the module docstring)."""
    import remat_compiler as rc
    from remat_compiler.memory import LiveStorageTracker
    from remat_compiler.solvers import solve
    from remat_compiler.solvers.cpsat import SolveMemo, min_feasible_peak

    res = FuzzResult(case.seed, str(case.dtype).replace("torch.", ""), case.ops)
    exact = case.dtype == torch.float64
    ref = copy.deepcopy(case.model)
    x_ref = case.x.detach().clone().requires_grad_(case.x.requires_grad)
    try:
        _step(ref, ref, x_ref)
        eager = _step(ref, ref, x_ref)
    except RuntimeError as exc:  # an in-place op on a value autograd saved: eager rejects it too
        res.skipped = f"eager fails: {str(exc).splitlines()[0][:120]}"
        return res
    eager_buffers = {n: b.clone() for n, b in ref.named_buffers()}

    def aot_reference():
        net = copy.deepcopy(case.model)
        x = case.x.detach().clone().requires_grad_(case.x.requires_grad)
        torch._dynamo.reset()
        try:
            step = torch.compile(net, backend="aot_eager", dynamic=False)
            _step(net, step, x)
            return _step(net, step, x)
        finally:
            torch._dynamo.reset()
    try:
        _, cg = rc.analyze(case.model, (case.x,))
        memo = SolveMemo()  # the smallest budget's plan (reruns are searched locally) reaches its compile
        smallest, *_ = min_feasible_peak(cg, time_limit_s=time_limit_s, memo=memo)
        baseline = solve(cg, None, "save_all").peak_bytes
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported with its seed
        res.failures.append(f"seed {case.seed}: planning crashed: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}")
        return res
    rng = random.Random(case.seed)
    budgets = [None, baseline, smallest] + sorted(
        {rng.randint(smallest, baseline) for _ in range(n_random)} if smallest < baseline else set())
    planned, aot = [], []
    for budget in budgets:
        net = copy.deepcopy(case.model)
        x = case.x.detach().clone().requires_grad_(case.x.requires_grad)
        m = rc.compile(net, memory_budget=budget, time_limit_s=time_limit_s, memo=memo)
        tag = f"seed {case.seed} budget {budget}"
        try:
            _step(net, m, x)
            with LiveStorageTracker() as mem:
                step_loss = _train_step(net, m, x)
            loss, grads, xg = _results(net, step_loss, x)
            del step_loss
        except rc.InfeasibleBudgetError as exc:
            res.failures.append(f"{tag}: infeasible although the smallest feasible is {smallest}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - every crash is a finding, reported with its seed
            res.failures.append(f"{tag}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        ok = _agrees(loss, grads, xg, eager, exact)
        if not ok and exact:
            # PyTorch's own capture may round differently from eager (a kernel called on another
            # layout, a shared module's gradients summed in another order): then the plan must be
            # bit-exact with AOTAutograd's unplanned step and allclose to eager
            if not aot:
                aot.append(aot_reference())
            ok = _agrees(loss, grads, xg, aot[0], True) and _agrees(loss, grads, xg, eager, False)
            res.aot_rounding = res.aot_rounding or ok
        if not ok:
            bad = [n for n in eager[1] if not _same(grads[n], eager[1][n], exact)]
            res.failures.append(f"{tag}: loss or gradients differ from eager ({bad[:4]})")
        if any(not torch.equal(b, eager_buffers[n]) for n, b in net.named_buffers()):
            res.failures.append(f"{tag}: buffers differ from eager")
        if budget is not None and mem.peak_bytes > budget:
            res.failures.append(f"{tag}: measured {mem.peak_bytes} above the budget")
        if mem.peak_bytes != m.plan.peak_bytes:
            res.failures.append(f"{tag}: measured {mem.peak_bytes} != predicted {m.plan.peak_bytes}")
        res.runs.append({"budget": budget, "predicted": m.plan.peak_bytes, "measured": mem.peak_bytes,
                         "recomputed": len(m.plan.recomputed), "ok": ok})
        if budget is not None:
            planned.append((budget, m.plan.peak_bytes))
    planned.sort()
    for (b1, p1), (b2, p2) in zip(planned, planned[1:]):
        if b1 < b2 and p1 > p2:
            res.failures.append(f"seed {case.seed}: budget {b1} planned peak {p1} > budget {b2}'s {p2}")
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:50", help="START:STOP (default 0:50)")
    parser.add_argument("--time-limit", type=float, default=1.0, help="seconds per solve (default 1)")
    parser.add_argument("--out", help="append one JSON line per model to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    args = parser.parse_args(argv)
    start, stop = (int(s) for s in args.seeds.split(":"))
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    totals = {"models": 0, "skipped": 0, "aot rounding": 0, "runs": 0, "failing models": 0, "failures": 0,
              "recomputing runs": 0}
    kinds: dict[str, int] = {}
    for seed in range(start, stop):
        res = check_model(random_model(seed), time_limit_s=args.time_limit)
        totals["models"] += 1
        totals["skipped"] += res.skipped is not None
        totals["aot rounding"] += res.aot_rounding
        totals["runs"] += len(res.runs)
        totals["recomputing runs"] += sum(r["recomputed"] > 0 for r in res.runs)
        totals["failing models"] += bool(res.failures)
        totals["failures"] += len(res.failures)
        for f in res.failures:
            kind = f.split(": ", 1)[1].split(" ")[0] if ": " in f else f
            kinds[kind] = kinds.get(kind, 0) + 1
            if args.verbose:
                print(f, flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(res.__dict__) + "\n")
    print(f"fuzz seeds {start}:{stop} in {time.perf_counter() - t0:.0f} s")
    for k, v in totals.items():
        print(f"  {k:18} {v}")
    for k, v in sorted(kinds.items()):
        print(f"  failure kind {k!r}: {v}")
    return 1 if totals["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
