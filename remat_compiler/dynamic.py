"""One plan for every batch size and sequence length up to a bound (issue 36, item 1).

Fine-tuning with dynamic padding gives every batch its own length. With ``compile(model, budget,
max_seq_len=N)`` the compiled module traces its step once with the batch dimension (dim 0) and the
sequence dimension (dim 1) of every input symbolic, and plans it once::

    joint = AOTAutograd's joint graph over symbolic FakeTensors (ShapeEnv, no duck sizing)
    at_bound = the same graph, its values propagated at the bound   # same node names
    planned = plan_joint(at_bound, ...)                              # passes, CP-SAT, checks, emit
    fw, bw = planned.fw / planned.bw, propagated again symbolically # one pair for every length

The emitted forward and backward read every size from their inputs (``aten.sym_size`` nodes), so
one pair runs every length; AOTAutograd saves the sizes backward needs as SymInts.

Why the peak at the bound bounds every shorter length: the plan fixes which values are saved,
which are recomputed, and the order of every op. Each value's storage is ``1 + sum((size - 1) *
stride)`` elements, and :func:`check_monotone` proves every size and stride of every value of the
emitted code non-decreasing in each symbol over ``[2, bound]`` (a polynomial whose derivative, with
each symbol written ``2 + t``, has no negative coefficient). So with the same live set at every
point of the schedule, each point's bytes, and the peak, are non-decreasing in the length and the
batch: the plan's peak at the bound is the most any admitted call reaches.

What breaks that argument is detected, not assumed:

- A branch on a size while tracing (an attention kernel chosen by length, a model's
  ``if seq_len > ...``) is a ShapeEnv guard; a size read as a plain int specialises a symbol. Every
  guard and replacement, from the trace and from running the emitted code symbolically, is checked
  at the bound when planning and on every call (:meth:`ShapeRange.why_not`): a call that fails one
  runs today's path (traced and planned for its own shape), and so does a call above the bound, of
  a size 1 (traced sizes are at least 2), or whose other dimensions differ.
- A pass that wrote a concrete size into the code (a value of the bound's shape) shows as a guard
  when the emitted code runs symbolically, and such a range admits only what it holds for.
- A size that is not provably monotone (a floor division, a max) refuses the range with
  :class:`DynamicShapeError`, and the module plans per shape, with a warning.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

__all__ = ["ShapeBounds", "ShapeRange", "DynamicShapeError", "symbolic_inputs", "at_bound", "symbolic_emitted",
           "check_monotone", "monotone", "plan_range"]


class DynamicShapeError(RuntimeError):
    """The step cannot be planned once for a range of shapes (a size not provably monotone, a guard
    that fails at the bound); the message says why. The compiled module then plans per shape."""


@dataclass(frozen=True)
class ShapeBounds:
    """What ``compile(..., max_seq_len=, max_batch_size=)`` asked for.

    Attributes
    ----------
    max_seq_len : int
        The largest dim 1 of a (2-D or more) input that shares the plan.
    max_batch_size : int, optional
        The largest dim 0 of an input that shares the plan; None: the first call's (a DataLoader's
        batches are at most its first one's).
    """

    max_seq_len: int
    max_batch_size: int | None = None

    @classmethod
    def make(cls, max_seq_len, max_batch_size) -> "ShapeBounds | None":
        """Check the arguments of :func:`remat_compiler.compile`; None when ``max_seq_len`` is None.

        Raises
        ------
        ValueError
            A bound that is not an int >= 2, or ``max_batch_size`` without ``max_seq_len``.
        """
        for name, v in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 2):
                raise ValueError(f"{name}={v!r} must be an int of at least 2 (sizes 0 and 1 are traced apart)")
        if max_seq_len is None:
            if max_batch_size is not None:
                raise ValueError("max_batch_size= bounds the shapes that share one plan: pass max_seq_len= too")
            return None
        return cls(max_seq_len, max_batch_size)

    def key(self, key: tuple, leaves: list) -> tuple:
        """A compiled module's entry key (``CompiledModule._key``) with the dims that share a plan
        erased: every call that may share the range's entry maps to one key."""
        def erased(x):
            if isinstance(x, torch.Tensor):
                return ("T", tuple(x.shape[_dynamic_dims(x.dim()):]), x.dim(), str(x.dtype), str(x.device),
                        bool(x.requires_grad))
            return key_leaf(x)
        signature, *rest = key
        return ("shape range", signature[0], tuple(erased(x) for x in leaves), *rest)


def key_leaf(x):
    try:
        hash(x)
        return ("C", x)
    except TypeError:
        return ("C", repr(x))


def _dynamic_dims(ndim: int) -> int:
    """How many leading dims of an input are symbolic: dim 0 (batch) and, from 2-D on, dim 1."""
    return min(ndim, 2)


@dataclass
class ShapeRange:
    """The shapes one traced step serves: each symbol's (input, dim) sites and bound, and the
    conditions (ShapeEnv guards and replacements) under which its graph is the one traced.

    Attributes
    ----------
    shape_env : ShapeEnv
    sites : dict
        ``symbol -> [(input index, dim), ...]`` (inputs counted after the model's state).
    bounds : dict
        ``symbol -> the largest size it takes``.
    """

    shape_env: object
    sites: dict
    bounds: dict
    first: dict = field(default_factory=dict)  # symbol -> its value at the first call
    budget_bytes: int | None = None  # the budget the plan at the bound was made under, once made
    _seen: dict = field(default_factory=dict, repr=False)  # sizes met -> why_not's answer (None: served)

    def binding(self, flat: list[torch.Tensor]) -> dict | str:
        """``symbol -> size`` for a call's inputs, or why they are not in this range."""
        values = {}
        for sym, where in self.sites.items():
            for i, d in where:
                if i >= len(flat) or flat[i].dim() <= d:
                    return f"input {i} has no dim {d}"
                v = int(flat[i].shape[d])
                if values.setdefault(sym, v) != v:
                    return f"input {i} dim {d} is {v}, where another input's same dim is {values[sym]}"
        return values

    def why_not(self, flat: list[torch.Tensor]) -> str | None:
        """None if the traced graph and its plan serve these inputs, else why not."""
        values = self.binding(flat)
        if isinstance(values, str):
            return values
        met = tuple(values.items())
        if met not in self._seen:  # each distinct shape's guards are evaluated once
            self._seen[met] = self.why_not_at(values)
        return self._seen[met]

    def why_not_at(self, values: dict) -> str | None:
        """:meth:`why_not` for ``symbol -> size``."""
        env = self.shape_env
        for sym, v in values.items():
            if v < 2:
                return f"a size of {v} (the range was traced for sizes of at least 2)"
            if sym in self.bounds and sym not in env.replacements and v > self.bounds[sym]:
                return f"a size of {v}, above the bound {self.bounds[sym]}"
        for sym, expr in env.replacements.items():
            if sym in values and int(expr.xreplace(values)) != values[sym]:
                return f"the traced graph holds for {sym} = {expr} only"
        for guard in env.guards:
            held = guard.expr.xreplace(values)
            if held is not sympy.true and not bool(held):
                return f"the traced graph holds under {guard.expr} only"
        return None

    def require(self, what: str) -> None:
        """Raise :class:`DynamicShapeError` unless the ShapeEnv's conditions (its guards and
        replacements so far) hold at the bound and at the first call; ``what`` names what they
        were added by."""
        for where, values in (("the bound", self.at_bound()), ("the first call", self.first)):
            why = self.why_not_at(values)
            if why is not None:
                raise DynamicShapeError(f"{what} does not hold at {where} ({values}): {why}")

    def at_bound(self) -> dict:
        """``symbol -> size`` at the bound: each free symbol at its bound, each one the trace tied to
        others or to a constant (a Linear's features) at what that gives."""
        env = self.shape_env
        free = {s: b for s, b in self.bounds.items() if s not in env.replacements}
        return {s: free[s] if s in free else self.size(s, free) for s in self.bounds}

    def size(self, expr, values: dict) -> int:
        return int(self.shape_env.replace(expr).xreplace(values))


def symbolic_inputs(fake_mode, state: list[torch.Tensor], flat: list[torch.Tensor]) -> tuple[list, dict]:
    """FakeTensors for a step's state (static) and inputs (dim 0 and, from 2-D on, dim 1 symbolic),
    and each symbol's (input, dim) sites."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in state]
    sites: dict = {}
    for i, t in enumerate(flat):
        k = _dynamic_dims(t.dim())
        dims = [DimDynamic.DYNAMIC if d < k and t.shape[d] >= 2 else DimDynamic.STATIC for d in range(t.dim())]
        f = fake_mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims),
                                  source=ConstantSource(f"input_{i}"))
        for d in range(k):
            if isinstance(f.shape[d], torch.SymInt):
                sites.setdefault(f.shape[d].node.expr, []).append((i, d))
        fakes.append(f)
    return fakes, sites


def at_bound(joint: fx.GraphModule, rng: ShapeRange, values: dict) -> fx.GraphModule:
    """A copy of ``joint`` (same nodes, names and meta) whose values are FakeTensors propagated at
    the sizes ``values`` (``symbol -> size``): what the passes, the costing and the solve read."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from remat_compiler.trace import copy_graph_module

    concrete = copy_graph_module(joint)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def sized(v):
        size = [rng.size(s.node.expr, values) if isinstance(s, torch.SymInt) else s for s in v.shape]
        stride = [rng.size(s.node.expr, values) if isinstance(s, torch.SymInt) else s for s in v.stride()]
        with mode:
            return torch.empty_strided(size, stride, dtype=v.dtype, device=v.device, requires_grad=v.requires_grad)
    args = [sized(n.meta["val"]) for n in concrete.graph.find_nodes(op="placeholder")]
    FakeTensorProp(concrete, mode).propagate_dont_convert_inputs(*args)
    return concrete


def symbolic_emitted(fw: fx.GraphModule, bw: fx.GraphModule, joint: fx.GraphModule, fake_mode) -> None:
    """Run the emitted forward and backward on the joint's symbolic values (in place: each node's
    ``val`` becomes symbolic, as AOTAutograd reads the saved SymInts from it). A size the emitted
    code fixed is a new guard or replacement in the ShapeEnv, checked like the trace's."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    vals = {n.name: n.meta["val"] for n in joint.graph.nodes if "val" in n.meta}
    FakeTensorProp(fw, fake_mode).propagate_dont_convert_inputs(
        *[vals[p.name] for p in fw.graph.find_nodes(op="placeholder")])
    out = next(iter(fw.graph.find_nodes(op="output"))).args[0]
    vals.update({o.name: o.meta["val"] for o in out if isinstance(o, fx.Node)})
    FakeTensorProp(bw, fake_mode).propagate_dont_convert_inputs(
        *[vals[p.name] for p in bw.graph.find_nodes(op="placeholder")])


def monotone(expr, lo: int = 2) -> bool:
    """Whether ``expr`` is provably non-decreasing in each of its symbols, each at least ``lo``."""
    syms = sorted(expr.free_symbols, key=str)
    if not syms:
        return True
    if not expr.is_polynomial(*syms):  # a floor division, a max, a modulo: not proven
        return False
    t = {s: sympy.Symbol(f"t_{s}", nonnegative=True) for s in syms}
    for s in syms:
        d = sympy.diff(expr, s).xreplace({x: lo + t[x] for x in syms})
        try:
            poly = sympy.Poly(sympy.expand(d), *t.values())
        except sympy.PolynomialError:
            return False
        if any(c < 0 for c in poly.coeffs()):
            return False
    return True


def check_monotone(*gms: fx.GraphModule) -> None:
    """Raise :class:`DynamicShapeError` unless every size and stride of every tensor value of these
    graphs is provably non-decreasing in each symbol (see the module's docstring)."""
    seen = {}
    for gm in gms:
        for n in gm.graph.nodes:
            for v in torch.utils._pytree.tree_leaves(n.meta.get("val")):
                if not isinstance(v, torch.Tensor):
                    continue
                for s in (*v.shape, *v.stride()):
                    if isinstance(s, torch.SymInt):
                        expr = s.node.expr
                        if expr not in seen:
                            seen[expr] = monotone(expr)
                        if not seen[expr]:
                            raise DynamicShapeError(
                                f"{n.name} has a size or stride {expr} that is not provably non-decreasing in "
                                f"the length: the peak at the bound would not bound shorter lengths")


def plan_range(joint: fx.GraphModule, num_fwd_outputs: int, spec, rng: ShapeRange, fake_mode, *, memo=None):
    """The compiler for a range of shapes: plan ``joint`` (symbolic) at the bound and emit code that
    runs every shape of ``rng``. Returns the :class:`~remat_compiler.pipeline.PlannedGraph` (its ``cg``
    and ``plan`` at the bound; ``fw`` and ``bw`` symbolic).

    Raises
    ------
    DynamicShapeError
        Where the trace's guards fail at the bound or at the first call, or a size is not provably
        monotone; and the errors of :func:`~remat_compiler.pipeline.plan_joint`.
    """
    from remat_compiler.pipeline import plan_joint

    bound = rng.at_bound()
    rng.require("the step traced with symbolic sizes")
    planned = plan_joint(at_bound(joint, rng, bound), num_fwd_outputs, spec, memo=memo)
    rng.budget_bytes = planned.plan.budget_bytes
    symbolic_emitted(planned.fw, planned.bw, joint, fake_mode)
    check_monotone(planned.fw, planned.bw)
    rng.require("the code emitted for the plan")
    planned.plan.extras["shape_range"] = {"bounds": {str(s): b for s, b in bound.items()},
                                         "sites": {str(s): w for s, w in rng.sites.items()}}
    return planned


def is_range_key(key: tuple) -> bool:
    return bool(key) and key[0] == "shape range"


def entry_key(bounds: ShapeBounds, off: str | None, key: tuple, leaves: list, entries: dict) -> tuple:
    """The key of a compiled module's entry for this call: the range's (:meth:`ShapeBounds.key`)
    when the range serves it (or, before its first call, when the call is within the bounds), else
    ``key`` (traced and planned for its own shape). ``off``: why the range was given up, if it was."""
    if off is not None:
        return key
    rkey = bounds.key(key, leaves)
    entry = entries.get(rkey)
    flat = [x for x in leaves if isinstance(x, torch.Tensor)]
    if entry is not None:
        rng = getattr(entry, "shapes", None)
        return rkey if isinstance(rng, ShapeRange) and rng.why_not(flat) is None else key
    for t in flat:
        dims = t.shape[:_dynamic_dims(t.dim())]
        if any(s < 2 for s in dims) or (t.dim() >= 2 and dims[1] > bounds.max_seq_len) \
                or (bounds.max_batch_size is not None and t.dim() >= 1 and dims[0] > bounds.max_batch_size):
            return key
    return rkey


def trace_and_run_range(module, entry, inputs: list[torch.Tensor], backend=None):
    """A compiled module's first call of a range entry: trace the step once with symbolic sizes
    (the first call's tensors, ``entry.example``, give the hints), plan at the bound
    (:func:`plan_range`), and run the call through the emitted code. ``entry.shapes`` becomes the
    :class:`ShapeRange` later calls are checked against.

    ``backend``: how a compiling backend plans, compiles and accepts the range's step
    (:class:`remat_compiler.inductor.ranges.InductorRange`: ``planning(spec)``, read by each call of
    the partition, ``step(entry, spec, rng, partition)`` returning the AOT-wrapped step, which may
    partition the one capture again, ``accept(entry, rng)``); None: the eager backend's, the emitted
    graphs run as they are.

    Raises
    ------
    DynamicShapeError, UntraceableModelError
        Where the step cannot be planned once for the range: the module plans per shape.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from remat_compiler.combines import chooses_combines, explain_unchosen
    from remat_compiler.budget import parse_budget
    from remat_compiler.runtime import grad_deps
    from remat_compiler.trace import aot_step, annotate_joint, run_traced

    bounds: ShapeBounds = entry.shapes
    spec, model, step = module._spec, module._orig_mod, entry.step
    if chooses_combines(spec, model):
        raise DynamicShapeError("choosing MoE combines in the solve is planned per shape")
    spec = explain_unchosen(spec, model)
    n_state = step.num_state
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes, sites = symbolic_inputs(mode, entry.example[:n_state], entry.example[n_state:])
    limits = {}
    for sym, where in sites.items():
        if any(d == 1 for _, d in where):
            limits[sym] = bounds.max_seq_len
        else:
            first = int(entry.example[n_state + where[0][0]].shape[0])
            limits[sym] = bounds.max_batch_size or first
    rng = ShapeRange(env, sites, limits)
    rng.first = rng.binding(entry.example[n_state:])

    def partition(joint, _joint_inputs, *, num_fwd_outputs, **_kw):
        planning = spec if backend is None else backend.planning(spec)  # a backend's re-plan plans lower
        planned = plan_range(annotate_joint(joint, step), num_fwd_outputs, planning, rng, mode, memo=module._memo)
        entry.planned = planned
        entry.grad_deps = grad_deps(planned.cg)
        return planned.fw, planned.bw

    entry.fn = aot_step(step, partition) if backend is None else backend.step(entry, spec, rng, partition)
    try:
        with spec.prepared(model), mode:
            run_traced(entry.fn, model, fakes, step)  # traces, plans and emits; runs once on the fakes
    finally:
        if module._spec.budget.fraction is not None and rng.budget_bytes is not None:
            # a fraction is of the no-recompute peak at the bound: the calls planned per shape (above
            # the bound, of a size 1, or all of them where the range is given up) keep the same bytes
            module._spec = dataclasses.replace(module._spec, budget=parse_budget(rng.budget_bytes))
    if backend is not None:
        backend.accept(entry, rng)
    entry.shapes = rng
    with spec.prepared(model):
        return run_traced(entry.fn, model, inputs, step)
