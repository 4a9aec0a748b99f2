"""The Inductor backend: a plan's forward and backward compiled by Inductor, and the peak of the code it wrote.

``compile(model, budget, backend="inductor")`` plans like the eager backend, on the joint graph traced
with Inductor's decompositions (:data:`DECOMPOSITIONS`), and hands the emitted forward and backward to
Inductor's inner compiler (``compile_fx_inner``) instead of running them op by op. The plan's decisions
hold exactly in what runs: the forward's outputs are the values the plan saves (a compiler cannot drop
a graph output), and the backward computes again what the plan recomputes. What Inductor changes is how:
it fuses pointwise chains (their intermediates never exist), reorders kernels and reuses buffers. One
thing it is not left to decide: a pointwise value read by several layers (a mask, a rotary table) is
computed once into a buffer (:func:`store_shared_values`), not again inside each layer's kernel.

So the planner's prediction, a simulation of the unfused graph, is checked against the code Inductor
wrote. :func:`compiled_peak` walks the two generated wrappers' ``call`` functions line by line under the
step's accounting conventions (those of :func:`remat_compiler.emitted.emitted_peak`): each
``empty_strided`` allocation, each fallback kernel's outputs (their bytes from the IR buffers Inductor
lowered, recorded by :func:`compile_graph`), each ``del``, each buffer handed on for reuse, what each
``return`` hands back. That walk is the Inductor path's predicted peak; :mod:`remat_compiler.api`
re-plans (or falls back to the eager backend, warning) when it exceeds the budget.

:func:`watch` measures the same thing at run time without reading the code: it registers every buffer
the wrappers allocate with a :class:`remat_compiler.memory.LiveStorageTracker` (which sees the fallback
kernels' outputs through the dispatcher), so a test can compare prediction and measurement to the byte.
:class:`FirstStepCheck` does so on the first step of every plan's code, for the backend: what the walk
missed is then reported, and re-planned for, rather than run on silently.
"""
from __future__ import annotations

import contextlib
import copy
import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from remat_compiler.passes.allocator import allocator_named
from remat_compiler.passes.keys import BLOCK
from remat_compiler.passes.storage import strided_span_bytes
from remat_compiler.emitted import EmittedPeak, held_positions
from remat_compiler.memory import LiveStorageTracker

__all__ = ["DECOMPOSITIONS", "InductorGraph", "InductorCompilers", "StepFacts", "CompiledOverBudget",
           "FirstStepCheck", "UnreadableCodeError", "compile_graph", "compiled_peak", "store_shared_values", "watch"]


def _decompositions() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    from remat_compiler.passes.loss import WHOLE_LOSS_OPS

    # native_dropout stays whole: passes.rng rewrites it as a replayable remat::dropout_at, which
    # Inductor runs as a fallback kernel drawing eager's numbers. The loss head's ops become opaque
    # twins (passes.loss.WHOLE_LOSS_OPS): planned as what runs, and cross-entropy's backward fused
    table = {op: fn for op, fn in select_decomp_table().items() if not str(op).startswith("aten.native_dropout.")}
    table.update(WHOLE_LOSS_OPS)
    return table


#: Inductor's decomposition table, less ``aten.native_dropout`` (see :mod:`remat_compiler.passes.rng`), with the loss
#: head's ops mapped to opaque twins (:data:`remat_compiler.passes.loss.WHOLE_LOSS_OPS`).
DECOMPOSITIONS = _decompositions()


@torch.library.custom_op("remat::stored", mutates_args=())
def _stored(x: torch.Tensor) -> torch.Tensor:
    """``x``, computed once into a buffer of its own: Inductor lowers it so (:func:`store_shared_values`);
    outside Inductor, a copy."""
    return x.clone()


@_stored.register_fake
def _(x):
    return torch.empty_like(x)


def _register_stored_lowering() -> None:
    from torch._inductor.lowering import register_lowering

    @register_lowering(torch.ops.remat.stored.default, type_promotion_kind=None)
    def _store(x):
        x.realize()
        return x


_register_stored_lowering()


def _is_view(node: fx.Node) -> bool:
    """Whether a node's output is a view of its input (by the op's schema), or an item of a tuple."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read ``node``'s value, looking through views of it."""
    found, todo = [], list(node.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and _is_view(user):
            todo.extend(user.users)
        else:
            found.append(user)
    return found


def store_shared_values(gm: fx.GraphModule) -> list[str]:
    """Make Inductor compute each pointwise value that several layers read once, into a buffer.

    Inductor inlines a pointwise value into every kernel that reads it unless its own heuristic
    realizes it (on the CPU: a value of ``exp``, ``tanh`` and the like, or a large expression). A
    value made once for all the layers (an attention mask, a rotary table) that the plan does not
    save may then be computed again inside each layer's kernel: on the benchmark GPT-2, a plan that
    saved the boolean causal mask had the float mask made from it selected again inside all six
    attention softmax kernels of the forward, about 1 ms more each. The plan prices every value as a
    buffer of its own, alive from its node to its last reader, so storing it keeps the code within
    what the plan counted; the walk of the code checks that.

    Each such value (an aten op tagged pointwise, not an output, read through views by nodes of two
    or more blocks: ``meta["remat.block"]``, :func:`remat_compiler.passes.annotate_blocks`) gets a
    ``remat::stored`` node its readers read instead. Returns the names of the values.
    """
    out = next(iter(gm.graph.find_nodes(op="output")))
    outputs = set(out.all_input_nodes)
    stored = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node in outputs or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if torch.Tag.pointwise not in node.target.tags:
            continue
        blocks = {r.meta.get(BLOCK) for r in _readers(node)} - {None}
        if len(blocks) < 2:
            continue
        with gm.graph.inserting_after(node):
            kept = gm.graph.call_function(torch.ops.remat.stored.default, (node,))
        kept.meta = {k: v for k, v in node.meta.items() if k != "eager_input_vals"}
        node.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
        stored.append(node.name)
    if stored:
        gm.graph.lint()
        gm.recompile()
    return stored


class UnreadableCodeError(RuntimeError):
    """The walk met a line of Inductor's generated wrapper it does not understand."""


class CompiledOverBudget(RuntimeError):
    """Inductor's code for a plan peaks above the budget (raised before any of it runs)."""

    def __init__(self, peak: EmittedPeak, limit_bytes: int, plan_peak_bytes: int):
        node, live = peak.first_above(limit_bytes)
        super().__init__(f"Inductor's code for the plan peaks at {peak.peak_bytes} bytes ({peak.peak_node}), "
                         f"above the budget of {limit_bytes} bytes (first at {node}, {live} bytes live); "
                         f"the plan's own prediction was {plan_peak_bytes} bytes")
        self.peak = peak
        self.limit_bytes = limit_bytes
        self.plan_peak_bytes = plan_peak_bytes


@dataclass
class InductorGraph:
    """One graph compiled by Inductor.

    Attributes
    ----------
    fn : callable
        What Inductor returned (boxed: called with a list of inputs it clears).
    source : str
        The generated wrapper module's source.
    buffer_bytes : dict[str, int]
        Storage bytes of each buffer Inductor lowered, by its name in ``source`` (0 for a
        multi-output kernel's tuple).
    """

    fn: Callable
    source: str
    buffer_bytes: dict[str, int] = field(default_factory=dict)
    check: "FirstStepCheck | None" = None  # measures this graph's first run (then clears itself)

    def __call__(self, *args):
        if self.check is not None:
            return self.check.run(self, args)
        return self.fn(*args)

    @property
    def _boxed_call(self) -> bool:
        return getattr(self.fn, "_boxed_call", False)


@contextlib.contextmanager
def _recording_buffers(into: dict[str, int]) -> Iterator[None]:
    """Record the storage bytes of every buffer each graph lowered in the block writes code for."""
    from torch._inductor import ir
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.codegen

    def codegen(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for name, buf in self.name_to_buffer.items():
            layout = buf.get_output_spec()
            if isinstance(layout, ir.Layout):
                into[name] = int(layout.storage_size()) * layout.dtype.itemsize
            else:
                into[name] = 0
        return result

    GraphLowering.codegen = codegen
    try:
        yield
    finally:
        GraphLowering.codegen = original


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence, *, backward: bool,
                  num_user_outputs: int = 0) -> InductorGraph:
    """Compile one of a plan's graphs with Inductor (``compile_fx_inner``), recording its buffers.

    The outputs the caller sees keep the strides the traced graph gives them, as ``torch.compile``
    keeps them: the forward's first ``num_user_outputs`` and every gradient the backward returns (a
    gradient in another layout than its parameter's would be copied by autograd's accumulation, an
    allocation outside both the plan and the code). Inductor's FX graph cache is off for the call: a
    cache hit would skip the lowering whose buffers the walk needs.
    """
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    from remat_compiler.collectives import as_library_ops

    as_library_ops(gm)  # the gloo release after each wait, as operators Inductor can lower
    store_shared_values(gm)
    out = next(iter(gm.graph.find_nodes(op="output")))
    returned = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    visible = range(len(returned)) if backward else range(num_user_outputs)
    out.meta["user_visible_output_idxs"] = [i for i in visible if isinstance(returned[i], fx.Node)]
    buffers: dict[str, int] = {}
    with _recording_buffers(buffers), config.patch(fx_graph_cache=False):
        if backward:
            fn = compile_fx_inner(gm, example_inputs, is_backward=True)
        else:
            fn = compile_fx_inner(gm, example_inputs, is_inference=False)
    source = getattr(fn, "source_code", None)
    if not isinstance(source, str):
        raise UnreadableCodeError(f"Inductor returned {type(fn).__name__} without its generated source")
    return InductorGraph(fn, source, buffers)


# ----------------------------------------------------------------------------------------------
# The walk over the generated wrapper

_NAME = r"[A-Za-z_]\w*"
_ASSIGN = re.compile(rf"^({_NAME}) = (.+)$")
_EMPTY = re.compile(r"^empty_strided\w*\(\(([^)]*)\), \(([^)]*)\),.*?(torch\.\w+)")
_ALIAS = re.compile(rf"^(?:reinterpret_tensor\()?({_NAME})(?:,.*\))?$")
_ITEM = re.compile(rf"^({_NAME})\[(\d+)\]$")
_UNPACK = re.compile(rf"^((?:{_NAME}, )*{_NAME},?) = args$")


def _call_body(source: str) -> list[str]:
    """The statements of the wrapper's ``call``, one per item (``a; del b`` split), comments dropped."""
    lines = source.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(r"^\s*def call\((self, )?args\):", line)), None)
    if start is None:
        raise UnreadableCodeError("the generated wrapper has no call(args) function")
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        code = line.split("  #", 1)[0].strip()
        if not code or code.startswith("#"):
            continue
        body.extend(s.strip() for s in code.split("; ") if s.strip())
    return body


def _split_top(text: str) -> list[str]:
    """Split ``text`` at its top-level commas."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _span_bytes(sizes: str, strides: str, dtype: str) -> int:
    size = [int(s) for s in sizes.split(",") if s.strip()]
    stride = [int(s) for s in strides.split(",") if s.strip()]
    if any(s == 0 for s in size):
        return 0
    itemsize = getattr(torch, dtype.removeprefix("torch.")).itemsize
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


class _Storages:
    """Storages with reference counts (names in a frame, and holds), and the bytes of the live ones."""

    def __init__(self, peak: EmittedPeak, charged=int):
        self.charged = charged  # what the allocator charges a buffer of n bytes
        self.bytes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.live_bytes = 0
        self.peak = peak

    def new(self, nbytes: int) -> int:
        sid = len(self.bytes)
        self.bytes[sid], self.refs[sid] = self.charged(nbytes), 0
        return sid

    def acquire(self, sid: int | None) -> None:
        if sid is None:
            return
        if self.refs[sid] == 0:
            self.live_bytes += self.bytes[sid]
        self.refs[sid] += 1

    def release(self, sid: int | None) -> None:
        if sid is None:
            return
        self.refs[sid] -= 1
        if self.refs[sid] == 0:
            self.live_bytes -= self.bytes[sid]


_RESIDENT = None  # the storage of a parameter, input or constant: counts nothing


def _walk(graph: InductorGraph, tag: str, mem: _Storages, bound: list[int | None]) -> list[int | None]:
    """Run the statements of ``graph``'s ``call`` on ``mem``; ``bound`` gives each input's storage
    (each holding one reference for it). Returns the storages of what it returns, one reference each."""
    frame: dict[str, int | None] = {}
    multi: set[str] = set()
    statements = list(_call_body(graph.source))
    # a fallback kernel allocates all its outputs while its inputs are alive, and the code names them
    # afterwards (``buf1 = buf0[i]``, or ``buf1 = buf0`` for its only one), often after ``del``s of
    # those inputs: the outputs are counted at the call (``pending``), and handed to their names later
    named_from: dict[str, list[str]] = {}
    for stmt in statements:
        if (m := _ASSIGN.match(stmt)) and (item := _ITEM.match(m.group(2)) or _ALIAS.match(m.group(2))):
            named_from.setdefault(item.group(1), []).append(m.group(1))
    pending: dict[str, int] = {}

    def drop(name: str) -> None:
        if name not in frame:
            raise UnreadableCodeError(f"{tag}: del of {name}, which is not defined")
        mem.release(frame.pop(name))

    def bind(name: str, sid: int | None) -> None:
        if name in frame:
            drop(name)
        frame[name] = sid
        mem.acquire(sid)

    for stmt in statements:
        if stmt == "args.clear()" or stmt.startswith(("assert_", "pass")):
            continue
        if m := _UNPACK.match(stmt):
            names = [n.strip() for n in m.group(1).split(",") if n.strip()]
            if len(names) != len(bound):
                raise UnreadableCodeError(f"{tag} takes {len(names)} inputs, the step gives it {len(bound)}")
            for name, sid in zip(names, bound):
                frame[name] = sid  # the caller's reference is handed to the name
            continue
        if stmt.startswith("del "):
            for name in stmt[4:].split(","):
                drop(name.strip())
            continue
        if stmt.startswith("return"):
            items = _split_top(stmt[len("return"):].strip().removeprefix("(").removesuffix(")"))
            outs = []
            for item in items:
                if item == "None":
                    outs.append(_RESIDENT)
                    continue
                a = _ALIAS.match(item)
                if a is None or a.group(1) not in frame:
                    raise UnreadableCodeError(f"{tag} returns {item!r}, not a buffer or input it names")
                outs.append(frame[a.group(1)])
                mem.acquire(frame[a.group(1)])
            for name in list(frame):
                drop(name)
            return outs
        if m := _ASSIGN.match(stmt):
            name, expr = m.groups()
            a, item = _ALIAS.match(expr), _ITEM.match(expr)
            if name in pending:  # the output of a fallback kernel, allocated at its call
                if name in frame:
                    drop(name)
                frame[name] = pending.pop(name)
            elif a and a.group(1) in frame:
                bind(name, frame[a.group(1)])  # the same storage under another name (or a view)
            elif (empty := _EMPTY.match(expr)) is not None:
                bind(name, mem.new(_span_bytes(*empty.groups())))
            elif name in graph.buffer_bytes:
                bind(name, mem.new(graph.buffer_bytes[name]))
                if graph.buffer_bytes[name] == 0 and not expr.startswith("empty"):
                    multi.add(name)  # a fallback kernel: its outputs are named next
                    for out in named_from.get(name, ()):
                        pending[out] = mem.new(_buffer_bytes(graph, out, tag))
                        mem.acquire(pending[out])
            elif re.match(r"^buf\d+$", name):
                raise UnreadableCodeError(f"{tag}: {stmt!r} makes {name}, whose size Inductor did not record")
            else:
                frame[name] = _RESIDENT  # not a tensor buffer (a stream, a size)
            mem.peak.record(f"{tag}:{name}", mem.live_bytes)
            continue
        if stmt.endswith(":"):
            continue  # a block header (a device guard); its body is walked as statements
        mem.peak.record(f"{tag}:{stmt.split('(', 1)[0]}", mem.live_bytes)  # a kernel writing given buffers
    raise UnreadableCodeError(f"{tag}'s call(args) has no return")


def _buffer_bytes(graph: InductorGraph, name: str, tag: str) -> int:
    if name not in graph.buffer_bytes:
        raise UnreadableCodeError(f"{tag}: {name}'s size was not recorded by Inductor")
    return graph.buffer_bytes[name]


def compiled_peak(fw: InductorGraph, bw: InductorGraph, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, *,
                  num_fwd_outputs: int, input_updates=(), hold_outputs: bool = True,
                  allocator: str = "exact") -> EmittedPeak:
    """Walk Inductor's forward, then its backward, and return their live bytes statement by statement.

    Parameters
    ----------
    fw, bw : InductorGraph
        What :func:`compile_graph` made of the plan's forward ``fw_gm`` and backward ``bw_gm``.
    num_fwd_outputs, input_updates, hold_outputs :
        As for :func:`remat_compiler.emitted.emitted_peak`: the step's accounting is the same.
    allocator : str
        The :mod:`remat_compiler.passes.allocator` model each buffer is charged by (the cost graph's).

    Returns
    -------
    EmittedPeak
        Its events are named ``"forward:<buffer or kernel>"`` / ``"backward:..."``.

    Raises
    ------
    UnreadableCodeError
        If a line of either wrapper is not one the walk understands (the backend then does not
        trust the prediction).
    """
    peak = EmittedPeak()
    mem = _Storages(peak, allocator_named(allocator).charged_bytes)
    fw_inputs = list(fw_gm.graph.find_nodes(op="placeholder"))
    outs = _walk(fw, "forward", mem, [_RESIDENT] * len(fw_inputs))
    for i in held_positions(fw_gm, num_fwd_outputs, input_updates, hold_outputs):
        mem.acquire(outs[i])  # held by the caller to the end
    for sid in outs[:num_fwd_outputs]:
        mem.release(sid)
    saved = outs[num_fwd_outputs:]
    bw_inputs = list(bw_gm.graph.find_nodes(op="placeholder"))
    tangents = bw_inputs[len(saved):]
    bound = list(saved)  # each keeps the reference the forward's return took
    for p in tangents:
        val = p.meta.get("val")
        sid = mem.new(strided_span_bytes(val)) if isinstance(val, torch.Tensor) else _RESIDENT
        mem.acquire(sid)
        bound.append(sid)
    scalar = [sid for p, sid in zip(tangents, bound[len(saved):])
              if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].dim() == 0]
    for sid in scalar or bound[len(saved):]:
        mem.acquire(sid)  # a gradient seed: autograd's engine holds it to the end
    _walk(bw, "backward", mem, bound)  # the gradients it returns keep their reference to the end
    return peak


@dataclass(frozen=True)
class StepFacts:
    """What the compilers read of the plan the partitioner just made (see :class:`InductorCompilers`)."""

    bw: fx.GraphModule          # the plan's backward, as emitted
    num_fwd_outputs: int        # the forward's outputs that are the user's (the rest are saved)
    input_updates: tuple        # positions among those of inputs mutated in place
    hold_outputs: bool
    plan_peak_bytes: int
    limit_bytes: int | None     # the budget (None: no limit; the walk still gives the prediction)
    allocator: str = "exact"    # the passes.allocator model the plan's bytes are counted in


class InductorCompilers:
    """AOTAutograd's forward and backward compilers for one traced step under a plan.

    The forward's compiles the plan's forward and, at once, its backward (AOTAutograd would only ask
    for the backward when it first runs, too late to re-plan), walks the two (:func:`compiled_peak`)
    and raises :class:`CompiledOverBudget` when the code peaks above the budget, before anything
    runs. The backward's hands back the backward compiled then, after checking that AOTAutograd asks
    for that same graph.

    Once the code is accepted, the first step it runs is measured (:class:`FirstStepCheck`) and
    ``on_first_step`` is called with the bytes measured and the bytes of outputs the walk counted
    as freed that the caller still held when the backward ran.

    Parameters
    ----------
    facts : callable
        Returns the :class:`StepFacts` of the plan the partitioner just made.
    on_first_step : callable, optional
        Called with the measured peak of the first step the accepted code runs, and the bytes of
        its outputs the caller held against the plan's assumption (see :class:`FirstStepCheck`).
    """

    def __init__(self, facts: Callable[[], StepFacts], on_first_step: Callable[[int, int], None] | None = None):
        self._facts = facts
        self._on_first_step = on_first_step
        self.fw: InductorGraph | None = None
        self.bw: InductorGraph | None = None
        self.peak: EmittedPeak | None = None
        self._bw_code: str | None = None

    def forward(self, gm: fx.GraphModule, example_inputs) -> InductorGraph:
        facts = self._facts()
        self.fw = compile_graph(gm, example_inputs, backward=False, num_user_outputs=facts.num_fwd_outputs)
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            bw_gm = copy.deepcopy(facts.bw)
        self._bw_code = bw_gm.code  # before Inductor's passes rewrite bw_gm in place
        self.bw = compile_graph(bw_gm, _backward_inputs(bw_gm, self.fw, facts.num_fwd_outputs), backward=True)
        self.peak = compiled_peak(self.fw, self.bw, gm, bw_gm, num_fwd_outputs=facts.num_fwd_outputs,
                                  input_updates=facts.input_updates, hold_outputs=facts.hold_outputs,
                                  allocator=facts.allocator)
        if facts.limit_bytes is not None and self.peak.peak_bytes > facts.limit_bytes:
            raise CompiledOverBudget(self.peak, facts.limit_bytes, facts.plan_peak_bytes)
        if self._on_first_step is not None:
            skip = set(held_positions(gm, facts.num_fwd_outputs, facts.input_updates, facts.hold_outputs))
            skip |= set(facts.input_updates)
            unheld = [i for i in range(facts.num_fwd_outputs) if i not in skip]
            FirstStepCheck(self.fw, self.bw, facts.num_fwd_outputs, self._on_first_step, allocator=facts.allocator,
                           unheld=unheld)
        return self.fw

    def backward(self, gm: fx.GraphModule, example_inputs) -> InductorGraph:
        if self.bw is None or gm.code != self._bw_code:
            raise UnreadableCodeError("AOTAutograd asks to compile a backward other than the plan's, "
                                      "whose compiled peak was checked")
        return self.bw


class FirstStepCheck:
    """Measure the first step a plan's Inductor code runs: the walk's prediction checked against
    what ran, so that code peaking above its budget is never run on silently.

    A :class:`~remat_compiler.memory.LiveStorageTracker`, shown the wrappers' own buffers by
    :func:`watch`, is active while the forward runs and again while the backward runs; between the
    two (the caller's code, the loss outside the model) it only sees frees. Its peak is the step's in
    the walk's accounting: the forward's allocations, the outputs the caller holds, the saved values,
    the gradients fed to the backward (counted as it starts, as the walk counts them) and all the
    backward allocates. A forward run again before any backward starts the measure again (the step
    measured is the last forward's and the first backward's); once a backward has run, the graphs
    run unmeasured. What it cannot see: tensors a fallback kernel makes and frees inside itself
    (the tracker sees the kernel's outputs, not its inner operations).

    Parameters
    ----------
    fw, bw : InductorGraph
        The plan's compiled forward and backward; the check attaches itself to both.
    num_fwd_outputs : int
        The forward's outputs that are the caller's (the rest are saved for the backward).
    report : callable
        Called once the first backward has run (inside autograd's backward: once it is over) with
        the measured peak and the bytes of the ``unheld`` outputs still alive then: those the caller
        held through the backward (0 where none).
    allocator : str
        The :mod:`remat_compiler.passes.allocator` model each storage is charged by, the walk's (the cost graph's).
    unheld : sequence of int
        Positions of the caller's outputs that the walk counts as freed once the forward returns
        (``hold_outputs=False``: all but the scalar ones). A caller that keeps one through the
        backward (``out = m(x); out.loss.backward()``) puts the step above the walk by its bytes.
    """

    def __init__(self, fw: InductorGraph, bw: InductorGraph, num_fwd_outputs: int,
                 report: Callable[[int, int], None], *, allocator: str = "exact", unheld: Sequence[int] = ()):
        self.tracker = None  # each forward's own
        self._allocator = allocator_named(allocator)
        self._fw, self._bw = fw, bw
        self._num_fwd_outputs = num_fwd_outputs
        self._report = report
        self._unheld = tuple(unheld)
        self._num_saved: int | None = None  # known once the forward has run
        self._outputs: dict[StorageWeakRef, int] = {}  # the last forward's unheld outputs: bytes
        fw.check = bw.check = self

    def run(self, graph: InductorGraph, args: tuple):
        if graph is self._fw:  # measured afresh until a backward follows: the step is the last forward's
            self.tracker = LiveStorageTracker(allocator=self._allocator)
            flat = args[0] if graph._boxed_call else args
            inputs = {StorageWeakRef(t.untyped_storage()) for t in flat if isinstance(t, torch.Tensor)}
            with self.tracker, watch(self.tracker, [graph]):
                out = graph.fn(*args)
            self._num_saved = len(out) - self._num_fwd_outputs
            self._outputs = self._unheld_storages(out, inputs)
            return out
        if graph is not self._bw or self._num_saved is None:
            return graph.fn(*args)
        self._fw.check = self._bw.check = None
        flat = args[0] if graph._boxed_call else args
        for t in list(flat)[self._num_saved:]:  # the gradients fed to it: the walk's new storages
            if isinstance(t, torch.Tensor):
                self.tracker.adopt(t)
        with self.tracker, watch(self.tracker, [graph]):
            out = graph.fn(*args)
        peak, outputs, self._outputs = self.tracker.peak_bytes, self._outputs, {}

        def report():  # an unheld output alive once the backward is over is the caller's
            self._report(peak, sum(nbytes for ref, nbytes in outputs.items() if not ref.expired()))
        if torch._C._current_autograd_node() is not None:
            # inside autograd's backward: after it, when the values saved for it are released too
            torch.autograd.Variable._execution_engine.queue_callback(report)
        else:
            report()
        return out

    def _unheld_storages(self, out, inputs: set) -> dict:
        """The storages of the forward's ``unheld`` outputs (not those a held output or an input
        shares), weakly, with their bytes."""
        def ref(t):
            return StorageWeakRef(t.untyped_storage())

        kept = inputs | {ref(out[i]) for i in range(self._num_fwd_outputs)
                         if isinstance(out[i], torch.Tensor) and i not in self._unheld}
        return {ref(out[i]): out[i].untyped_storage().nbytes() for i in self._unheld
                if isinstance(out[i], torch.Tensor) and ref(out[i]) not in kept}


def _backward_inputs(bw: fx.GraphModule, fw: InductorGraph, num_fwd_outputs: int) -> list:
    """The backward's example inputs: its placeholders' values, each saved one with the strides
    Inductor's forward gives it (as AOTAutograd re-strides them)."""
    vals = [p.meta.get("val") for p in bw.graph.find_nodes(op="placeholder")]
    strides = getattr(fw.fn, "output_strides", None)
    if strides is None:
        return vals
    saved_strides = list(strides)[num_fwd_outputs:]
    for i, stride in enumerate(saved_strides[:len(vals)]):
        v = vals[i]
        if not isinstance(v, torch.Tensor) or stride is None:
            continue
        stride = tuple(int(x) for x in stride)  # Inductor records them as printed expressions
        if tuple(v.stride()) != stride:
            vals[i] = v.as_strided(v.size(), stride)
    return vals


@contextlib.contextmanager
def watch(tracker, graphs: Sequence[InductorGraph]) -> Iterator[None]:
    """Make ``tracker`` (a :class:`~remat_compiler.memory.LiveStorageTracker`, entered separately) see
    the buffers ``graphs`` allocate outside the dispatcher, by wrapping their ``empty_strided*``."""
    patched = []
    for g in graphs:
        fn = getattr(g.fn, "current_callable", None)
        fn = getattr(fn, "__func__", fn)
        namespace = getattr(fn, "__globals__", None)
        if namespace is None:
            raise UnreadableCodeError("the compiled graph's wrapper module is not reachable")
        for key, original in list(namespace.items()):
            if key.startswith("empty_strided") and callable(original):
                namespace[key] = _adopting(tracker, original)
                patched.append((namespace, key, original))
    try:
        yield
    finally:
        for namespace, key, original in patched:
            namespace[key] = original


def _adopting(tracker, allocate: Callable) -> Callable:
    def allocate_and_adopt(*args, **kwargs):
        t = allocate(*args, **kwargs)
        tracker.adopt(t)
        return t
    return allocate_and_adopt
