"""Expert-parallel mixture-of-experts layer with static shapes, built to be traced.

Pipeline (one submodule per step, so a graph pass can find the pieces by module path)::

    router -> permute -> dispatch (A2A) -> gemm1 -> act (SwiGLU) -> gemm2 -> combine (A2A) -> unpermute

With ``combine="fused"`` the last three steps run as one :class:`~remat_compiler.moe.combine.FusedCombine`
node that never saves the GEMM2 output. Every shape depends only on the input's shape and the
constructor arguments: routing uses one-hot cumsums and index ops, nothing calls ``.item()`` or
branches on tensor values in the traced code.

Two ways to exchange tokens (``splits``): ``"equal"`` moves fixed ``[E, C, H]`` capacity buffers with
equal-split all-to-alls and drops assignments over capacity by a fixed rule; ``"uneven"`` is dropless,
as expert-parallel training runs: each rank sends exactly its routed rows with the real split sizes,
into receive buffers padded to the capacity bound, and a routing over that bound raises (see
:mod:`remat_compiler.moe._dist` for why the padding keeps the memory plan exact for every routing).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._dist import (all_gather_counts, dropless_route, experts_to_rows, expert_to_token, group_rank,
                    group_world_size, rows_to_experts, token_to_expert)
from .combine import fused_combine, weighted_unpermute
from .hf import hf_fused_combine_mode

__all__ = [
    "MoELayer",
    "Router",
    "Permute",
    "DroplessPermute",
    "AllToAll",
    "UnevenDispatch",
    "UnevenCombine",
    "GroupedGEMM",
    "SwiGLU",
    "Unpermute",
    "FusedCombineStep",
    "MoEStack",
    "expert_capacity",
    "fused_combine_mode",
    "combine_modes",
    "combine_modes_of",
]

COMBINE_MODES = ("autograd", "fused")
SPLIT_MODES = ("equal", "uneven")


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert in the capacity buffer: ``ceil(tokens * top_k / num_experts * capacity_factor)``.

    Parameters
    ----------
    tokens : int
        Tokens on this rank.
    top_k : int
    num_experts : int
        Experts in total (all ranks).
    capacity_factor : float

    Returns
    -------
    int
        At least 1. An expert never receives more than ``tokens`` rows from one rank, so
        ``capacity_factor >= num_experts / top_k`` guarantees that nothing is dropped.
    """
    return max(1, math.ceil(tokens * top_k / num_experts * capacity_factor))


class Router(nn.Module):
    """Linear gate, softmax, top-k, and renormalisation of the kept probabilities.

    Parameters
    ----------
    hidden_size : int
    num_experts : int
    top_k : int

    Returns (forward)
    -----------------
    probs : torch.Tensor
        ``[T, top_k]``, each row sums to 1.
    experts : torch.Tensor
        ``[T, top_k]`` int64 expert ids (global), in descending probability order.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.linear = nn.Linear(hidden_size, num_experts, bias=False)

    def forward(self, x: torch.Tensor):
        scores = F.softmax(self.linear(x), dim=-1)
        probs, experts = torch.topk(scores, self.top_k, dim=-1)
        return probs / probs.sum(-1, keepdim=True), experts


class Permute(nn.Module):
    """Scatter token copies into a static ``[E, C, H]`` capacity buffer.

    Drop rule (deterministic): assignments claim rows in the order ``(k, t)`` — all first choices
    in token order, then all second choices, ... — and an assignment that finds its expert's ``C``
    rows taken is dropped (its slot is ``E * C`` and it contributes nothing to the output).

    Parameters
    ----------
    num_experts : int
        Experts in total.
    capacity_factor : float

    Returns (forward)
    -----------------
    buf : torch.Tensor
        ``[E, C, H]``, zero rows where capacity is unused.
    slot : torch.Tensor
        ``[T, top_k]`` int64 row of ``buf.view(E * C, H)`` for each assignment, ``E * C`` if dropped.
    """

    def __init__(self, num_experts: int, capacity_factor: float):
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor, experts: torch.Tensor):
        tokens, top_k = experts.shape
        num_experts = self.num_experts
        capacity = expert_capacity(tokens, top_k, num_experts, self.capacity_factor)
        order = experts.t().reshape(-1)  # [K*T], k-major: index k*T + t
        onehot = (order.unsqueeze(1) == torch.arange(num_experts, device=x.device)).long()
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of the assignment in its expert
        slot = torch.where(position < capacity, order * capacity + position, num_experts * capacity)
        # Gather, not scatter: the inverse map row -> token makes the copy an index_select, whose
        # backward needs only the index (a scatter-add would save a [T*K, H] source).
        token_of = torch.arange(tokens, device=x.device).repeat(top_k)  # assignment k*T+t -> t
        source = torch.full((num_experts * capacity + 1,), tokens, device=x.device)
        source = source.scatter(0, slot, token_of)[: num_experts * capacity]  # unused rows -> T
        padded = torch.cat([x, x.new_zeros(1, x.shape[-1])])  # row T is the zero row
        buf = padded.index_select(0, source).view(num_experts, capacity, x.shape[-1])
        return buf, slot.view(top_k, tokens).t()


class DroplessPermute(nn.Module):
    """Sort token copies by expert into ``[T * top_k, H]`` rows: nothing is dropped (``splits="uneven"``).

    Within an expert, assignments keep the order ``(k, t)`` of :class:`Permute`.

    Parameters
    ----------
    num_experts : int
        Experts in total.

    Returns (forward)
    -----------------
    rows : torch.Tensor
        ``[T * top_k, H]``: expert 0's rows, then expert 1's, ...
    slot : torch.Tensor
        ``[T, top_k]`` int64 row of ``rows`` holding each assignment.
    counts : torch.Tensor
        ``[E]`` int64 rows per expert.
    """

    def __init__(self, num_experts: int):
        super().__init__()
        self.num_experts = num_experts

    def forward(self, x: torch.Tensor, experts: torch.Tensor):
        tokens, top_k = experts.shape
        order = experts.t().reshape(-1)  # [K*T], k-major: index k*T + t
        onehot = (order.unsqueeze(1) == torch.arange(self.num_experts, device=x.device)).long()
        counts = onehot.sum(0)
        position = (onehot.cumsum(0) * onehot).sum(1) - 1  # rank of the assignment in its expert
        first = counts.cumsum(0) - counts  # each expert's first row
        slot = first.index_select(0, order) + position  # a permutation of 0 .. K*T - 1
        token_of = torch.arange(tokens, device=x.device).repeat(top_k)  # assignment k*T+t -> t
        source = torch.empty_like(token_of).scatter(0, slot, token_of)  # row -> its token (a gather)
        return x.index_select(0, source), slot.view(top_k, tokens).t(), counts


class AllToAll(nn.Module):
    """Differentiable all-to-all between the token side ``[E, C, ...]`` and the expert side.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        Identity when None or of size 1.
    to_experts : bool
        True for dispatch (``[E, C, ...] -> [E_local, world*C, ...]``), False for combine.
    """

    def __init__(self, group, to_experts: bool):
        super().__init__()
        self.group = group
        self.to_experts = to_experts

    def forward(self, buf: torch.Tensor) -> torch.Tensor:
        if self.to_experts:
            return token_to_expert(buf, self.group)
        return expert_to_token(buf, self.group)

    def extra_repr(self) -> str:
        return f"to_experts={self.to_experts}, world={group_world_size(self.group)}"


class UnevenDispatch(nn.Module):
    """Dropless dispatch: exchange the routed row counts, then the rows, with uneven splits.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        No communication when None or of size 1.
    num_experts : int
    capacity_factor : float
        Each expert holds ``N = world * C`` rows, ``C = ceil(T * top_k / E * capacity_factor)``.

    Returns (forward of ``rows [T*top_k, H]``, ``counts [E]``)
    -----------------------------------------------------------
    buf : torch.Tensor
        ``[E_local, N, H]`` expert side, zero rows where unused.
    route : Route
        How the rows moved (for the combine, and for the backward).

    Raises (forward)
    ----------------
    ExpertCapacityError
        On every rank, before any row is exchanged, if an expert is routed more than ``N`` rows.
    """

    def __init__(self, group, num_experts: int, capacity_factor: float):
        super().__init__()
        self.group = group
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor

    def rows_per_expert(self, rows: int) -> int:
        """``N = world * C`` for ``rows = T * top_k`` rows on each rank."""
        capacity = max(1, math.ceil(rows / self.num_experts * self.capacity_factor))
        return group_world_size(self.group) * capacity

    def forward(self, rows: torch.Tensor, counts: torch.Tensor):
        everyone = all_gather_counts(counts, self.group)  # [world, E], identical on every rank
        route = dropless_route(everyone, self.group, self.rows_per_expert(rows.shape[0]))
        return rows_to_experts(rows, route, self.group), route

    def extra_repr(self) -> str:
        return f"world={group_world_size(self.group)}, uneven splits"


class UnevenCombine(nn.Module):
    """Dropless combine: the expert side ``[E_local, N, H]`` back to the token side ``[T*top_k, H]``."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, buf: torch.Tensor, route, rows: int) -> torch.Tensor:
        return experts_to_rows(buf, route, self.group, rows)

    def extra_repr(self) -> str:
        return f"world={group_world_size(self.group)}, uneven splits"


class GroupedGEMM(nn.Module):
    """One matmul per local expert: ``bmm([E_local, N, in], weight [E_local, in, out])``.

    Parameters
    ----------
    weight : torch.Tensor
        Initial ``[E_local, in, out]`` weights (copied into a Parameter).
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x, self.weight)


class SwiGLU(nn.Module):
    """``silu(gate) * up`` where ``gate, up`` are the two halves of the last dim."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up


class Unpermute(nn.Module):
    """``out_t = sum_k probs[t, k] * y[slot[t, k]]`` (plain autograd, saves the gathered y)."""

    def forward(self, y_tok: torch.Tensor, probs: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        return weighted_unpermute(y_tok.reshape(-1, y_tok.shape[-1]), probs, slot)


class FusedCombineStep(nn.Module):
    """GEMM2 -> combine A2A -> weighted Unpermute as one :class:`FusedCombine` node (no parameters).

    Its own submodule so that the traced nodes of the fused combine carry a module path of their own
    (``remat_compiler.passes.moe`` tags them). It uses ``gemm2.weight``, passed in by the layer.
    """

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, act: torch.Tensor, w2: torch.Tensor, probs: torch.Tensor,
                slot: torch.Tensor, route=None) -> torch.Tensor:
        return fused_combine(act, w2, probs, slot, self.group, route)


class MoELayer(nn.Module):
    """Top-k routed SwiGLU mixture of experts, optionally expert-parallel over a process group.

    Parameters
    ----------
    hidden_size : int
        ``H``, the token width.
    ffn_hidden_size : int
        ``F``, each expert's inner width (GEMM1 produces ``2F``: gate then up).
    num_experts : int
        ``E``, experts in total over all ranks of ``group``.
    top_k : int
        Experts per token, ``1 <= top_k <= num_experts``.
    group : torch.distributed.ProcessGroup or None
        Expert-parallel group. Rank ``r`` of ``world`` holds experts ``r*E/world .. (r+1)*E/world - 1``.
        Every rank must pass the same number of tokens (the buffers' sizes derive from it). The
        router is replicated: its gradient on each rank covers that rank's tokens only, so reduce
        it over the data-parallel ranks as for any replicated parameter. None: all experts local.
    capacity_factor : float
        Capacity ``C = ceil(T * top_k / E * capacity_factor)`` rows per expert and source rank.
        ``splits="equal"``: overflowing assignments are dropped (see :class:`Permute`). ``"uneven"``:
        each expert holds ``world * C`` rows from all ranks together and a routing that sends it
        more raises :class:`~remat_compiler.errors.ExpertCapacityError`. ``>= E / top_k`` fits every
        routing in both modes (``C >= T``).
    combine : {"autograd", "fused"}
        ``"autograd"``: GEMM2, combine all-to-all and unpermute as plain differentiable ops (saves
        the GEMM2 output for d(probs)). ``"fused"``: one :class:`FusedCombine` node that does not.
    splits : {"equal", "uneven"}
        ``"equal"``: fixed ``[E, C, H]`` capacity buffers and equal-split all-to-alls, assignments
        over capacity dropped. ``"uneven"``: dropless; every rank sends exactly its routed rows with
        the real split sizes (:class:`DroplessPermute`, :class:`UnevenDispatch`,
        :class:`UnevenCombine`), received into buffers padded to the capacity bound, so the traced
        shapes, and a plan's predicted peak, hold for every routing that fits.

    Attributes
    ----------
    router, permute, dispatch, gemm1, act, gemm2, combine, unpermute : nn.Module
        The pipeline steps, in order (module paths a graph pass can match); ``fused_combine``
        (no parameters) runs GEMM2 -> A2A -> Unpermute in fused mode. ``gemm1.weight`` is
        ``[E_local, H, 2F]``, ``gemm2.weight`` is ``[E_local, F, H]``, ``router.linear.weight`` is
        ``[E, H]``. ``combine_mode`` holds the ``combine`` argument. In fused mode ``gemm2``,
        ``combine`` and ``unpermute`` are bypassed by one ``FusedCombine`` node (``gemm2.weight``
        is still the parameter it uses). With ``splits="uneven"``, ``permute``, ``dispatch`` and
        ``combine`` are a :class:`DroplessPermute`, an :class:`UnevenDispatch` and an
        :class:`UnevenCombine`; ``splits`` holds the argument.

    Raises
    ------
    ValueError
        On non-positive sizes, ``top_k`` outside ``[1, num_experts]``, ``num_experts`` not
        divisible by the group size, or an unknown ``combine`` or ``splits``.

    Weights are drawn from torch's global RNG in a fixed order (router, full W1 ``[E, H, 2F]``,
    full W2 ``[E, F, H]``) on every rank, and each rank keeps its expert shard, so ranks seeded
    alike hold slices of the same single-process layer.

    Example
    -------
    >>> torch.manual_seed(0)  # doctest: +SKIP
    >>> layer = MoELayer(16, 32, num_experts=4, top_k=2, combine="fused")  # doctest: +SKIP
    >>> layer(torch.randn(2, 5, 16)).shape  # doctest: +SKIP
    torch.Size([2, 5, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_experts: int,
        top_k: int,
        group=None,
        capacity_factor: float = 2.0,
        combine: str = "autograd",
        splits: str = "equal",
    ):
        super().__init__()
        world = group_world_size(group)
        _check_args(hidden_size, ffn_hidden_size, num_experts, top_k, world, capacity_factor, combine, splits)
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.group = group
        self.capacity_factor = capacity_factor
        self.combine_mode = combine
        self.splits = splits
        self.num_local_experts = num_experts // world

        self.router = Router(hidden_size, num_experts, top_k)
        w1 = _uniform((num_experts, hidden_size, 2 * ffn_hidden_size), hidden_size)
        w2 = _uniform((num_experts, ffn_hidden_size, hidden_size), ffn_hidden_size)
        first = group_rank(group) * self.num_local_experts
        shard = slice(first, first + self.num_local_experts)
        if splits == "uneven":
            self.permute = DroplessPermute(num_experts)
            self.dispatch = UnevenDispatch(group, num_experts, capacity_factor)
        else:
            self.permute = Permute(num_experts, capacity_factor)
            self.dispatch = AllToAll(group, to_experts=True)
        self.gemm1 = GroupedGEMM(w1[shard].clone())
        self.act = SwiGLU()
        self.gemm2 = GroupedGEMM(w2[shard].clone())
        self.combine = UnevenCombine(group) if splits == "uneven" else AllToAll(group, to_experts=False)
        self.unpermute = Unpermute()
        self.fused_combine = FusedCombineStep(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, run the experts, and combine.

        Parameters
        ----------
        x : torch.Tensor
            ``[T, H]`` or ``[B, S, H]``.

        Returns
        -------
        torch.Tensor
            Same shape as ``x``.

        Raises
        ------
        ValueError
            If ``x`` is not 2-D or 3-D or its last dim is not ``hidden_size``.
        ExpertCapacityError
            With ``splits="uneven"``, if the routing sends an expert more rows than its capacity.
        """
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"MoELayer expects [T, {self.hidden_size}] or [B, S, {self.hidden_size}], got "
                f"{tuple(x.shape)}; reshape the input so the last dim is hidden_size"
            )
        tokens = x.reshape(-1, self.hidden_size)
        probs, experts = self.router(tokens)
        if self.splits == "uneven":
            rows, slot, counts = self.permute(tokens, experts)
            buf, route = self.dispatch(rows, counts)
        else:
            (buf, slot), route = self.permute(tokens, experts), None
            buf = self.dispatch(buf)
        act = self.act(self.gemm1(buf))
        if self.combine_mode == "fused":
            out = self.fused_combine(act, self.gemm2.weight, probs, slot, route)
        elif route is not None:
            out = self.unpermute(self.combine(self.gemm2(act), route, slot.numel()), probs, slot)
        else:
            out = self.unpermute(self.combine(self.gemm2(act)), probs, slot)
        return out.view_as(x)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"num_experts={self.num_experts}, num_local_experts={self.num_local_experts}, "
            f"top_k={self.top_k}, capacity_factor={self.capacity_factor}, combine={self.combine_mode!r}, "
            f"splits={self.splits!r}"
        )


class MoEStack(nn.Module):
    """``num_layers`` MoE layers with residual connections: ``x = x + layer(x)`` for each.

    The workload for comparing recompute strategies: with one layer, the step's peak is in its
    backward and no strategy can lower it; with several, what each layer keeps for backward adds up.

    Parameters
    ----------
    num_layers : int
    *args, **kwargs :
        Passed to every :class:`MoELayer` (built in order from torch's global RNG).

    Attributes
    ----------
    layers : nn.ModuleList of MoELayer

    Example
    -------
    >>> stack = MoEStack(2, 16, 32, num_experts=4, top_k=2)  # doctest: +SKIP
    >>> stack(torch.randn(8, 16)).shape                      # doctest: +SKIP
    torch.Size([8, 16])
    """

    def __init__(self, num_layers: int, *args, **kwargs):
        super().__init__()
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.layers = nn.ModuleList(MoELayer(*args, **kwargs) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _uniform(shape, fan_in: int) -> torch.Tensor:
    bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape).uniform_(-bound, bound)


def _check_args(hidden_size, ffn_hidden_size, num_experts, top_k, world, capacity_factor, combine, splits):
    for name, value in (
        ("hidden_size", hidden_size),
        ("ffn_hidden_size", ffn_hidden_size),
        ("num_experts", num_experts),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}; "
            "lower top_k or add experts"
        )
    if num_experts % world:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the expert-parallel group size {world}; "
            "choose num_experts as a multiple of the group size or use a smaller group"
        )
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    if combine not in COMBINE_MODES:
        raise ValueError(f"combine must be one of {COMBINE_MODES}, got {combine!r}")
    if splits not in SPLIT_MODES:
        raise ValueError(f"splits must be one of {SPLIT_MODES}, got {splits!r}")


def combine_modes_of(model: torch.nn.Module) -> dict[str, str]:
    """The ``combine_mode`` of every :class:`MoELayer` of ``model``, by module path.

    Example
    -------
    >>> combine_modes_of(MoEStack(2, 16, 32, num_experts=4, top_k=2))  # doctest: +SKIP
    {'layers.0': 'autograd', 'layers.1': 'autograd'}
    """
    return {path: m.combine_mode for path, m in model.named_modules() if isinstance(m, MoELayer)}


@contextlib.contextmanager
def combine_modes(model: torch.nn.Module, modes):
    """Set the ``combine_mode`` of :class:`MoELayer` s of ``model`` while the block runs; restore them on exit.

    Parameters
    ----------
    model : torch.nn.Module
    modes : {"autograd", "fused"} or mapping of str to str
        One mode for every MoELayer, or a mode per MoELayer module path (as
        :func:`combine_modes_of` and the MoE segments of a traced graph name them); layers not
        named keep theirs.

    Raises
    ------
    ValueError
        For a mode that is not one of ``"autograd"``, ``"fused"``, or a path that is not an
        MoELayer of ``model`` (naming the MoELayers it has).

    Example
    -------
    >>> with combine_modes(model, {"layers.0": "fused"}):   # doctest: +SKIP
    ...     traced = remat_compiler.trace(model, (x,))
    """
    layers = {path: m for path, m in model.named_modules() if isinstance(m, MoELayer)}
    wanted = {path: modes for path in layers} if isinstance(modes, str) else dict(modes)
    for path, mode in wanted.items():
        if mode not in COMBINE_MODES:
            raise ValueError(f"combine mode of {path!r} must be one of {COMBINE_MODES}, got {mode!r}")
        if path not in layers:
            raise ValueError(f"{path!r} is not an MoELayer of the model; its MoELayers: "
                             f"{', '.join(repr(p) for p in layers) or 'none'}")
    before = {path: m.combine_mode for path, m in layers.items()}
    try:
        for path, mode in wanted.items():
            layers[path].combine_mode = mode
        yield model
    finally:
        for path, mode in before.items():
            layers[path].combine_mode = mode


@contextlib.contextmanager
def fused_combine_mode(model: torch.nn.Module):
    """Set ``combine_mode = "fused"`` on every :class:`MoELayer` of ``model`` (:func:`combine_modes` with
    one mode for all), and run every transformers MoE block whose experts follow the fused pattern with
    the fused combine (:func:`~remat_compiler.moe.hf.hf_fused_combine_mode`); restore both on exit.

    Example
    -------
    >>> with fused_combine_mode(model):       # doctest: +SKIP
    ...     traced = remat_compiler.trace(model, (x,))
    """
    with combine_modes(model, "fused"), hf_fused_combine_mode(model):
        yield model
