"""Every metadata key the compiler reads or writes, with its meaning: the passes' only contract.

Passes talk to each other and to the cost graph and codegen only through these keys, all with the
prefix ``remat.``. Three slots hold them:

- ``node.meta[KEY]``: per-node annotations the passes write (and ``remat.mutated_input``, which
  :func:`remat_compiler.trace.annotate_joint` writes on placeholders);
- ``gm.meta[KEY]``: graph-level facts about the joint graph (``remat.hold_outputs`` from the trace);
- ``node.meta["custom"][KEY]``: what :func:`remat_compiler.trace.trace` records while the model runs
  (fx's ``preserve_node_meta`` custom slot), read by :mod:`remat_compiler.passes.blocks` and
  :mod:`remat_compiler.passes.moe`.

>>> from passes import keys
>>> phase = node.meta[keys.PHASE]                                # doctest: +SKIP
"""
from __future__ import annotations

__all__ = [
    "PREFIX",
    # node.meta
    "PHASE", "STORAGE", "BYTES", "REAL_BYTES", "TUPLE", "FLOPS", "RUNTIME_S", "COMM_BYTES", "NEVER_RECOMPUTE", "REASON",
    "RECOMPUTE_UNREAD", "MODULE", "BLOCK", "MOE", "MUTATED_INPUT",
    # gm.meta
    "NUM_FWD_OUTPUTS", "INPUT_UPDATES", "BLOCK_CONTAINER", "HOLD_OUTPUTS", "DEVICE", "TRACED_ON", "TRACE_NOTES", "STAMPED",
    "ALLOCATOR", "COST_MODEL",
    # node.meta["custom"]
    "TRACE_MODULE", "TRACE_MODULE_CLASS",
]

#: The prefix of every key below.
PREFIX = "remat."

# ---------------------------------------------------------------- node.meta     (writer)
#: "input" | "tangent" | "fw" | "bw" | "output": the part of the step a node runs in  (passes.phases)
PHASE = "remat.phase"
#: Name of the node that owns this value's storage; None for tuples and scalars       (passes.storage)
STORAGE = "remat.storage"
#: Bytes of new storage the node allocates (0 for views, aliases and non-tensors)    (passes.storage)
BYTES = "remat.bytes"
#: A scalar CPU result's storage bytes as the real kernel allocates them, where measured  (passes.storage)
REAL_BYTES = "remat.real_bytes"
#: True for a multi-output node (its tensors belong to its getitem users)             (passes.storage)
TUPLE = "remat.tuple"
#: FLOPs of one run of the node (0 for ops the FLOP counter does not count)           (passes.costs)
FLOPS = "remat.flops"
#: Roofline runtime estimate of one run, in seconds                                   (passes.costs)
RUNTIME_S = "remat.runtime_s"
#: Bytes one rank sends over the link for a collective (0 for other ops)            (passes.costs)
COMM_BYTES = "remat.comm_bytes"
#: True if the node must not be recomputed (random, mutating, side effects ...)       (passes.costs)
NEVER_RECOMPUTE = "remat.never_recompute"
#: Why the node must not be recomputed, or None                                       (passes.costs)
REASON = "remat.reason"
#: Names of inputs only the forward run reads, not a recomputation (BatchNorm stats)  (passes.costs)
RECOMPUTE_UNREAD = "remat.recompute_unread"
#: Dotted path of the innermost module that ran the node ("" at top level)            (passes.blocks)
MODULE = "remat.module"
#: Path of the repeated block (layer) that contains the node, or None                 (passes.blocks)
BLOCK = "remat.block"
#: None, or {segment, kind, role, fused} for nodes inside an MoE block                (passes.moe)
MOE = "remat.moe"
#: On a placeholder the step mutates in place: that input's name          (remat_compiler.trace)
MUTATED_INPUT = "remat.mutated_input"

# ---------------------------------------------------------------- gm.meta       (writer)
#: How many of the joint graph's outputs are forward outputs                          (passes.phases)
NUM_FWD_OUTPUTS = "remat.num_fwd_outputs"
#: Positions among the forward outputs of new values of inputs mutated in place       (passes.phases)
INPUT_UPDATES = "remat.input_updates"
#: Path of the container whose same-class children are the blocks, or None            (passes.blocks)
BLOCK_CONTAINER = "remat.block_container"
#: Whether the caller keeps the model's outputs through backward        (remat_compiler.trace)
HOLD_OUTPUTS = "remat.hold_outputs"
#: The device type the step runs on ("cpu", "cuda"): the traced tensors', or the one a model on the
#: meta device is planned for                                           (remat_compiler.trace)
DEVICE = "remat.device"
#: The device type the trace ran its tensors on, where it is not DEVICE (a CUDA plan traced on a
#: CPU-only build of PyTorch: "cpu"); absent otherwise                  (remat_compiler.trace)
TRACED_ON = "remat.traced_on"
#: What the trace changed to follow the path eager runs (compile-only switches set back, the model's
#: own checkpointing planned through), one sentence each         (remat_compiler.eager_paths)
TRACE_NOTES = "remat.trace_notes"
#: Where the graph was stamped from traces of a few of its identical layers, not traced in full:
#: ``(container path, layers, layer counts traced)``; absent after a full trace  (remat_compiler.stamp)
STAMPED = "remat.stamped"
#: Name of the allocator model the bytes are counted in (passes.allocator)             (passes.storage)
ALLOCATOR = "remat.allocator"
#: The cost model's fields (a dict) the runtimes were estimated with                    (passes.costs)
COST_MODEL = "remat.cost_model"

# ---------------------------------------------------------------- node.meta["custom"]  (writer)
#: Dotted path of the innermost module running when the node was traced   (remat_compiler.trace)
TRACE_MODULE = "remat.trace_module"
#: Class name of that module                                              (remat_compiler.trace)
TRACE_MODULE_CLASS = "remat.module_class"
