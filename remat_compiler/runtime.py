"""What a compiled module needs at run time: gradients that stay None where eager leaves them None,
the original forward's signature, and one plan for every rank under torch.distributed."""
from __future__ import annotations

import inspect
import weakref
from typing import Callable

import networkx as nx
import torch

from remat_compiler.errors import InfeasibleBudgetError, RematError
from remat_compiler.graph import CostGraph
from remat_compiler.plan import Plan

__all__ = ["GradRecord", "GradGate", "grad_deps", "ForwardWithSignature", "distributed", "on_rank0", "plan_on_rank0"]


class GradRecord:
    """Which of a call's outputs backward reached: filled by hooks on the outputs, read by the gate."""

    def __init__(self, entry):
        self.entry = entry
        self.reached: set[int] = set()

    def hook(self, i: int) -> Callable:
        def mark(grad):
            if grad is not None:  # autograd calls the hooks of unreached outputs with None
                self.reached.add(i)
        return mark


class GradGate(torch.autograd.Function):
    """Identity on the inputs that require grad; in backward, None for each input whose gradient
    reads only outputs backward never reached, as in eager (AOTAutograd's backward gets zeros for
    unused outputs and would hand back zero gradients where eager leaves ``.grad`` None)."""

    @staticmethod
    def forward(ctx, record, positions, *tensors):
        ctx.set_materialize_grads(False)  # an input backward gives no gradient stays None
        ctx.record, ctx.positions = record, positions
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        deps, reached = ctx.record.entry.grad_deps, ctx.record.reached
        out = []
        for pos, g in zip(ctx.positions, grads):
            d = deps[pos] if deps is not None and pos < len(deps) else None
            out.append(None if g is None or (d is not None and not (d & reached)) else g)
        return (None, None, *out)


def grad_deps(cg: CostGraph) -> list | None:
    """For each flat input, the indices of the tangents its gradient depends on (None: no gradient)."""
    tangents = {t: i for i, t in enumerate(cg.tangents)}
    deps = []
    for o in cg.bw_outputs:
        if o is None:
            deps.append(None)
            continue
        deps.append(frozenset(tangents[a] for a in nx.ancestors(cg.g, o) | {o} if a in tangents))
    return deps


class ForwardWithSignature:
    """``CompiledModule.forward``: on an instance, the compiled step with the original ``forward``'s
    signature (HF ``Trainer`` reads it to pick the dataset columns the model takes); on the class,
    the plain step function."""

    def __get__(self, obj, objtype=None) -> Callable:
        if obj is None:
            return objtype._step
        fn = obj.__dict__.get("_forward_with_signature")
        if fn is None or fn.owner() is not obj:  # (a copy made without __getstate__ has the original's)
            step = obj._step

            def fn(*args, **kwargs):
                return step(*args, **kwargs)
            fn.owner = weakref.ref(obj)
            try:
                fn.__signature__ = inspect.signature(obj._orig_mod.forward)
            except (TypeError, ValueError):  # a forward without a signature (a builtin)
                pass
            fn.__doc__ = obj._orig_mod.forward.__doc__
            obj.__dict__["_forward_with_signature"] = fn
        return fn


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def on_rank0(make: Callable[[], tuple], what: str) -> tuple:
    """Under torch.distributed: rank 0 runs ``make`` (a picklable tuple) and broadcasts it, and every
    rank returns it. An error on rank 0 is told to the others before it is raised there (a rank
    that failed alone would leave them waiting in the broadcast); they raise
    ``RematError("rank 0 could not <what>: ...")``."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    payload, failure = [None], None
    if dist.get_rank() == 0:
        try:
            payload = [make()]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            payload, failure = [("error", f"{type(exc).__name__}: {exc}")], exc
    with unset_fake_temporarily():  # planning runs inside AOTAutograd's fake mode; the broadcast is real
        dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    if payload[0][0] == "error":
        raise RematError(f"rank 0 could not {what}: {payload[0][1]}")
    return payload[0]


def plan_on_rank0(make_plan: Callable[[], tuple[Plan, str]]) -> tuple[Plan, str]:
    """Under torch.distributed every rank runs rank 0's plan (a differing plan deadlocks collectives):
    rank 0 makes it (``make_plan`` returns the plan and where it came from) and broadcasts it, or the
    error it met, which every rank then raises (:func:`on_rank0`). Other ranks do not solve: they
    return rank 0's plan with ``"rank 0"`` as where it came from."""
    made: list[tuple[Plan, str]] = []

    def make() -> tuple:
        try:
            made.append(make_plan())
        except InfeasibleBudgetError as exc:
            return ("infeasible", exc.budget_bytes, exc.min_feasible_bytes, exc.proven, str(exc))
        return ("plan", made[0][0].to_json())

    kind, *rest = on_rank0(make, "plan this step")
    if kind == "infeasible":
        budget, smallest, proven, message = rest
        exc = InfeasibleBudgetError(budget, smallest, proven=proven)
        exc.args = (message,)
        raise exc
    return made[0] if made else (Plan.from_json(rest[0]), "rank 0")
