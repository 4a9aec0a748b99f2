"""Planning one rank of an N-way FSDP2 step in one process, without weights or a real process group.

:func:`shard_for_planning`, inside :func:`fake_process_group` (torch's fake process group,
``torch.testing._internal.distributed.fake_pg``: collectives that move nothing; this process is
rank 0 of ``world``), shards a copy of the model as
torchtitan shards it (``fully_shard`` on every block of its repeated layers, then on the root) and
returns its :class:`~remat_compiler.fsdp.step.ShardedStep`. On the meta device that is a 7B model's
rank-0 shards without memory; tracing it gives the graph a real rank traces (the same padded
shards, all-gathers and reduce-scatters), so the plan and its predicted peak are one rank's of the
real N-way step. :func:`remat_compiler.api.plan_sharded` is :func:`remat_compiler.plan_model` on it,
with each unit's keep-or-re-gather choice recorded (``plan_model(..., fsdp=N)`` and the CLI's ``--fsdp N``
call it); it lives in :mod:`remat_compiler.api`, above this module, so that nothing here imports back up.

>>> with torch.device("meta"):                                         # doctest: +SKIP
...     model = transformers.AutoModelForCausalLM.from_config(config)
>>> planned = remat_compiler.plan_model(model, (ids,), {"labels": ids}, "70GiB", fsdp=8)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from remat_compiler.errors import UnsupportedShardingError
from remat_compiler.fsdp.step import ShardedStep
from remat_compiler.fsdp.units import is_fsdp_model

__all__ = ["fake_process_group", "block_lists", "shard_for_planning"]


@contextlib.contextmanager
def fake_process_group(world: int):
    """This process as rank 0 of a fake process group of ``world`` ranks while the ``with`` block
    runs (then destroyed, so nothing after it thinks it runs distributed); inside another such
    block of the same size, that one's group.

    Raises
    ------
    UnsupportedShardingError
        If ``world`` is below 2, or a real process group (or a fake one of another size) is already
        initialized.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise UnsupportedShardingError(f"fsdp={world!r}: plan FSDP over 2 ranks or more (an int); one "
                                       f"rank is the unsharded model, planned without fsdp=")
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world:
            yield
            return
        raise UnsupportedShardingError(
            f"fsdp={world} plans one rank in this process over a fake process group, but a process "
            f"group ({dist.get_backend()}, {dist.get_world_size()} ranks) is already initialized: on "
            f"real ranks, shard the model and compile it (remat_compiler.compile), or plan it in a "
            f"process of its own")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def block_lists(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The model's repeated blocks, as torchtitan shards them: each ``nn.ModuleList`` of two or
    more modules of one class (a transformer's layers), outermost only."""
    found, inside = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            found.append(m)
            inside.add(name)
    return found


def shard_for_planning(model: torch.nn.Module, world: int, *, mp_policy=None, device=None) -> ShardedStep:
    """Rank 0's step of ``model`` sharded over ``world`` ranks (see the module docstring), inside
    :func:`fake_process_group`: a copy of the model, ``fully_shard`` on every block of
    :func:`block_lists` and then on the root (with ``mp_policy``). Its collectives are those of the
    backend that runs on ``device`` (the device the step is planned for; default the CPU): gloo's on
    the CPU (both written as all-to-alls, :mod:`remat_compiler.fsdp.gather`), else NCCL's.

    Raises
    ------
    UnsupportedShardingError
        For a model with no repeated blocks, one sharded already, or an FSDP2 setup the compiled
        step does not reproduce.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if is_fsdp_model(model):
        raise UnsupportedShardingError(
            f"fsdp={world} shards the model itself: pass it unsharded (on the meta device), or compile "
            f"the sharded model on its ranks")
    lists = block_lists(model)
    if not lists:
        raise UnsupportedShardingError(
            f"fsdp={world}: {type(model).__name__} has no repeated blocks (an nn.ModuleList of layers "
            f"of one class) to make FSDP units of; shard it with fully_shard on real ranks and compile it")
    model = copy.deepcopy(model)  # the caller's model stays unsharded
    mesh = init_device_mesh("cpu", (world,))
    kw = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, **kw)
    fully_shard(model, **kw)
    return ShardedStep(model, gloo=device is None or torch.device(device).type == "cpu")
