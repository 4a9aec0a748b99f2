"""The expert-parallel all-to-alls of the MoE layer: equal splits here, the routed (uneven) ones in
:mod:`._uneven`.

**Equal splits** (``MoELayer(splits="equal")``). The layer moves fixed-size capacity buffers between
ranks, so every all-to-all splits dim 0 into ``world`` equal chunks: chunk ``j`` goes to rank ``j`` and
the ``j``-th chunk of the result came from rank ``j``. The calls go through
``torch.distributed._functional_collectives``, so under AOTAutograd / make_fx they are recorded as
``_c10d_functional.all_to_all_single`` and ``_c10d_functional.wait_tensor`` nodes. With no group, or a
group of one rank, every helper is the identity and no collective is issued (a single-process trace
has no communication nodes).

Layouts (``E`` experts in total, ``E_local = E / world`` per rank, capacity ``C`` rows per expert):

- token side: ``[E, C, ...]``, experts in global order; rank ``r`` owns experts
  ``r * E_local .. (r + 1) * E_local - 1``.
- expert side: ``[E_local, world * C, ...]``, the rows of each local expert grouped by source rank.

**Uneven splits** (``MoELayer(splits="uneven")``, dropless). Each rank sends exactly its routed rows,
``T * top_k`` of them sorted by expert, and rank ``j`` receives as many as were routed to its experts:
``all_to_all_single`` with input and output split sizes, as expert-parallel training does. The counts
are all-gathered first (:func:`all_gather_counts`), and :func:`dropless_route` turns them into a
:class:`Route`. The exchange itself is one custom op, ``remat::all_to_all_uneven``
(:func:`all_to_all_uneven`), opaque to the trace, whose only allocation is its output; it is its own
transpose with the splits swapped, which is its backward.

Why padded buffers. A traced graph has static shapes, and the plan is made on it. Two ways fit that:
trace with worst-case split sizes and run with the real ones, or keep every buffer at the capacity
bound and exchange the real counts into it. The first runs tensors of other sizes than the traced
ones, so the plan's byte accounting (what is live, saved, freed and when) describes a graph that
never runs, and its peak is an upper bound only by an argument about every op's sizes that nothing
checks. The second is chosen: the rows land in buffers padded to the bound (the receive buffer has
``E_local * N + 1`` rows, ``N = world * C`` per local expert, its last row always zero; the first
``sum(recv_splits)`` are received), and the expert side is ``[E_local, N, ...]`` as in equal mode. So
every routing that fits allocates the same bytes at the same points as the traced graph: the plan's
predicted peak is the measured one for all of them, checked by the same simulator. Only the bytes
sent vary; the cost model charges the padded buffer's, an upper bound. A routing that does not fit
raises :class:`~remat_compiler.errors.ExpertCapacityError` on every rank before any row moves (each
rank sees every rank's counts), never drops. The route's op takes this rank's index as a constant,
the one place a rank's graph differs from another's (graph fingerprints and plans do not depend on
it: every rank runs rank 0's plan).

- token side: ``[T * top_k, ...]`` rows sorted by global expert (so by destination rank).
- receive buffer: ``[E_local * N + 1, ...]``, by source rank, then local expert; zero past the rows.
- expert side: ``[E_local, N, ...]``, each local expert's rows from rank 0, then rank 1, ..., then zeros.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["group_world_size", "group_rank", "all_to_all", "all_to_all_nograd", "token_to_expert", "expert_to_token"]


def group_world_size(group) -> int:
    """Number of ranks in ``group``; 1 when ``group`` is None.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None

    Returns
    -------
    int
    """
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 when ``group`` is None.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None

    Returns
    -------
    int
    """
    return 0 if group is None else dist.get_rank(group)


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    # In eager mode funcol returns an AsyncCollectiveTensor; waiting here keeps the rest of the
    # layer on plain tensors. While tracing, funcol already emitted wait_tensor.
    if isinstance(t, funcol.AsyncCollectiveTensor):
        return t.wait()
    return t


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable equal-split all-to-all along dim 0.

    The backward is the same all-to-all applied to the gradient (an equal-split all-to-all is its
    own transpose).

    Parameters
    ----------
    x : torch.Tensor
        Tensor whose dim 0 is divisible by the group size.
    group : torch.distributed.ProcessGroup or None
        Identity (no call) when None or of size 1.

    Returns
    -------
    torch.Tensor
        Same shape as ``x``.

    Raises
    ------
    ValueError
        If dim 0 is not divisible by the group size.
    """
    world = group_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, world)
    return _unwrap(funcol.all_to_all_single_autograd(x.contiguous(), None, None, group))


def all_to_all_nograd(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 without autograd, for use inside a custom backward.

    Issues ``all_to_all_single`` and waits for it: traced, the same ``all_to_all_single`` and one
    ``wait_tensor`` node as :func:`all_to_all` records (a second, explicit wait would make the
    forward of the fused combine differ from the autograd one's by a node).

    Parameters
    ----------
    x : torch.Tensor
        Tensor whose dim 0 is divisible by the group size.
    group : torch.distributed.ProcessGroup or None
        Identity (no call) when None or of size 1.

    Returns
    -------
    torch.Tensor
        Same shape as ``x``.

    Raises
    ------
    ValueError
        If dim 0 is not divisible by the group size.
    """
    world = group_world_size(group)
    if world == 1:
        return x
    _check_divisible(x, world)
    # funcol waits itself while tracing (one wait_tensor node, as the autograd all_to_all's)
    return _unwrap(funcol.all_to_all_single(x.contiguous(), None, None, group))


def token_to_expert(buf: torch.Tensor, group, *, differentiable: bool = True) -> torch.Tensor:
    """Send a token-side buffer ``[E, C, ...]`` to the experts' owners: ``[E_local, world*C, ...]``.

    Parameters
    ----------
    buf : torch.Tensor
        ``[E, C, ...]`` with experts in global order.
    group : torch.distributed.ProcessGroup or None
    differentiable : bool
        Use the autograd all-to-all (True) or the plain one (False, inside a custom backward).

    Returns
    -------
    torch.Tensor
        ``[E_local, world * C, ...]``: for each local expert, the rows of rank 0, then rank 1, ...

    Raises
    ------
    ValueError
        If ``E`` is not divisible by the group size.
    """
    world = group_world_size(group)
    if world == 1:
        return buf
    num_experts, capacity, rest = buf.shape[0], buf.shape[1], buf.shape[2:]
    a2a = all_to_all if differentiable else all_to_all_nograd
    received = a2a(buf, group)  # [world(src), E_local, C, ...] flattened on dim 0
    local = num_experts // world
    received = received.view(world, local, capacity, *rest)
    return received.transpose(0, 1).reshape(local, world * capacity, *rest)


def expert_to_token(buf: torch.Tensor, group, *, differentiable: bool = True) -> torch.Tensor:
    """Inverse of :func:`token_to_expert`: ``[E_local, world*C, ...]`` back to ``[E, C, ...]``.

    Parameters
    ----------
    buf : torch.Tensor
        ``[E_local, world * C, ...]`` expert-side rows, grouped by destination rank.
    group : torch.distributed.ProcessGroup or None
    differentiable : bool
        Use the autograd all-to-all (True) or the plain one (False, inside a custom backward).

    Returns
    -------
    torch.Tensor
        ``[E, C, ...]`` with experts in global order, for this rank's tokens.

    Raises
    ------
    ValueError
        If the row count is not divisible by the group size.
    """
    world = group_world_size(group)
    if world == 1:
        return buf
    local, rows, rest = buf.shape[0], buf.shape[1], buf.shape[2:]
    if rows % world:
        raise ValueError(
            f"expert-side buffer has {rows} rows per expert, not divisible by the group size "
            f"{world}; pass the output of token_to_expert unchanged in shape"
        )
    capacity = rows // world
    per_dest = buf.view(local, world, capacity, *rest).transpose(0, 1).contiguous()
    a2a = all_to_all if differentiable else all_to_all_nograd
    received = a2a(per_dest.view(world * local, capacity, *rest), group)
    return received  # [world(owner) * E_local, C, ...] = [E, C, ...] in global expert order


def _check_divisible(x: torch.Tensor, world: int) -> None:
    if x.shape[0] % world:
        raise ValueError(
            f"all-to-all needs dim 0 ({x.shape[0]}) divisible by the group size ({world}); "
            "pad the buffer or choose num_experts divisible by the world size"
        )


# ---------------------------------------------------------------- uneven splits (dropless)
