"""A unit's all-gather as a traced functional collective, and its reduce-scatter as its backward.

:class:`GatherUnit` is FSDP2's unshard and gradient reduction written as one autograd function,
the way SimpleFSDP writes them (``redistribute(..., forward_dtype=param_dtype,
backward_dtype=reduce_dtype)``): forward casts the rank's padded shards to the unit's
``param_dtype`` and all-gathers them flat (one ``_c10d_functional.all_gather_into_tensor`` for the
unit, as FSDP2 issues one); backward casts the gradient of the gathered buffer to ``reduce_dtype``,
reduce-scatters it with a sum, divides by the unit's divide factor (the world size by default: the
mean over ranks, as FSDP2) and hands each shard its piece in the parameter's own dtype.

On a gloo group (CPU tensors) both collectives are written as all-to-alls, in buffers the plan
sees and frees where it says:

- gloo's ``all_gather_into_tensor`` gathers into a flat buffer of its own the size of the result and
  then copies it out (so the gather peaks at twice the gathered bytes, half of them in no graph
  value). Here the rank's flat shards are repeated once per rank (``repeat``) and all-to-all'ed:
  row ``r`` of the result is rank ``r``'s shards. The same two buffers, as graph values, and the
  same bytes over the link as an all-gather (an all-reduce of the placed shards would send twice
  as many).
- gloo's ``reduce_scatter_tensor`` all-reduces a clone of its input that no graph value holds, and
  its worker thread may free that clone after the wait returns (seen on 2 ranks: a 1 MiB gradient's
  clone still live at the next allocation). Here the gradient is all-to-all'ed (rank ``r`` gets
  every rank's gradient of its shard, one row each) and the rows are summed: the received buffer is
  the clone's size, a graph value, and half the all-reduce's bytes cross the link.

gloo's all-to-all allocated nothing but its result in a probe on 2 ranks (one allocation, the
result's bytes), and the emitted code holds both buffers until gloo's thread has let go of them
(:mod:`remat_compiler.collectives`). The rows are summed in rank
order; on 2 ranks that is the sum gloo's all-reduce makes, bit for bit. The cost model charges a
collective the bytes a rank sends (:func:`remat_compiler.passes.costs.sent_bytes`): the all-to-all of
the repeated shards ``(world - 1) / world`` of them, ``(world - 1)`` shards, what a ring all-gather
sends; the gradient's all-to-all what a ring reduce-scatter sends.

A step planned over a fake group (:mod:`remat_compiler.fsdp.planning`) is written as the backend
of the device it is planned for runs it: gloo's on the CPU, the plain collectives on an accelerator.

Traced by AOTAutograd, the gathered buffer is a forward value like any other: the plan saves it (or
the unsharded parameters cut from it) to backward, which is FSDP2's ``reshard_after_forward=False``,
or frees it and recomputes it there, a second all-gather charged in bytes over the link, which is
``reshard_after_forward=True``.

>>> gathered = GatherUnit.apply(spec, *shards)                     # doctest: +SKIP
>>> params = unsharded_params(gathered, unit)                      # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from remat_compiler.fsdp.units import Unit

__all__ = ["GatherSpec", "GatherUnit", "unsharded_params"]


@dataclass(frozen=True)
class GatherSpec:
    """What one unit's gather needs: its group, world size, dtypes and divide factor, and whether
    the group runs CPU tensors' collectives with gloo (then both are all-to-alls; see the module
    docstring)."""

    group: dist.ProcessGroup
    world: int
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    divide_factor: float
    gloo: bool = False

    @classmethod
    def of(cls, unit: Unit, *, gloo: bool | None = None) -> "GatherSpec":
        """The unit's spec; ``gloo`` (default: whether the unit's group has a gloo backend) says
        whether to write the collectives as gloo runs them (planning over a fake group sets it)."""
        group = unit.process_group
        if gloo is None:
            gloo = "gloo" in str(dist.get_backend(group))
        return cls(group, unit.world, unit.param_dtype, unit.reduce_dtype, unit.divide_factor, gloo)


def _waited(t: torch.Tensor) -> torch.Tensor:
    # eagerly funcol hands back an AsyncCollectiveTensor; while tracing it emitted wait_tensor already
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class GatherUnit(torch.autograd.Function):
    """All-gather a unit's padded shards (cast to ``param_dtype``) into one flat buffer of
    ``world * sum(shard sizes)`` elements; backward reduce-scatters in ``reduce_dtype``."""

    @staticmethod
    def forward(ctx, spec: GatherSpec, *shards: torch.Tensor) -> torch.Tensor:
        ctx.spec = spec
        ctx.sizes = [s.numel() for s in shards]
        ctx.dtypes = [s.dtype for s in shards]
        cast = [s if spec.param_dtype is None else s.to(spec.param_dtype) for s in shards]
        flat = cast[0].reshape(-1) if len(cast) == 1 else torch.cat([c.reshape(-1) for c in cast])
        if spec.gloo and flat.device.type == "cpu":  # in buffers the plan sees (module docstring)
            return _waited(funcol.all_to_all_single(flat.repeat(spec.world), None, None, spec.group))
        return _waited(funcol.all_gather_tensor(flat, 0, spec.group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        if spec.reduce_dtype is not None and grad.dtype != spec.reduce_dtype:
            grad = grad.to(spec.reduce_dtype)
        if spec.gloo and grad.device.type == "cpu":  # row r: rank r's gradient of this rank's shard
            received = _waited(funcol.all_to_all_single(grad.contiguous(), None, None, spec.group))
            reduced = received.view(spec.world, -1).sum(0) / spec.divide_factor
        else:
            reduced = _waited(funcol.reduce_scatter_tensor(grad.contiguous(), "sum", 0, spec.group))
            reduced = reduced / spec.divide_factor
        pieces = reduced.split(ctx.sizes) if len(ctx.sizes) > 1 else (reduced,)
        return (None, *(p if p.dtype == d else p.to(d) for p, d in zip(pieces, ctx.dtypes)))


def unsharded_params(gathered: torch.Tensor, unit: Unit) -> list[torch.Tensor]:
    """Cut the unit's unsharded parameters out of its gathered buffer: rank ``r``'s shards are
    row ``r`` of ``gathered.view(world, -1)``; each parameter's rows of every rank, stacked, are
    the padded parameter, whose first ``orig_size[0]`` rows are the parameter (the padding is at
    the end: every chunk but the last ones is full)."""
    rows = gathered.view(unit.world, -1)
    pieces = torch.split(rows, [up.padded_numel for up in unit.params], dim=1) if len(unit.params) > 1 else (rows,)
    out = []
    for piece, up in zip(pieces, unit.params):
        size = up.orig_size
        full = piece.reshape(unit.world * up.padded_rows, *size[1:])
        if full.size(0) != size[0]:
            full = full.narrow(0, 0, size[0])
        out.append(full)
    return out
