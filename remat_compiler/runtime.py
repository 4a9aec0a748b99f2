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

__all__ = ["GradRecord", "GradGate", "grad_deps", "ForwardWithSignature", "distributed", "plan_on_rank0"]


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


def plan_on_rank0(make_plan: Callable[[], Plan]) -> Plan:
    """Under torch.distributed every rank runs rank 0's plan (a differing plan deadlocks collectives):
    rank 0 solves and broadcasts the plan, or the error it met, which every rank then raises (a rank
    that failed alone would leave the others waiting in the broadcast). Other ranks do not solve."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    plan, payload, failure = None, [None], None
    if dist.get_rank() == 0:
        try:
            plan = make_plan()
            payload = [("plan", plan.to_json())]
        except InfeasibleBudgetError as exc:
            payload = [("infeasible", exc.budget_bytes, exc.min_feasible_bytes, exc.proven, str(exc))]
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks are told
            payload = [("error", f"{type(exc).__name__}: {exc}")]
            failure = exc
    with unset_fake_temporarily():  # planning runs inside AOTAutograd's fake mode; the broadcast is real
        dist.broadcast_object_list(payload, src=0)
    kind, *rest = payload[0]
    if kind == "infeasible":
        budget, smallest, proven, message = rest
        exc = InfeasibleBudgetError(budget, smallest, proven=proven)
        exc.args = (message,)
        raise exc
    if kind == "error":
        if failure is not None:
            raise failure
        raise RematError(f"rank 0 could not plan this step: {rest[0]}")
    return plan if plan is not None else Plan.from_json(rest[0])
