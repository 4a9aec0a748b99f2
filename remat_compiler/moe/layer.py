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
from torch import nn

from ._dist import group_rank, group_world_size
from .exchange import AllToAll, UnevenCombine, UnevenDispatch
from .experts import FusedCombineStep, GroupedGEMM, SwiGLU, Unpermute
from .hf import hf_fused_combine_mode
from .routing import DroplessPermute, Permute, Router, expert_capacity

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
