"""The strategies compared, each built as a :class:`~benchmarks.measure.Runner` on its own fresh model.

- ``eager``: the model as it is (no recompute);
- ``checkpoint``: ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)`` around every
  repeated block (:func:`checkpoint_every_block`);
- ``torch.compile``: PyTorch's own planner, ``torch.compile(model, backend="aot_eager_decomp_partition")``
  with ``torch._functorch.config.activation_memory_budget`` at each budget (:func:`planner_backend`;
  :mod:`benchmarks.inductor_peers` runs it over ``backend="inductor"``);
- the project's hand-picked MoE strategies (``moe_origin``, ``moe_fast``, ``moe_custom``) through
  ``remat_compiler.compile(model, solver=name)``;
- ``remat_compiler``: CP-SAT plans (:func:`remat_runner`) through ``remat_compiler.compile(model,
  budget, plan=plan)``, the plan made on rank 0 and shared (:class:`Comm`);
- ``moe_cpsat``: CP-SAT over the graph traced with the fused custom backward (:func:`moe_cpsat_runner`).

>>> runner = checkpoint_runner(WORKLOADS["gpt2"], quick=True)       # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import remat_compiler
from remat_compiler.check import check_plan
from remat_compiler.graph import CostGraph
from remat_compiler.errors import InfeasibleBudgetError, RematError
from remat_compiler.plan import Plan

from benchmarks.measure import Runner
from benchmarks.workloads import WorkloadSpec, blocks_of

__all__ = ["PYTORCH_BUDGETS", "MOE_STRATEGIES", "Skipped", "Comm", "eager_runner", "checkpoint_every_block",
           "checkpoint_runner", "planner_backend", "pytorch_runner", "moe_runner", "moe_cpsat_runner",
           "remat_runner", "moe_y_bytes"]

#: ``torch._functorch.config.activation_memory_budget`` settings of PyTorch's planner.
PYTORCH_BUDGETS = (1.0, 0.5, 0.3, 0.1)
#: Hand-picked MoE strategies, run on the MoE workloads.
MOE_STRATEGIES = ("moe_origin", "moe_fast", "moe_custom")


@dataclass
class Skipped:
    """A strategy point with no run: ``status`` is ``infeasible``, ``n/a`` or ``failed``; ``note`` says why."""

    strategy: str
    setting: str
    status: str
    note: str
    budget_bytes: int | None = None


class Comm:
    """Rank agreement for strategies that must be identical on every rank. One process: trivial.

    :class:`benchmarks.dist_worker.DistComm` implements the same three methods over a process group.
    """

    rank, world_size = 0, 1

    def on_rank0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` computed on rank 0 and given to every rank (picklable results only)."""
        return fn()

    def gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        return [obj]

    def max_int(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        return value


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def eager_runner(model: nn.Module) -> Runner:
    """The model as it is: the reference for FLOPs, time and gradients."""
    return Runner("eager", "-", model, _params(model))


def checkpoint_every_block(model: nn.Module, blocks_path: str) -> nn.Module:
    """Replace each block's ``forward`` with a non-reentrant ``torch.utils.checkpoint`` of it (in place).

    Parameters
    ----------
    model : nn.Module
    blocks_path : str
        Dotted path of the ModuleList of repeated blocks (``"transformer.h"``, ``"model.layers"``).

    Returns
    -------
    nn.Module
        ``model``, whose blocks now save only their inputs and recompute their insides in backward.
    """
    for block in blocks_of(model, blocks_path):
        block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def checkpoint_runner(spec: WorkloadSpec, quick: bool, group=None) -> Runner:
    """``torch.utils.checkpoint`` around every repeated block of a fresh model."""
    model, _, _ = spec.build(quick, group)
    return Runner("checkpoint", "every block", checkpoint_every_block(model, spec.blocks), _params(model))


def planner_backend(budget: float, compiles: list[int], inner: str = "aot_eager_decomp_partition") -> Callable:
    """The ``inner`` Dynamo backend (default ``aot_eager_decomp_partition``, whose graphs the step
    trackers see into; ``"inductor"`` for compiled speed) with ``activation_memory_budget = budget``.

    The config is patched while this backend compiles (AOTAutograd partitions the joint graph then),
    so several compiled modules with different budgets live side by side: each is its own backend
    callable, which Dynamo guards on (no compiled module picks up another's graph). ``compiles[0]``
    counts compilations, to show that none happens while steps are measured or timed.
    """
    from torch._dynamo.backends.registry import lookup_backend

    compile_graph = lookup_backend(inner)

    def backend(gm, example_inputs):
        compiles[0] += 1
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_graph(gm, example_inputs)
    return backend


def pytorch_runner(spec: WorkloadSpec, quick: bool, budget: float, group=None,
                   backend: str = "aot_eager_decomp_partition") -> Runner:
    """PyTorch's planner at one ``activation_memory_budget``, on a fresh model (compiled on first call
    by :func:`planner_backend` over ``backend``)."""
    model, _, _ = spec.build(quick, group)
    compiles = [0]
    compiled = torch.compile(model, backend=planner_backend(budget, compiles, backend))
    return Runner("torch.compile", f"budget {budget}", compiled, _params(model), extras={"compiles": compiles})


def moe_runner(spec: WorkloadSpec, quick: bool, name: str, group=None) -> Runner | Skipped:
    """A hand-picked MoE strategy planned for a fresh model, or why it does not apply.

    Raises
    ------
    RematError
        If planning fails for another reason than the strategy not applying.
    """
    model, args, kwargs = spec.build(quick, group)
    try:
        planned = remat_compiler.plan_model(model, args, kwargs, None, solver=name, hold_outputs=False)
    except ValueError as exc:
        if isinstance(exc, RematError):
            raise
        return Skipped(name, "-", "n/a", str(exc))
    compiled = remat_compiler.compile(model, None, solver=name, plan=planned.plan, hold_outputs=False)
    return Runner(name, "-", compiled, _params(model), plan=planned.plan,
                  prepare_s=planned.plan.solve_time_s)


def moe_y_bytes(model: nn.Module, args: tuple) -> int:
    """Bytes of the gathered expert outputs ``y`` (``[T * top_k, H]`` per MoELayer) that the autograd
    combine saves for ``d(probs)`` and the fused custom backward never stores, all layers; 0 without
    a :class:`remat_compiler.moe.MoELayer`."""
    from remat_compiler.moe import MoELayer

    x = args[0]
    total = 0
    for layer in (m for m in model.modules() if isinstance(m, MoELayer)):
        tokens = x.numel() // layer.hidden_size
        total += tokens * layer.top_k * layer.hidden_size * x.element_size()
    return total


def moe_cpsat_runner(spec: WorkloadSpec, quick: bool, budget_bytes: int, setting: str, group=None,
                     **solver_options) -> Runner | Skipped:
    """``solver="moe_cpsat"`` (CP-SAT over the fused-combine graph) at ``budget_bytes`` on a fresh model.

    Under torch.distributed rank 0 plans and every rank runs its plan (as ``remat_compiler.compile``
    does for any solver).

    Returns
    -------
    Runner or Skipped
        Skipped with status ``infeasible`` when no plan fits (the note names the smallest budget).
    """
    model, args, kwargs = spec.build(quick, group)
    try:
        planned = remat_compiler.plan_model(model, args, kwargs, budget_bytes, solver="moe_cpsat",
                                            hold_outputs=False, **solver_options)
    except InfeasibleBudgetError as exc:
        return Skipped("moe_cpsat", setting, "infeasible",
                       f"needs >= {remat_compiler.human_bytes(exc.min_feasible_bytes)}", budget_bytes)
    compiled = remat_compiler.compile(model, budget_bytes, solver="moe_cpsat", plan=planned.plan,
                                      hold_outputs=False)
    return Runner("moe_cpsat", setting, compiled, _params(model), budget_bytes=budget_bytes,
                  plan=planned.plan, prepare_s=planned.plan.solve_time_s)


def remat_runner(model: nn.Module, cg: CostGraph, budget_bytes: int, setting: str, comm: Comm,
                 **solver_options) -> Runner | Skipped:
    """A CP-SAT plan for ``budget_bytes`` (solved on rank 0, checked on every rank), compiled.

    Parameters
    ----------
    model : nn.Module
        Shared by every remat_compiler runner of the workload (each compiled module keeps its plan).
    cg : CostGraph
        The analysed graph of ``model``'s step.
    budget_bytes : int
    setting : str
        Row label (``"@ eager peak"``).
    comm : Comm
    **solver_options :
        ``time_limit_s``, ``num_workers``, ``objective``, ``memo``.

    Returns
    -------
    Runner or Skipped
        Skipped with status ``infeasible`` when no plan fits (the note names the smallest budget).
    """
    def solve():
        try:
            plan = remat_compiler.solve(cg, budget_bytes, "cpsat", **solver_options)
        except InfeasibleBudgetError as exc:
            return "infeasible", exc.min_feasible_bytes
        return "ok", plan.to_json()

    status, payload = comm.on_rank0(solve)
    if status == "infeasible":
        return Skipped("remat_compiler", setting, "infeasible",
                       f"needs >= {remat_compiler.human_bytes(payload)}", budget_bytes)
    plan = Plan.from_json(payload)
    check_plan(cg, plan)  # every rank checks the shared plan against its own graph
    compiled = remat_compiler.compile(model, budget_bytes, plan=plan, hold_outputs=False)
    return Runner("remat_compiler", setting, compiled, _params(model), budget_bytes=budget_bytes, plan=plan,
                  prepare_s=plan.solve_time_s)

