"""AOTAutograd's forward and backward compilers under a plan: each graph compiled by Inductor
(:func:`compile_graph`), its code walked before anything runs, refused above the budget
(:class:`InductorCompilers`)."""
from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import sympy
import torch
import torch.fx as fx

from remat_compiler.emitted import EmittedPeak, held_positions
from remat_compiler.inductor.first_step import FirstStepCheck
from remat_compiler.inductor.graph import CompiledOverBudget, InductorGraph, UnreadableCodeError
from remat_compiler.inductor.warm import ready
from remat_compiler.inductor.walk import compiled_peak
from remat_compiler.passes.shared_values import store_shared_values

__all__ = ["compile_graph", "in_plan_order", "StepFacts", "InductorCompilers"]


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
            if isinstance(layout, ir.Layout):  # a sympy expression where the sizes are symbolic
                size = sympy.sympify(layout.storage_size()) * layout.dtype.itemsize
                into[name] = int(size) if size.is_number else size
            else:
                into[name] = 0
        return result

    GraphLowering.codegen = codegen
    try:
        yield
    finally:
        GraphLowering.codegen = original


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence, *, backward: bool,
                  num_user_outputs: int = 0, in_order: bool = False) -> InductorGraph:
    """Compile one of a plan's graphs with Inductor (``compile_fx_inner``), recording its buffers.

    The outputs the caller sees keep the strides the traced graph gives them, as ``torch.compile``
    keeps them: the forward's first ``num_user_outputs`` and every gradient the backward returns (a
    gradient in another layout than its parameter's would be copied by autograd's accumulation, an
    allocation outside both the plan and the code). Inductor's FX graph cache is off for the call: a
    cache hit would skip the lowering whose buffers the walk needs. Its pool of freed buffers is off
    too (``allow_buffer_reuse``): a buffer freed and taken again by a later allocation of its size
    stays alive between the two, which Inductor allows where its estimate of the graph's own peak
    does not grow, an estimate without the saved values the backward holds; each buffer is then freed
    at its last use, as the plan frees it (on Mixtral's backward the pool kept 2 MiB across the
    step's peak, above the plan: a re-plan and a second compile). With ``in_order`` its horizontal
    fusion is off too (:func:`in_plan_order`).
    """
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    from remat_compiler.collectives import as_library_ops

    as_library_ops(gm)  # the gloo release after each wait, as operators Inductor can lower
    store_shared_values(gm)
    out = next(iter(gm.graph.find_nodes(op="output")))
    returned = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    visible = range(len(returned)) if backward else range(num_user_outputs)
    out.meta["user_visible_output_idxs"] = [i for i in visible if isinstance(returned[i], fx.Node)]
    buffers: dict[str, int] = {}
    ready()  # the CPU's probe, begun by the first call (warm.start)
    choices = in_plan_order() if in_order else _noting_horizontal_fusion()()
    with _recording_buffers(buffers), config.patch(fx_graph_cache=False, allow_buffer_reuse=False), \
            V.set_choices_handler(choices):
        if backward:
            fn = compile_fx_inner(gm, example_inputs, is_backward=True)
        else:
            fn = compile_fx_inner(gm, example_inputs, is_inference=False)
    source = getattr(fn, "source_code", None)
    if not isinstance(source, str):
        raise UnreadableCodeError(f"Inductor returned {type(fn).__name__} without its generated source")
    return InductorGraph(fn, source, buffers, fused_horizontally=choices.fused)


@functools.lru_cache(maxsize=None)
def in_plan_order():
    """Inductor's heuristics (``InductorChoices``) less horizontal fusion: no kernel computes two values
    of which neither reads the other. The backend compiles a plan this way when the code Inductor
    wrote for it with its own heuristics peaks above the budget, before planning lower
    (:func:`remat_compiler.inductor.backend.first_call`).

    The plan fixes when each value is made and freed. Inductor's fusion of a producer into its
    reader (vertical) keeps that order, and the plan's model prices the pointwise values it fuses
    (:mod:`remat_compiler.fusion`). Fusing readers that only share inputs (horizontal) makes one
    kernel of values the plan makes apart, and the kernel's outputs are all allocated before it
    runs, beside all of its inputs: on the Llama of ``benchmarks.fusion_gap`` the SwiGLU backward's
    three gradients (512 KiB each) then lived together with its three inputs, 386 KB above every
    plan's peak, so the first plan's code overshot the budget and the re-plan lowered by that
    recomputed 0.101 GFLOP where ``torch.compile`` recomputed 0.067 at the same measured peak. The
    same plan compiled without horizontal fusion walks exactly its plan's peak, recomputing 0.067
    GFLOP. Horizontal fusion saves reads, so it stays on where the code fits (GPT-2's step at the
    budget-1.0 point of ``benchmarks.inductor_variants``, with and without it: 150.3 against 161.2 ms
    in one run, 178.8 against 179.1 in another).
    """
    from torch._inductor.choices import InductorChoices

    class InPlanOrder(InductorChoices):
        fused = False  # never

        @staticmethod
        def can_fuse_horizontal(scheduler, node1, node2, shared_data_score) -> bool:
            return False

    return InPlanOrder()


@functools.lru_cache(maxsize=None)
def _noting_horizontal_fusion():
    """Inductor's own heuristics (a class, one instance a compile), noting (``fused``) whether they
    allowed a horizontal fusion: where none was, the code compiled :func:`in_plan_order` would be
    the same."""
    from torch._inductor.choices import InductorChoices

    class NotingHorizontalFusion(InductorChoices):
        fused = False

        def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score) -> bool:
            fuses = InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)
            self.fused = self.fused or fuses
            return fuses

    return NotingHorizontalFusion


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
    at: Mapping[str, int] | None = None  # over symbolic sizes: the sizes the code is walked at
    first_at: Mapping[str, int] | None = None  # and those of the first step, which is checked against its walk


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
        Called with the measured peak of the first step the accepted code runs, the bytes of its
        outputs the caller held against the plan's assumption (see :class:`FirstStepCheck`), and
        the walk of the code at that step's sizes (:attr:`first_peak`).
    on_fakes : bool
        The compiled forward runs the emitted graph itself where its inputs are FakeTensors
        (:attr:`InductorGraph.on_fakes`): a range of shapes compiles its code in the symbolic
        trace's one run on fakes, which Inductor's kernels cannot run.
    in_order : bool
        Compile without Inductor's horizontal fusion (:func:`in_plan_order`).
    """

    def __init__(self, facts: Callable[[], StepFacts],
                 on_first_step: Callable[[int, int, EmittedPeak], None] | None = None, *, on_fakes: bool = False,
                 in_order: bool = False):
        self._facts = facts
        self.in_order = in_order  # compiled without horizontal fusion (in_plan_order)
        self._on_first_step = on_first_step
        self._on_fakes = on_fakes
        self.fw: InductorGraph | None = None
        self.bw: InductorGraph | None = None
        self.peak: EmittedPeak | None = None
        self.first_peak: EmittedPeak | None = None  # the walk at the first step's sizes (see StepFacts.first_at)
        self._bw_code: str | None = None

    @property
    def fused_horizontally(self) -> bool:
        """Whether Inductor fused values of which neither reads the other in the graphs compiled."""
        return any(g is not None and g.fused_horizontally for g in (self.fw, self.bw))

    def forward(self, gm: fx.GraphModule, example_inputs) -> InductorGraph:
        facts = self._facts()
        emitted = None
        if self._on_fakes:
            with torch._subclasses.fake_tensor.unset_fake_temporarily():
                emitted = copy.deepcopy(gm)  # before Inductor's passes rewrite gm in place
        self.fw = compile_graph(gm, example_inputs, backward=False, num_user_outputs=facts.num_fwd_outputs,
                                in_order=self.in_order)
        self.fw.on_fakes = emitted
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            bw_gm = copy.deepcopy(facts.bw)
        self._bw_code = bw_gm.code  # before Inductor's passes rewrite bw_gm in place
        self.bw = compile_graph(bw_gm, _backward_inputs(bw_gm, self.fw, facts.num_fwd_outputs), backward=True,
                                in_order=self.in_order)
        def walked(at):
            return compiled_peak(self.fw, self.bw, gm, bw_gm, num_fwd_outputs=facts.num_fwd_outputs,
                                 input_updates=facts.input_updates, hold_outputs=facts.hold_outputs,
                                 allocator=facts.allocator, at=at)
        self.peak = walked(facts.at)
        self.first_peak = self.peak if facts.first_at is None else walked(facts.first_at)
        if facts.limit_bytes is not None and self.peak.peak_bytes > facts.limit_bytes:
            raise CompiledOverBudget(self.peak, facts.limit_bytes, facts.plan_peak_bytes)
        if self._on_first_step is not None:
            skip = set(held_positions(gm, facts.num_fwd_outputs, facts.input_updates, facts.hold_outputs))
            skip |= set(facts.input_updates)
            unheld = [i for i in range(facts.num_fwd_outputs) if i not in skip]
            FirstStepCheck(self.fw, self.bw, facts.num_fwd_outputs, self._first_step, allocator=facts.allocator,
                           unheld=unheld)
        return self.fw

    def record(self, planned) -> None:
        """Record the accepted code on its :class:`~remat_compiler.pipeline.PlannedGraph`: the backend,
        the walk of the code (at the bound, over a range of shapes) and the two compiled graphs."""
        planned.backend = "inductor"
        planned.compiled = self.peak
        planned.inductor = (self.fw, self.bw)

    def _first_step(self, measured: int, held: int) -> None:
        self._on_first_step(measured, held, self.first_peak)  # the walk at that step's sizes beside it

    def backward(self, gm: fx.GraphModule, example_inputs) -> InductorGraph:
        if self.bw is None or gm.code != self._bw_code:
            raise UnreadableCodeError("AOTAutograd asks to compile a backward other than the plan's, "
                                      "whose compiled peak was checked")
        return self.bw


def _backward_inputs(bw: fx.GraphModule, fw: InductorGraph, num_fwd_outputs: int) -> list:
    """The backward's example inputs: its placeholders' values, each saved one with the strides
    Inductor's forward gives it (as AOTAutograd re-strides them). Over symbolic sizes (a range of
    shapes, :mod:`remat_compiler.dynamic`) the strides are expressions in the sizes' symbols, read
    back into the values' ShapeEnv as torch.compile reads them."""
    vals = [p.meta.get("val") for p in bw.graph.find_nodes(op="placeholder")]
    strides = getattr(fw.fn, "output_strides", None)
    if strides is None:
        return vals
    fake_mode = torch._guards.detect_fake_mode(vals)
    shape_env = fake_mode.shape_env if fake_mode is not None else None
    saved_strides = list(strides)[num_fwd_outputs:]
    for i, stride in enumerate(saved_strides[:len(vals)]):
        v = vals[i]
        if not isinstance(v, torch.Tensor) or stride is None:
            continue
        if all(str(x).lstrip("-").isdigit() for x in stride):
            stride = tuple(int(x) for x in stride)  # Inductor records them as printed expressions
        elif shape_env is not None:
            try:
                stride = tuple(shape_env.deserialize_symexpr(str(x)) for x in stride)
            except Exception as exc:  # noqa: BLE001 - any failure to read it back: the code is not trusted
                raise UnreadableCodeError(f"Inductor's forward gives a saved value the strides {stride}, "
                                          f"which could not be read back as sizes ({exc})") from exc
        else:
            raise UnreadableCodeError(f"Inductor's forward gives a saved value the strides {stride}, "
                                      f"which are symbolic, on static example values")
        if [_printed(x) for x in v.stride()] != [_printed(x) for x in stride]:
            vals[i] = v.as_strided(v.size(), stride)
    return vals


def _printed(x) -> str:
    """A size or stride as an expression, compared without guarding on a symbol's value."""
    return str(x.node.expr) if isinstance(x, torch.SymInt) else str(x)
