"""Make dropout recomputable: its RNG state is read in forward and replayed where backward recomputes it.

A random op recomputed naively draws new random numbers, so the traced ``native_dropout(x, p, True)``
was never recomputed and its output and mask were always saved. This pass rewrites each one as two
nodes::

    state = remat.rng_state(x)                          # the generator's state, read just before
    out, mask = remat.dropout_at(x, state, p, True, False)

In forward, ``dropout_at`` is ``native_dropout`` (``state`` is the generator's current state, so the
same numbers are drawn and the generator advances as in eager). ``state`` is a small forward value
that must not be recomputed (reading the state again in backward would read a later one), so a plan
that recomputes the dropout saves it. Codegen emits a recomputed ``dropout_at`` with ``replay=True``
(:func:`replaying`): it sets the generator to ``state``, draws the same mask, and restores the
generator, so the step leaves the RNG exactly where eager leaves it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["replayable_dropout", "rng_state", "dropout_at", "is_dropout_at", "is_rng_state", "replaying"]

_STATE_NUMEL = int(torch.get_rng_state().numel())


def _generator_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@torch.library.custom_op("remat::rng_state", mutates_args=())
def rng_state(like: torch.Tensor) -> torch.Tensor:
    """The state of the default generator of ``like``'s device (a CPU byte tensor)."""
    return _generator_state(like.device).clone()


@rng_state.register_fake
def _(like):
    numel = 16 if like.device.type == "cuda" else _STATE_NUMEL
    return torch.empty(numel, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("remat::dropout_at", mutates_args=())
def dropout_at(x: torch.Tensor, state: torch.Tensor, p: float, train: bool, replay: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout(x, p, train)`` drawn from generator state ``state``.

    ``replay=False`` (forward): ``state`` is the generator's current state; the generator advances.
    ``replay=True`` (a recomputation): the generator is set to ``state`` for the draw and restored after.
    """
    if not replay:
        out, mask = torch.ops.aten.native_dropout.default(x, p, train)
        return out, mask
    before = _generator_state(x.device).clone()
    _set_generator_state(x.device, state)
    try:
        out, mask = torch.ops.aten.native_dropout.default(x, p, train)
    finally:
        _set_generator_state(x.device, before)
    return out, mask


@dropout_at.register_fake
def _(x, state, p, train, replay):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)


def is_dropout_at(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.remat.dropout_at.default


def is_rng_state(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.remat.rng_state.default


def replaying(node: fx.Node) -> tuple:
    """The arguments of ``node`` (a ``dropout_at``) for its recomputation: the same, with ``replay``."""
    x, state, p, train, _replay = node.args
    return (x, state, p, train, True)


def replayable_dropout(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every training-mode ``native_dropout`` of ``gm`` as ``rng_state`` + ``dropout_at``."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.native_dropout.default:
            continue
        x, p = n.args[0], n.args[1]
        train = n.args[2] if len(n.args) > 2 else n.kwargs.get("train")
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        fake_mode = getattr(val, "fake_mode", None)
        if train is not True or fake_mode is None:
            continue
        with gm.graph.inserting_before(n):
            state = gm.graph.call_function(torch.ops.remat.rng_state.default, (x,))
            drop = gm.graph.call_function(torch.ops.remat.dropout_at.default,
                                          (x, state, float(p), True, False))
        with fake_mode:
            state.meta["val"] = torch.ops.remat.rng_state.default(val)
        state.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
        drop.meta = dict(n.meta)
        n.replace_all_uses_with(drop)
        gm.graph.erase_node(n)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
