"""Pass: what each node costs to (re)compute, and whether it may be recomputed at all.

Writes on every call_function node:

- ``remat.flops``: FLOPs from ``torch.utils.flop_counter``'s registry (matmul, convolution, attention;
  0 for ops it does not count);
- ``remat.comm_bytes``: the bytes a rank sends over the link for a collective (0 for other ops), as the
  usual ring and pairwise algorithms send them (:func:`sent_bytes`): an all-gather ``(w - 1)`` times its
  input, a reduce-scatter and an all-to-all ``(w - 1) / w`` of theirs, an all-reduce twice that, on a
  group of ``w`` ranks. So a re-gather is charged what crosses the link whether it is written as
  an all-gather or (on gloo) as an all-to-all of the repeated shards, and
  ``CostModel.link_bytes_per_s`` is a rate of bytes a rank sends;
- ``remat.runtime_s``: a roofline estimate, ``max(flops / compute rate, bytes read and written /
  memory bandwidth) + comm_bytes / link bandwidth``; views and aliases cost 0;
- ``remat.never_recompute`` and ``remat.reason``: random ops (their RNG state is not replayed; dropout's
  is, see :mod:`remat_compiler.passes.rng`, and the state it reads is never recomputed), ops that
  mutate their inputs and other side effects must not be recomputed blindly; nor may an op that
  reads an input the step mutates in place (placeholder ``meta["remat.mutated_input"]``, written by
  the trace): in backward that input no longer holds the forward's value. Training-mode BatchNorm
  is the exception: its output and batch statistics do not depend on the running statistics it
  reads, and codegen recomputes it without them (:func:`is_training_batch_norm`); the running
  statistics it returns are never recomputed;
- ``remat.recompute_unread``: the names of the inputs only the forward run of the node reads, not its
  recomputation (a training-mode BatchNorm's running statistics: recomputed, it runs without them);
  empty for every other node. The cost graph leaves these reads out of its edges (a recomputation
  does not keep them alive) and keeps them for the forward's liveness.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.operator_schemas import normalize_function
from torch.utils.flop_counter import flop_registry

from remat_compiler.passes.c10d import is_c10d, is_collective
from remat_compiler.passes.keys import (COMM_BYTES, COST_MODEL, FLOPS, MUTATED_INPUT, NEVER_RECOMPUTE, REASON,
                                        RECOMPUTE_UNREAD, RUNTIME_S, STORAGE)
from remat_compiler.passes.rng import is_rng_state

__all__ = ["CostModel", "DEVICE_PRESETS", "annotate_costs", "is_training_batch_norm", "recompute_unread",
           "grouped_mm_flops", "grouped_mm_backward_flops", "sent_bytes", "COSTING_VERSION",
           "UnknownGroupWarning"]


@dataclass(frozen=True)
class CostModel:
    """Rates for the roofline runtime estimate (defaults: a 2-core CPU, and the 0.5 GB/s a rank sends
    at between gloo ranks on it: ``python -m benchmarks.link_rate`` measured 0.43 to 0.73 GB/s sent
    in 0.8 to 3 MB all-gathers on 2 ranks, 1.6 to 6 MB gathered; at a rate 25 times that, re-gathering
    every FSDP2 unit looked free and the sharded GPT-2 step at checkpointing's peak ran 1.18 of that
    peer's, against 0.88 at this one).

    :meth:`preset` gives the rates of a named accelerator (:data:`DEVICE_PRESETS`).

    Attributes
    ----------
    compute_flops_per_s, memory_bytes_per_s, link_bytes_per_s : float
        Dense compute rate, memory bandwidth, and the bytes per second a rank sends in a collective
        (what :func:`sent_bytes` charges).
    memory_capacity_bytes : int or None
        The device's memory, for reports (None: unknown).
    name : str
    device : str
        The device type the plan is for when the model holds no data (parameters on the meta
        device: :func:`remat_compiler.trace.trace` traces them as this device's tensors). A model
        whose tensors are on a device plans for that device, whatever this says. ``"cpu"``
        by default, ``"cuda"`` for the accelerator presets (ROCm's MI300X included).
    allocator : str or None
        The allocator model bytes are counted in (:mod:`remat_compiler.passes.allocator`): None (default) for the
        step's device's own (CUDA's caching allocator rounds every block up to 512 B), or a name
        that overrides it (``"cuda_caching"`` on the CPU: a stand-in that plans, and with
        ``LiveStorageTracker(allocator=...)`` measures, in CUDA's units).
    """

    compute_flops_per_s: float = 1.0e11
    memory_bytes_per_s: float = 2.0e10
    link_bytes_per_s: float = 5.0e8
    memory_capacity_bytes: int | None = None
    name: str = "cpu"
    device: str = "cpu"
    allocator: str | None = None

    @classmethod
    def preset(cls, name: str) -> "CostModel":
        """The rates of a named device: ``"h100"``, ``"h200"``, ``"a100"``, ``"mi300x"`` (dense
        bf16 tensor-core FLOP/s, HBM bandwidth and capacity, from the vendors' data sheets).

        Raises
        ------
        ValueError
            For an unknown name, listing the known ones.
        """
        key = name.lower().replace("-", "").replace("_", "")
        if key not in DEVICE_PRESETS:
            raise ValueError(f"unknown device preset {name!r}; known: {', '.join(sorted(DEVICE_PRESETS))}")
        return DEVICE_PRESETS[key]


_G, _T = 1e9, 1e12
#: Named accelerators. Dense (no 2:4 sparsity) bf16 tensor-core rates, memory bandwidth and capacity
#: from the vendors' data sheets; the link rate is the GPU-to-GPU fabric one way (NVLink 4: 900 GB/s
#: both ways on H100/H200, NVLink 3: 600 GB/s on A100; Infinity Fabric: 896 GB/s peak on MI300X).
#: Sources: NVIDIA H100 Tensor Core GPU data sheet (SXM5: 989 TFLOPS bf16 dense, 3.35 TB/s, 80 GB);
#: NVIDIA H200 data sheet (SXM: 989 TFLOPS, 4.8 TB/s, 141 GB); NVIDIA A100 data sheet (SXM 80 GB:
#: 312 TFLOPS, 2.039 TB/s); AMD Instinct MI300X data sheet (1307.4 TFLOPS, 5.3 TB/s, 192 GB).
DEVICE_PRESETS = {
    "h100": CostModel(989 * _T, 3.35 * _T, 450 * _G, int(80 * _G), "h100", "cuda"),
    "h200": CostModel(989 * _T, 4.8 * _T, 450 * _G, int(141 * _G), "h200", "cuda"),
    "a100": CostModel(312 * _T, 2.039 * _T, 300 * _G, int(80 * _G), "a100", "cuda"),
    "mi300x": CostModel(1307.4 * _T, 5.3 * _T, 448 * _G, int(192 * _G), "mi300x", "cuda"),
}


def _tensor_bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    return 0


#: How nodes are costed, in a plan cache's key (:mod:`remat_compiler.plan_cache`): raised when a change
#: here changes a plan made from the same graph, rates and options, so that plans cached before it
#: are not served. 2: a collective charged the bytes a rank sends (:func:`sent_bytes`), not its input's.
COSTING_VERSION = 2

_COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


class UnknownGroupWarning(UserWarning):
    """A collective's process group is not in this process: it is charged its input's bytes."""


def _group_size(values: dict) -> int | None:
    """The number of ranks a collective runs over: its ``group_size`` argument, or the size of the
    process group its ``group_name`` names (None where no such group exists in this process)."""
    if isinstance(values.get("group_size"), int):
        return values["group_size"]
    name = values.get("group_name")
    if name is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(name).size()
    except (ValueError, RuntimeError, KeyError):
        return None


def sent_bytes(node: fx.Node) -> int:
    """The bytes one rank sends over the link for the collective ``node``.

    On a group of ``w`` ranks, with ``b`` the bytes of its data inputs (split sizes and the ``out``
    buffer left out), as the ring and pairwise algorithms send them: an all-gather sends its shard
    to the ``w - 1`` others, ``(w - 1) * b``; a reduce-scatter ``(w - 1) / w * b``; an all-reduce
    twice that (a reduce-scatter, then an all-gather of the reduced piece); an all-to-all every row
    but its own, ``(w - 1) / w * b`` (its share on average, where the splits are uneven). Other
    collectives (a broadcast) are charged ``b``, and so is one whose group this process does not
    know, with an :class:`UnknownGroupWarning`.

    Parameters
    ----------
    node : torch.fx.Node
        A collective (:func:`remat_compiler.passes.c10d.is_collective`) whose inputs carry
        ``meta["val"]``.

    Returns
    -------
    int
        Bytes sent by one rank.

    Examples
    --------
    On 2 ranks an all-to-all of the repeated shards (the all-gather as gloo runs it,
    :mod:`remat_compiler.fsdp.gather`) sends ``b / 2``, the shard: what an all-gather of it sends.

    >>> sent_bytes(all_gather_node)   # a 4,000-byte shard on 4 ranks          # doctest: +SKIP
    12000
    """
    schema = getattr(node.target, "_schema", None)
    named = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True) \
        if schema is not None else None
    if named is None:
        return sum(_tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    values = named.kwargs
    data = sum(_tensor_bytes(v.meta.get("val")) for k, value in values.items()
               if "split" not in k and k != "out"
               for v in pytree.tree_leaves(value) if isinstance(v, fx.Node))
    name = schema.name.split("::")[-1]
    if not name.startswith(_COLLECTIVE_KINDS):
        return data
    world = _group_size(values)
    if world is None:
        warnings.warn(f"{node.name} ({schema.name}) runs over a process group this process does not know "
                      f"({values.get('group_name')!r}): charged its input's {data:,} bytes, not what a rank "
                      "sends; plan where the group exists", UnknownGroupWarning, stacklevel=2)
        return data
    if world <= 1:
        return 0
    if name.startswith("all_gather"):
        return data * (world - 1)
    share = data * (world - 1) // world
    return 2 * share if name.startswith("all_reduce") else share


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """FLOPs of a grouped matmul (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``), which
    ``torch.utils.flop_counter`` has no formula for: each row meets one group's matrix. Tokens by
    experts' weights, ``(S, K) @ (E, K, N)``, and batched groups: 2 * out's elements * K. The weight
    gradient, ``(K, S) @ (S, N) -> (E, K, N)`` with the groups along S: 2 * K * S * N (each row of S
    in one group only, not E times).

    >>> grouped_mm_flops((10, 8), (3, 8, 12), (10, 12)), grouped_mm_flops((8, 10), (10, 12), (3, 8, 12))
    (1920, 1920)
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return int(2 * a_shape[0] * a_shape[1] * b_shape[1])
    return int(2 * math.prod(out_shape) * a_shape[-1])


def grouped_mm_backward_flops(input_shape, weight_shape) -> int:
    """FLOPs of transformers' ``grouped_mm_fallback_backward`` (input, weight, offs, grad): both
    gradients, each a grouped matmul of the forward's size."""
    return 2 * grouped_mm_flops(input_shape, weight_shape, (input_shape[0], weight_shape[-1]))


def _flops(node: fx.Node) -> int:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and "grouped_mm" in str(packet):
        a, b, out = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in (*node.args[:2], node))
        if str(packet).endswith("grouped_mm_fallback_backward") and isinstance(a, torch.Tensor) \
                and isinstance(b, torch.Tensor):  # (input, weight, offs, grad) -> both gradients
            return grouped_mm_backward_flops(a.shape, b.shape)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(out, torch.Tensor):
            return grouped_mm_flops(a.shape, b.shape, out.shape)
    if packet is None or packet not in flop_registry:
        return 0
    args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), (node.args, node.kwargs))
    return int(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))


def is_training_batch_norm(node: fx.Node) -> bool:
    """``_native_batch_norm_legit_functional(x, w, b, running_mean, running_var, training=True, ...)``:
    outputs 0-2 (normalised, batch mean, batch inverse std) do not depend on the running statistics,
    outputs 3-4 are the updated running statistics."""
    return node.op == "call_function" and \
        node.target is torch.ops.aten._native_batch_norm_legit_functional.default and bool(node.args[5])


def recompute_unread(node: fx.Node) -> list[str]:
    """Inputs the forward run of ``node`` reads and its recomputation does not: a training-mode
    BatchNorm's running statistics (codegen recomputes it as ``no_stats``), unless it also reads them
    as another argument."""
    if not is_training_batch_norm(node):
        return []
    other = {a for a in pytree.arg_tree_leaves(*node.args[:3], *node.args[5:], **node.kwargs)
             if isinstance(a, fx.Node)}
    return [a.name for a in node.args[3:5] if isinstance(a, fx.Node) and a not in other]


def _dropout_free_seeded(node: fx.Node) -> bool:
    """Whether a seeded op draws nothing here: its ``dropout_p`` argument is the constant 0 (the
    attention kernels, ``_scaled_dot_product_flash_attention_for_cpu`` and its CUDA kin, are tagged
    random for their dropout alone; at ``dropout_p=0`` they compute the same output every time)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
            return isinstance(value, (int, float)) and value == 0
    return False


def _never_recompute(node: fx.Node) -> str | None:
    target = node.target
    if node.target is operator.getitem:
        parent = node.args[0]
        if is_training_batch_norm(parent) and node.args[1] >= 3:
            return "a batch norm's updated running statistics (the step writes them into its buffers)"
        return parent.meta.get(REASON) if parent.meta.get(NEVER_RECOMPUTE) else None
    if is_rng_state(node):
        return "the generator's state before a dropout (read again, it would be a later one)"
    stats = set(node.args[3:5]) if is_training_batch_norm(node) else set()
    for a in node.all_input_nodes:
        if a.op == "placeholder" and a.meta.get(MUTATED_INPUT) and a not in stats:
            return (f"reads {a.meta[MUTATED_INPUT]}, which the step mutates in place (in backward it no "
                    f"longer holds the forward's value)")
    if isinstance(target, torch._ops.OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags and not _dropout_free_seeded(node):
            return f"random op {target} (its RNG state is not replayed)"
        if target._schema.is_mutable:
            return f"mutates its input ({target})"
    # fx calls collectives and their waits impure, and every seeded op (a dropout-free one included)
    if node.is_impure() and not is_c10d(node) and not _dropout_free_seeded(node):
        return f"side effect ({target})"
    return None


def annotate_costs(gm: fx.GraphModule, cost_model: CostModel) -> fx.GraphModule:
    """Annotate FLOPs, communication bytes, runtime and recompute flags on every node of ``gm``, and
    record the cost model's fields in ``gm.meta["remat.cost_model"]`` (a plan carries them, so a
    plan applied on another machine is re-costed with the rates it was made with)."""
    gm.meta[COST_MODEL] = dataclasses.asdict(cost_model) if dataclasses.is_dataclass(cost_model) else None
    for n in gm.graph.nodes:
        if n.op != "call_function":
            n.meta[FLOPS], n.meta[RUNTIME_S], n.meta[COMM_BYTES], n.meta[NEVER_RECOMPUTE] = 0, 0.0, 0, False
            n.meta[RECOMPUTE_UNREAD] = []
            continue
        is_alias = n.meta.get(STORAGE) not in (None, n.name)
        is_getitem = n.target is operator.getitem
        flops = _flops(n)
        comm = 0
        if is_collective(n):
            comm = sent_bytes(n)
        if is_alias or is_getitem:
            runtime = 0.0
        else:
            moved = sum(_tensor_bytes(a.meta.get("val")) for a in n.all_input_nodes)
            val = n.meta.get("val")
            moved += sum(_tensor_bytes(v) for v in pytree.tree_leaves(val))
            runtime = max(flops / cost_model.compute_flops_per_s, moved / cost_model.memory_bytes_per_s)
            runtime += comm / cost_model.link_bytes_per_s
        reason = _never_recompute(n)
        n.meta[FLOPS], n.meta[COMM_BYTES], n.meta[RUNTIME_S] = flops, comm, runtime
        n.meta[NEVER_RECOMPUTE], n.meta[REASON] = reason is not None, reason
        n.meta[RECOMPUTE_UNREAD] = recompute_unread(n)
    return gm
