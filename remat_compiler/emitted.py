"""emitted_peak: the live storage bytes of the emitted forward and backward, walked as they run.

This is the check that does not trust the simulator (:func:`remat_compiler.schedule.simulate`) or the
schedule it simulates. It reads only the two GraphModules :func:`remat_compiler.codegen.emit`
returns, node by node in their emitted order, and counts references to storages the way the
generated Python does:

- a node allocates a new storage for each tensor it returns whose FakeTensor storage
  (``meta["val"]``) is not the storage of one of its inputs (views, ``detach``, ``getitem`` and a
  collective's ``wait_tensor`` share their input's storage); a multi-output op allocates every output
  its kernel returns at once (not one its ``output_mask`` turns off, nor one past the op's schema: a
  BatchNorm recomputed as ``no_stats`` returns three), and the tuple holds them all until it is freed;
- the live bytes while a node runs are those of every storage some live value refers to, the
  node's new outputs included;
- a value is freed after its last reader, and right after it runs if nobody reads it, as fx's
  generated code does (``x = None``); a storage is freed with the last value that refers to it.

The project's accounting conventions (:mod:`remat_compiler.schedule`) are read off the two graphs
and three graph-level facts (how many forward outputs are the user's, which of them are updated
inputs, whether the caller holds them): parameters, inputs and graph constants are resident and
count nothing; the forward's outputs live until it returns; the outputs after the user's are the
saved values, handed positionally to the backward's first placeholders and held between the two;
the remaining placeholders are tangents, allocated when the backward starts (their bytes are the span
of their strides: AOTAutograd makes them with ``empty_strided``); the caller's outputs (only its scalar
ones unless ``hold_outputs``), the gradients backward returns and the gradient seeds (a scalar
output's tangent, else every tangent) stay live to the end. Storage bytes are the FakeTensor
storage's, except for a scalar CPU result whose real kernel's storage
:func:`remat_compiler.passes.storage.calibrate_scalar_storage` measured (``meta["remat.real_bytes"]``), each charged
as the step's allocator charges it (``allocator``: on CUDA, whole 512-byte blocks).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.passes.allocator import EXACT, AllocatorModel
from remat_compiler.passes.c10d import is_wait
from remat_compiler.passes.keys import REAL_BYTES
from remat_compiler.passes.storage import storage_bytes, strided_span_bytes, masked_outputs
from remat_compiler.errors import PlanCheckError

__all__ = ["EmittedPeak", "emitted_peak"]

# One tensor a value refers to: its FakeTensor storage, and the buffer it lives in (None: resident).
_Slot = tuple[StorageWeakRef, int | None]


@dataclass
class EmittedPeak:
    """Live storage bytes of the emitted code while each of its nodes runs.

    Attributes
    ----------
    peak_bytes : int
        The most bytes live at once, above what was resident before the step.
    peak_node : str | None
        Where it is reached: ``"forward:<node>"`` or ``"backward:<node>"``.
    events : list[tuple[str, int]]
        Every node run, in order, with the bytes live while it runs.
    """

    peak_bytes: int = 0
    peak_node: str | None = None
    events: list[tuple[str, int]] = field(default_factory=list)

    def first_above(self, limit_bytes: int) -> tuple[str, int] | None:
        """The first node run whose live bytes exceed ``limit_bytes``, or None."""
        return next(((n, b) for n, b in self.events if b > limit_bytes), None)

    def record(self, name: str, live_bytes: int) -> None:
        self.events.append((name, live_bytes))
        if self.peak_node is None or live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_node = live_bytes, name


class _Memory:
    """Buffers with reference counts, and the bytes of those alive."""

    def __init__(self):
        self.size: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.live_bytes = 0

    def alloc(self, nbytes: int) -> int:
        buf = len(self.size)
        self.size[buf], self.refs[buf] = int(nbytes), 0
        self.live_bytes += int(nbytes)
        return buf

    def acquire(self, slots: list[_Slot | None]) -> None:
        for buf in _buffers(slots):
            self.refs[buf] += 1

    def release(self, slots: list[_Slot | None]) -> None:
        for buf in _buffers(slots):
            self.refs[buf] -= 1
            if self.refs[buf] == 0:
                self.live_bytes -= self.size[buf]


def _buffers(slots: list[_Slot | None]) -> set[int]:
    """The distinct buffers a value refers to (a value holds each once)."""
    return {s[1] for s in slots if s is not None and s[1] is not None}


def _key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _returned(n: fx.Node, val) -> list:
    """The outputs a multi-output node's kernel returns: none past its schema's returns (a BatchNorm
    recomputed as ``no_stats`` keeps the functional op's five fake outputs but returns three), None
    for one its ``output_mask`` turns off."""
    vals = list(val)
    target = n.target
    if isinstance(target, torch._ops.OpOverload) and len(target._schema.returns) > 1:
        vals = vals[:len(target._schema.returns)]
    masked = masked_outputs(n)
    return [None if i in masked else v for i, v in enumerate(vals)]


class _Walk:
    """The state of one walk over the forward and then the backward."""

    def __init__(self, allocator: AllocatorModel = EXACT):
        self.charged = allocator.charged_bytes
        self.mem = _Memory()
        self.resident: set[StorageWeakRef] = set()
        self.result = EmittedPeak()

    def slot(self, n: fx.Node, t, inputs: list[list[_Slot | None]]) -> _Slot | None:
        """The slot of tensor ``t`` that ``n`` returns: an input's storage, a resident one, or new."""
        if not isinstance(t, torch.Tensor):
            return None
        key = _key(t)
        for slots in inputs:
            for s in slots:
                if s is not None and s[0] == key:
                    return s
        if key in self.resident:
            return key, None
        nbytes = storage_bytes(t)
        if t.dim() == 0 and REAL_BYTES in n.meta:
            nbytes = max(nbytes, int(n.meta[REAL_BYTES]))
        return key, self.mem.alloc(self.charged(nbytes))

    def outputs(self, n: fx.Node, values: dict[fx.Node, list]) -> list[_Slot | None]:
        """The slots of what ``n`` returns, allocating its new storages."""
        val = n.meta.get("val")
        if n.op == "get_attr":  # a graph constant: held by the module, like a buffer
            if isinstance(val, torch.Tensor):
                self.resident.add(_key(val))
                return [(_key(val), None)]
            return []
        if n.target is operator.getitem:
            src = values[n.args[0]]
            i = n.args[1]
            if not 0 <= i < len(src):
                raise PlanCheckError(f"{n.name} takes output {i} of {n.args[0].name}, which returns {len(src)}")
            return [src[i]]
        if is_wait(n) and isinstance(n.args[0], fx.Node):  # hands back its input's storage
            src = [s for s in values[n.args[0]] if s is not None]
            return [(_key(val), src[0][1])] if src and isinstance(val, torch.Tensor) else src
        inputs = [values[a] for a in n.all_input_nodes]
        if isinstance(val, (tuple, list)):
            return [self.slot(n, t, inputs) for t in _returned(n, val)]
        return [self.slot(n, val, inputs)]

    def run(self, gm: fx.GraphModule, tag: str, bound: dict[str, list]) -> list[list[_Slot | None]]:
        """Walk ``gm``; ``bound`` gives each placeholder's slots, each buffer already holding one
        reference for it. Returns the slots of its outputs, which it leaves to the caller to hold."""
        nodes = list(gm.graph.nodes)
        last_use: dict[fx.Node, int] = {}
        for i, n in enumerate(nodes):
            for a in n.all_input_nodes:
                last_use[a] = i
        values: dict[fx.Node, list] = {}
        for i, n in enumerate(nodes):
            if n.op == "placeholder":
                values[n] = bound[n.name]
                continue
            if n.op == "output":
                outs = [values[o] if isinstance(o, fx.Node) else [] for o in n.args[0]]
                for slots in outs:
                    self.mem.acquire(slots)
                for slots in values.values():
                    self.mem.release(slots)
                return outs
            values[n] = self.outputs(n, values)
            self.mem.acquire(values[n])
            self.result.record(f"{tag}:{n.name}", self.mem.live_bytes)
            for a in dict.fromkeys(n.all_input_nodes):
                if last_use[a] == i:
                    self.mem.release(values.pop(a))
            if not n.users:
                self.mem.release(values.pop(n))
        raise PlanCheckError(f"the emitted {tag} has no output node")


def held_positions(fw: fx.GraphModule, num_fwd_outputs: int, input_updates,
                    hold_outputs: bool) -> list[int]:
    """Positions of the user's outputs the caller keeps through backward: all but updated inputs,
    or only scalar ones unless ``hold_outputs``."""
    out = next(iter(fw.graph.find_nodes(op="output")))
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in out.args[0]]
    updates = set(input_updates)
    return [i for i in range(num_fwd_outputs) if i not in updates and isinstance(vals[i], torch.Tensor)
            and (hold_outputs or vals[i].dim() == 0)]


def emitted_peak(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int, input_updates=(),
                 hold_outputs: bool = True, allocator: AllocatorModel = EXACT) -> EmittedPeak:
    """Walk the emitted forward, then the backward, and return their live storage bytes node by node.

    Parameters
    ----------
    fw, bw : fx.GraphModule
        What :func:`remat_compiler.codegen.emit` returned.
    num_fwd_outputs : int
        How many of the forward's outputs are the user's (the rest are saved for backward).
    input_updates : iterable of int
        Positions among those of new values of inputs mutated in place (the caller never holds them).
    hold_outputs : bool
        Whether the caller keeps its outputs through backward (else only its scalar ones).
    allocator : passes.allocator.AllocatorModel
        What each new storage is charged (the cost graph's ``allocator``; exact by default).

    Returns
    -------
    EmittedPeak

    Raises
    ------
    PlanCheckError
        If a saved value reaches the backward as a different storage than the forward returned,
        or a node reads an output its producer does not return.

    Example
    -------
    >>> fw, bw = emit(gm, plan)                                                  # doctest: +SKIP
    >>> emitted_peak(fw, bw, num_fwd_outputs=1).peak_bytes == plan.peak_bytes    # doctest: +SKIP
    True
    """
    walk = _Walk(allocator)
    fw_inputs = list(fw.graph.find_nodes(op="placeholder"))
    walk.resident.update(_key(p.meta["val"]) for p in fw_inputs if isinstance(p.meta.get("val"), torch.Tensor))
    fw_outs = walk.run(fw, "forward", {p.name: [(_key(p.meta["val"]), None)]
                                       if isinstance(p.meta.get("val"), torch.Tensor) else [] for p in fw_inputs})
    for i in held_positions(fw, num_fwd_outputs, input_updates, hold_outputs):
        walk.mem.acquire(fw_outs[i])  # held by the caller to the end
    saved = fw_outs[num_fwd_outputs:]
    for slots in fw_outs[:num_fwd_outputs]:
        walk.mem.release(slots)  # the caller's; the held ones keep the reference just taken
    bw_inputs = list(bw.graph.find_nodes(op="placeholder"))
    if len(bw_inputs) < len(saved):
        raise PlanCheckError(f"the forward saves {len(saved)} values; the backward takes {len(bw_inputs)}")
    bound = {}
    for p, slots in zip(bw_inputs, saved):
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor) and not any(s is not None and s[0] == _key(val) for s in slots):
            raise PlanCheckError(f"backward input {p.name} is not the storage the forward saved in its place")
        bound[p.name] = slots  # the reference the forward's return took is now this placeholder's
    tangents = bw_inputs[len(saved):]
    scalar = [p for p in tangents if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].dim() == 0]
    for p in tangents:
        val = p.meta.get("val")
        bound[p.name] = [(_key(val), walk.mem.alloc(walk.charged(strided_span_bytes(val))))] \
            if isinstance(val, torch.Tensor) else []
        walk.mem.acquire(bound[p.name])
    for p in scalar or tangents:
        walk.mem.acquire(bound[p.name])  # a gradient seed: autograd's engine holds it to the end
    walk.run(bw, "backward", bound)
    return walk.result
