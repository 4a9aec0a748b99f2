"""The routed (uneven) all-to-alls of the MoE layer (``MoELayer(splits="uneven")``, dropless): the
counts all-gathered, a :class:`Route` made of them, and one exchange op, ``remat::all_to_all_uneven``.
Why the buffers are padded to the capacity bound, and the layouts: :mod:`._dist`'s docstring."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from remat_compiler.collectives import release_collective_inputs, use_counts
from remat_compiler.errors import ExpertCapacityError

from ._dist import _unwrap, group_rank, group_world_size

__all__ = ["Route", "all_gather_counts", "dropless_route", "all_to_all_uneven", "rows_to_experts", "experts_to_rows"]


class Route(NamedTuple):
    """Where one dropless step's rows go, on this rank (int64 tensors made by :func:`dropless_route`).

    Attributes
    ----------
    send_splits : torch.Tensor
        ``[world]`` rows this rank sends to each rank (sum ``T * top_k``).
    recv_splits : torch.Tensor
        ``[world]`` rows it receives from each rank.
    expert_rows : torch.Tensor
        ``[E_local, N]``: the received row each expert-side row holds, or ``E_local * N`` (the receive
        buffer's zero row) where the row is unused.
    recv_slots : torch.Tensor
        ``[E_local * N]``: the flat expert-side row that holds each received row (0 past the rows
        received, which are not sent back).
    """

    send_splits: torch.Tensor
    recv_splits: torch.Tensor
    expert_rows: torch.Tensor
    recv_slots: torch.Tensor


def all_gather_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows per expert: ``[E]`` here -> ``[world, E]`` (row ``j`` from rank ``j``).

    A functional all-gather (a ``_c10d_functional.all_gather_into_tensor`` node in a trace); with no
    group or one rank, ``counts.view(1, E)`` and no collective.
    """
    if group_world_size(group) == 1:
        return counts.view(1, -1)
    gathered = _unwrap(funcol.all_gather_single(counts.contiguous(), 0, group))
    return gathered.view(group_world_size(group), -1)


@torch.library.custom_op("remat::dropless_route", mutates_args=())
def _dropless_route(counts: torch.Tensor, rank: int, rows_per_expert: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    world, num_experts = counts.shape
    local = num_experts // world
    totals = counts.sum(0)  # rows each expert receives, from all ranks
    worst = int(totals.max())
    if worst > rows_per_expert:
        expert = int(totals.argmax())
        rows_sent = int(counts[0].sum())  # T * top_k, the same on every rank
        factor = worst / world * num_experts / rows_sent
        raise ExpertCapacityError(
            f"expert {expert} (on rank {expert // local}) was routed {worst} rows in this step, but the "
            f"dropless MoE layer holds at most {rows_per_expert} rows per expert ({rows_per_expert // world}"
            f" per source rank x {world} ranks; its buffers and the memory plan were made for that); "
            f"build the MoELayer with capacity_factor >= {factor:.4g} and compile again "
            f"(capacity_factor = num_experts / top_k fits every routing)")
    mine = counts.view(world, world, local)  # [source rank, destination rank, local expert]
    send_splits = mine[rank].sum(1)
    recv = mine[:, rank, :]  # [source rank, local expert]
    recv_splits = recv.sum(1)
    flat = recv.reshape(-1)
    block_in_recv = (flat.cumsum(0) - flat).view(world, local).t()  # start of (s, l) in the received rows
    upto = recv.cumsum(0).t().contiguous()  # [l, s]: rows of expert l from ranks 0..s
    block_in_expert = upto - recv.t()  # start of (s, l) in expert l's rows
    j = torch.arange(rows_per_expert).expand(local, rows_per_expert).contiguous()
    source = torch.searchsorted(upto, j, right=True)  # the rank row j of expert l came from; world: unused
    used = source < world
    source = source.clamp(max=world - 1)
    row = block_in_recv.gather(1, source) + j - block_in_expert.gather(1, source)
    num_rows = local * rows_per_expert
    expert_rows = torch.where(used, row, num_rows)
    slots = torch.zeros(num_rows + 1, dtype=torch.long)  # unused rows all write the dropped last entry
    recv_slots = slots.scatter(0, expert_rows.reshape(-1), torch.arange(num_rows))[:num_rows].clone()
    return send_splits, recv_splits, expert_rows, recv_slots


@_dropless_route.register_fake
def _(counts, rank, rows_per_expert):
    world, num_experts = counts.shape
    local = num_experts // world
    return (counts.new_empty(world), counts.new_empty(world), counts.new_empty(local, rows_per_expert),
            counts.new_empty(local * rows_per_expert))


def dropless_route(counts: torch.Tensor, group, rows_per_expert: int) -> Route:
    """The :class:`Route` of one dropless step from every rank's rows per expert.

    One custom op (``remat::dropless_route``), so the checks and index arithmetic on the counts are
    one opaque node of the traced graph, run on the step's real counts.

    Parameters
    ----------
    counts : torch.Tensor
        ``[world, E]`` int64 from :func:`all_gather_counts`: rows rank ``s`` routes to expert ``e``.
    group : torch.distributed.ProcessGroup or None
    rows_per_expert : int
        ``N``, the rows each expert's buffer holds (``world * C``).

    Returns
    -------
    Route

    Raises
    ------
    ExpertCapacityError
        If an expert is routed more than ``rows_per_expert`` rows. Every rank sees the same counts,
        so every rank raises, before any row is exchanged.
    """
    world = group_world_size(group)
    if counts.dim() != 2 or counts.shape[0] != world or counts.shape[1] % world:
        raise ValueError(f"counts {tuple(counts.shape)} must be [world={world}, E] with E divisible by "
                         "world; pass all_gather_counts' result")
    return Route(*_dropless_route(counts, group_rank(group), rows_per_expert))


@torch.library.custom_op("remat::all_to_all_uneven", mutates_args=())
def _all_to_all_uneven(x: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor,
                       out_rows: int, group_name: str) -> torch.Tensor:
    send, recv = send_splits.tolist(), recv_splits.tolist()
    if sum(send) > x.shape[0] or sum(recv) > out_rows:
        raise ExpertCapacityError(
            f"all_to_all_uneven: {sum(send)} rows to send from a {x.shape[0]}-row buffer and {sum(recv)} "
            f"to receive into {out_rows} rows; the route does not fit these buffers (make the route with "
            "dropless_route and the buffers from the same rows_per_expert)")
    out = x.new_empty((out_rows, *x.shape[1:]))
    out[sum(recv):].zero_()
    # gloo's worker thread holds a collective's tensors a little after the wait: hold ours until then,
    # so they are freed where the plan frees them (see remat_compiler.collectives)
    held = use_counts(x, out)
    sent, received = x.narrow(0, 0, sum(send)), out.narrow(0, 0, sum(recv))
    group = torch.distributed.distributed_c10d._resolve_process_group(group_name)
    dist.all_to_all_single(received, sent, output_split_sizes=recv, input_split_sizes=send, group=group)
    del sent, received
    release_collective_inputs(held, x, out)
    return out


@_all_to_all_uneven.register_fake
def _(x, send_splits, recv_splits, out_rows, group_name):
    return x.new_empty((out_rows, *x.shape[1:]))


def _uneven_setup(ctx, inputs, output):
    x, send_splits, recv_splits, out_rows, group_name = inputs
    ctx.save_for_backward(send_splits, recv_splits)
    ctx.rows, ctx.group_name = x.shape[0], group_name


def _uneven_backward(ctx, grad):
    send_splits, recv_splits = ctx.saved_tensors  # the transpose: what was received goes back
    return (_all_to_all_uneven(grad.contiguous(), recv_splits, send_splits, ctx.rows, ctx.group_name),
            None, None, None, None)


_all_to_all_uneven.register_autograd(_uneven_backward, setup_context=_uneven_setup)


def all_to_all_uneven(x: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor,
                      out_rows: int, group) -> torch.Tensor:
    """Differentiable all-to-all with split sizes, between buffers of static size.

    Sends the first ``sum(send_splits)`` rows of ``x`` (``send_splits[j]`` of them to rank ``j``, in
    rank order) and returns ``out_rows`` rows: the first ``sum(recv_splits)`` received (from rank 0,
    then rank 1, ...), zeros after them. Its backward is the same exchange with the splits swapped.

    Parameters
    ----------
    x : torch.Tensor
        ``[rows, ...]``.
    send_splits, recv_splits : torch.Tensor
        ``[world]`` int64 (a :class:`Route`'s).
    out_rows : int
        Rows of the result, at least ``sum(recv_splits)``.
    group : torch.distributed.ProcessGroup or None
        With no group or one rank no collective is issued: every row stays here, so the result is the
        first ``min(rows, out_rows)`` rows of ``x`` padded with zeros (the splits are ``[rows]`` and
        ``[out_rows]`` truncated to each other, as one rank's route always has).

    Returns
    -------
    torch.Tensor
        ``[out_rows, ...]``.

    Raises
    ------
    ExpertCapacityError
        If the splits do not fit ``x`` or ``out_rows`` (the route was made for other buffers).
    """
    if group_world_size(group) == 1:
        rows = min(x.shape[0], out_rows)
        return F.pad(x[:rows], (0, 0) * (x.dim() - 1) + (0, out_rows - rows))
    return _all_to_all_uneven(x.contiguous(), send_splits, recv_splits, out_rows, group.group_name)


def rows_to_experts(rows: torch.Tensor, route: Route, group) -> torch.Tensor:
    """Token-side rows ``[T * top_k, ...]`` (sorted by expert) to the expert side ``[E_local, N, ...]``.

    The rows routed to other ranks' experts are sent there (:func:`all_to_all_uneven`), those routed
    here received, and each local expert's rows gathered into its ``N`` rows (zeros after them).
    """
    local, per_expert = route.expert_rows.shape
    received = all_to_all_uneven(rows, route.send_splits, route.recv_splits, local * per_expert + 1, group)
    return received.index_select(0, route.expert_rows.reshape(-1)).view(local, per_expert, *rows.shape[1:])


def experts_to_rows(buf: torch.Tensor, route: Route, group, rows: int) -> torch.Tensor:
    """Inverse of :func:`rows_to_experts`: ``[E_local, N, ...]`` back to this rank's ``[rows, ...]``."""
    local, per_expert = route.expert_rows.shape
    packed = buf.reshape(local * per_expert, *buf.shape[2:]).index_select(0, route.recv_slots)
    return all_to_all_uneven(packed, route.recv_splits, route.send_splits, rows, group)
