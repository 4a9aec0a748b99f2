"""The benchmark workloads: each builds a fresh, identically seeded model whose output is the loss.

Every strategy gets its own model from the same factory and seed (so their weights are equal and
their gradients comparable), and all of them are called on the inputs of the first build. The loss
is inside the model (GPT-2 and Mixtral through ``labels``; the MLP chain and the MoE stack through
:class:`WithLoss`), so that ``torch.compile`` and ``remat_compiler`` see the same whole step.

========  =============================================================  ==============================
name      full size (issue 5)                                             ``--quick``
========  =============================================================  ==============================
gpt2      transformers GPT-2: 6 layers, width 256, 4 heads, vocab 2048,   2 layers, width 64, seq 64
          batch 4 x seq 256, dropout 0
mixtral   transformers Mixtral: 2 layers, hidden 256, FFN 512, 8 experts, hidden 32, FFN 64, 4 experts
          top-2, 4 heads (2 KV heads), vocab 2048, batch 4 x seq 128
moe1/2    remat_compiler.moe.MoEStack: 4 layers, H 256, F 512, 4 experts,  2 layers, H 32, F 64
          top-2, 1024 tokens per rank, on 1 / 2 gloo ranks
mlp       MLPChain: 24 Linear+GELU blocks of width 1024, batch 512, MSE   4 blocks of 128, batch 64
========  =============================================================  ==============================

>>> spec = WORKLOADS["mlp"]                                   # doctest: +SKIP
>>> model, args, kwargs = spec.build(quick=True)              # doctest: +SKIP
>>> model(*args, **kwargs).backward()                         # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["WorkloadSpec", "WORKLOADS", "ISSUE_TARGETS", "WithLoss", "blocks_of", "input_leaves", "build_gpt2"]


class WithLoss(nn.Module):
    """``loss(model(*args))`` as one module, so the loss is part of every compiled step.

    Parameters
    ----------
    inner : nn.Module
    loss : str
        ``"mse"`` (against the ``target`` buffer) or ``"mean_square"`` (``mean(out ** 2)``).
    target : torch.Tensor, optional
        Registered as a buffer, so tracers see it as state, not as a captured constant.
    """

    def __init__(self, inner: nn.Module, loss: str, target: torch.Tensor | None = None):
        super().__init__()
        if loss not in ("mse", "mean_square"):
            raise ValueError(f"unknown loss {loss!r}")
        self.inner = inner
        self.loss = loss
        if target is not None:
            self.register_buffer("target", target)

    def forward(self, *args):
        out = self.inner(*args)
        if self.loss == "mse":
            return nn.functional.mse_loss(out, self.target)
        return out.pow(2).mean()


@dataclass(frozen=True)
class WorkloadSpec:
    """One named workload.

    Attributes
    ----------
    name : str
    description : callable
        ``description(quick) -> str`` for RESULTS.md.
    factory : callable
        ``factory(quick, group) -> (model, args, kwargs)``; ``group`` is the expert-parallel process
        group (None on one process).
    blocks : str
        Dotted path of the ``nn.ModuleList`` of repeated blocks (for checkpoint-every-block).
    world_size : int
        Gloo ranks the workload runs on (2 ranks are spawned by :mod:`benchmarks.run`).
    moe : bool
        Whether the MoE strategies apply.
    """

    name: str
    description: Callable[[bool], str]
    factory: Callable
    blocks: str
    world_size: int = 1
    moe: bool = False

    def build(self, quick: bool = False, group=None):
        """A fresh model (in training mode) and its example call ``(args, kwargs)``."""
        model, args, kwargs = self.factory(quick, group)
        return model.train(), args, kwargs


def blocks_of(model: nn.Module, path: str) -> nn.ModuleList:
    """The repeated blocks at ``path`` (``"transformer.h"``), checked to be a non-empty ModuleList."""
    blocks = model.get_submodule(path)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"{path} is not a non-empty ModuleList in {type(model).__name__}")
    return blocks


def input_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Example inputs that require grad (their gradients are part of the step)."""
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.requires_grad]


# ---------------------------------------------------------------------------- factories
GPT2 = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=2048, batch=4, seq=256)
GPT2_QUICK = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, batch=2, seq=64)


def build_gpt2(quick: bool, group=None, **override):
    """The gpt2 workload's model and call; ``override`` changes config entries (``n_layer=12``)."""
    from remat_compiler.examples.gpt2 import build

    cfg = {**(GPT2_QUICK if quick else GPT2), **override}
    model, inputs, _loss_fn = build(**cfg, dropout=0.0, seed=0)
    return model, (), inputs  # labels are in the inputs: the output has .loss


MIXTRAL = dict(layers=2, hidden=256, ffn=512, experts=8, top_k=2, heads=4, kv_heads=2, vocab=2048,
               batch=4, seq=128)
MIXTRAL_QUICK = dict(layers=2, hidden=32, ffn=64, experts=4, top_k=2, heads=4, kv_heads=2, vocab=128,
                     batch=2, seq=32)


def _mixtral(quick: bool, group=None):
    import transformers

    c = MIXTRAL_QUICK if quick else MIXTRAL
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        num_local_experts=c["experts"], num_experts_per_tok=c["top_k"],
        max_position_embeddings=max(128, c["seq"]), use_cache=False, router_jitter_noise=0.0,
        attention_dropout=0.0, bos_token_id=c["vocab"] - 1, eos_token_id=c["vocab"] - 1)
    config._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(config)
    model.loss_type = "ForCausalLM"
    ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}


MOE = dict(layers=4, hidden=256, ffn=512, experts=4, top_k=2, tokens=1024)
MOE_QUICK = dict(layers=2, hidden=32, ffn=64, experts=4, top_k=2, tokens=64)


def _moe(quick: bool, group=None):
    """The MoE stack on this rank's tokens (every rank seeds alike and keeps its expert shard)."""
    import torch.distributed as dist

    from remat_compiler.moe import MoEStack

    c = MOE_QUICK if quick else MOE
    torch.manual_seed(0)
    stack = MoEStack(c["layers"], c["hidden"], c["ffn"], c["experts"], c["top_k"], group=group)
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    x_all = torch.randn(world * c["tokens"], c["hidden"], generator=torch.Generator().manual_seed(1))
    x = x_all[rank * c["tokens"]:(rank + 1) * c["tokens"]].clone().requires_grad_(True)
    return WithLoss(stack, "mean_square"), (x,), {}


MLP = dict(width=1024, depth=24, batch=512)
MLP_QUICK = dict(width=128, depth=4, batch=64)


def _mlp(quick: bool, group=None):
    from remat_compiler.examples.models import MLPChain

    c = MLP_QUICK if quick else MLP
    torch.manual_seed(0)
    chain = MLPChain(c["width"], c["depth"])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(c["batch"], c["width"], generator=gen)
    y = torch.randn(c["batch"], 1, generator=gen)
    return WithLoss(chain, "mse", y), (x,), {}


def _describe(fmt: str, full: dict, quick_cfg: dict) -> Callable[[bool], str]:
    return lambda quick: fmt.format(**(quick_cfg if quick else full))


WORKLOADS: dict[str, WorkloadSpec] = {
    "gpt2": WorkloadSpec(
        "gpt2", _describe("HF GPT-2, {n_layer} layers, width {n_embd}, {n_head} heads, vocab {vocab_size}, "
                          "batch {batch} x seq {seq}, dropout 0, loss via labels", GPT2, GPT2_QUICK),
        build_gpt2, "transformer.h"),
    "mixtral": WorkloadSpec(
        "mixtral", _describe("HF Mixtral, {layers} layers, hidden {hidden}, FFN {ffn}, {experts} experts, "
                             "top-{top_k}, {heads} heads ({kv_heads} KV), vocab {vocab}, batch {batch} x "
                             "seq {seq}, loss via labels", MIXTRAL, MIXTRAL_QUICK),
        _mixtral, "model.layers", moe=True),
    "moe1": WorkloadSpec(
        "moe1", _describe("MoEStack, {layers} layers, H {hidden}, F {ffn}, {experts} experts, top-{top_k}, "
                          "{tokens} tokens, 1 rank, loss mean(out^2)", MOE, MOE_QUICK),
        _moe, "inner.layers", moe=True),
    "moe2": WorkloadSpec(
        "moe2", _describe("MoEStack, {layers} layers, H {hidden}, F {ffn}, {experts} experts, top-{top_k}, "
                          "{tokens} tokens per rank, 2 gloo ranks (expert parallel), loss mean(out^2)",
                          MOE, MOE_QUICK),
        _moe, "inner.layers", world_size=2, moe=True),
    "mlp": WorkloadSpec(
        "mlp", _describe("MLPChain, {depth} Linear+GELU blocks of width {width}, batch {batch}, MSE loss "
                         "inside the model", MLP, MLP_QUICK),
        _mlp, "inner.layers"),
}
#: Issue 5's absolute targets for a full-size workload (peaks in MiB, FLOP ratio against eager).
ISSUE_TARGETS = {"gpt2": {"lowest_peak_mib": 45.0, "flop_target": 1.10, "flop_target_peak_mib": 60.0}}
