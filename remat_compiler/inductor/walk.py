"""The peak of the code Inductor wrote: its two generated wrappers' ``call`` functions read line by line
(:func:`compiled_peak`), under the accounting conventions of :func:`remat_compiler.emitted.emitted_peak`.

Code compiled over symbolic sizes (one plan for a range of shapes, :mod:`remat_compiler.dynamic`)
allocates buffers whose sizes are expressions in the sizes' symbols (``s10*s11``): the walk reads
them at given sizes (``at``, symbol name -> size), the range's bound."""
from __future__ import annotations

import re
from typing import Mapping

import sympy

import torch
import torch.fx as fx

from remat_compiler.emitted import EmittedPeak, held_positions
from remat_compiler.inductor.graph import InductorGraph, UnreadableCodeError
from remat_compiler.passes.allocator import allocator_named

__all__ = ["Storages", "walk_graph", "compiled_peak", "call_body", "size_at", "symbolic_sizes"]


_NAME = r"[A-Za-z_]\w*"
_ASSIGN = re.compile(rf"^({_NAME}) = (.+)$")
_EMPTY = re.compile(r"^empty_strided\w*\((.*)\)$")
_DTYPE = re.compile(r"^(?:dtype=)?(torch\.\w+)$")
_ALIAS = re.compile(rf"^(?:reinterpret_tensor\()?({_NAME})(?:,.*\))?$")
_ITEM = re.compile(rf"^({_NAME})\[(\d+)\]$")
_UNPACK = re.compile(rf"^((?:{_NAME}, )*{_NAME},?) = args$")


def call_body(source: str) -> list[str]:
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


def size_at(x, at: Mapping[str, int] | None) -> int:
    """``x`` (an int, a SymInt, a sympy expression or one printed in Inductor's code) at the sizes
    ``at`` gives its symbols; UnreadableCodeError where a symbol has no size there, or the
    expression is not one sympy reads to an integer."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        x = x.node.expr
    if isinstance(x, str):
        if x.strip().lstrip("-").isdigit():
            return int(x)
        x = _sympified(x)
    missing = sorted(str(s) for s in x.free_symbols if str(s) not in (at or {}))
    if missing:
        raise UnreadableCodeError(f"a size {x} of symbols {missing} that the walk has no sizes for")
    value = x.subs({s: at[str(s)] for s in x.free_symbols})
    if not value.is_integer:
        raise UnreadableCodeError(f"the size {x} is not an integer at {dict(at)}: {value}")
    return int(value)


def _sympified(text: str):
    try:
        return sympy.sympify(text)
    except (sympy.SympifyError, SyntaxError, TypeError) as exc:
        raise UnreadableCodeError(f"a size {text!r} in Inductor's code is not an expression sympy reads") from exc


def _empty_args(expr: str) -> tuple[list[str], list[str], str] | None:
    """The sizes, strides and dtype of an ``empty_strided*((sizes), (strides), ..., dtype)`` call in
    Inductor's code (each size as printed, parentheses inside it kept); None for another statement
    (its buffer is then sized from what Inductor recorded)."""
    m = _EMPTY.match(expr)
    if m is None:
        return None
    args = _split_top(m.group(1))
    dtype = next((d.group(1) for a in args[2:] if (d := _DTYPE.match(a)) is not None), None)
    if len(args) < 3 or dtype is None or not all(a.startswith("(") and a.endswith(")") for a in args[:2]):
        return None
    return _split_top(args[0][1:-1]), _split_top(args[1][1:-1]), dtype


def _itemsize(dtype: str) -> int:
    """The element size of a dtype as Inductor's code names it (``torch.float32``)."""
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def _span_bytes(sizes, strides, itemsize: int, at: Mapping[str, int] | None = None) -> int:
    """Bytes of the smallest storage holding these sizes and strides (each as :func:`size_at` reads
    it), as :func:`~remat_compiler.passes.storage.strided_span_bytes` counts a tensor's."""
    size = [size_at(x, at) for x in sizes]
    stride = [size_at(x, at) for x in strides]
    if any(s == 0 for s in size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


class Storages:
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


def walk_graph(graph: InductorGraph, tag: str, mem: Storages, bound: list[int | None],
               at: Mapping[str, int] | None = None) -> list[int | None]:
    """Run the statements of ``graph``'s ``call`` on ``mem``; ``bound`` gives each input's storage
    (each holding one reference for it), ``at`` the size of each symbol its sizes are expressions
    in. Returns the storages of what it returns, one reference each."""
    frame: dict[str, int | None] = {}
    multi: set[str] = set()
    statements = list(call_body(graph.source))
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
            elif (empty := _empty_args(expr)) is not None:
                sizes, strides, dtype = empty
                bind(name, mem.new(_span_bytes(sizes, strides, _itemsize(dtype), at)))
            elif name in graph.buffer_bytes:
                nbytes = _buffer_bytes(graph, name, tag, at)
                bind(name, mem.new(nbytes))
                if nbytes == 0 and not expr.startswith("empty"):
                    multi.add(name)  # a fallback kernel: its outputs are named next
                    for out in named_from.get(name, ()):
                        pending[out] = mem.new(_buffer_bytes(graph, out, tag, at))
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


def _buffer_bytes(graph: InductorGraph, name: str, tag: str, at: Mapping[str, int] | None = None) -> int:
    if name not in graph.buffer_bytes:
        raise UnreadableCodeError(f"{tag}: {name}'s size was not recorded by Inductor")
    return size_at(graph.buffer_bytes[name], at)


def symbolic_sizes(graph: InductorGraph) -> list:
    """Every size expression of ``graph``'s buffers that has symbols: each lowered buffer's storage
    bytes, and each size and stride its wrapper allocates with (what a range of shapes needs to be
    non-decreasing in each symbol, :func:`remat_compiler.dynamic.monotone`)."""
    exprs = [b for b in graph.buffer_bytes.values() if not isinstance(b, int)]
    for stmt in call_body(graph.source):
        if (m := _ASSIGN.match(stmt)) and (empty := _empty_args(m.group(2))) is not None:
            exprs += [_sympified(x) for x in (*empty[0], *empty[1]) if not x.lstrip("-").isdigit()]
    return exprs




def compiled_peak(fw: InductorGraph, bw: InductorGraph, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, *,
                  num_fwd_outputs: int, input_updates=(), hold_outputs: bool = True,
                  allocator: str = "exact", at: Mapping[str, int] | None = None) -> EmittedPeak:
    """Walk Inductor's forward, then its backward, and return their live bytes statement by statement.

    Parameters
    ----------
    fw, bw : InductorGraph
        What :func:`compile_graph` made of the plan's forward ``fw_gm`` and backward ``bw_gm``.
    num_fwd_outputs, input_updates, hold_outputs :
        As for :func:`remat_compiler.emitted.emitted_peak`: the step's accounting is the same.
    allocator : str
        The :mod:`remat_compiler.passes.allocator` model each buffer is charged by (the cost graph's).
    at : mapping of str to int, optional
        Code compiled over symbolic sizes is walked at these sizes (symbol name -> size).

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
    mem = Storages(peak, allocator_named(allocator).charged_bytes)
    fw_inputs = list(fw_gm.graph.find_nodes(op="placeholder"))
    outs = walk_graph(fw, "forward", mem, [_RESIDENT] * len(fw_inputs), at)
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
        sid = mem.new(_span_bytes(val.shape, val.stride(), val.element_size(), at)) \
            if isinstance(val, torch.Tensor) else _RESIDENT
        mem.acquire(sid)
        bound.append(sid)
    scalar = [sid for p, sid in zip(tangents, bound[len(saved):])
              if isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].dim() == 0]
    for sid in scalar or bound[len(saved):]:
        mem.acquire(sid)  # a gradient seed: autograd's engine holds it to the end
    walk_graph(bw, "backward", mem, bound, at)  # the gradients it returns keep their reference to the end
    return peak
