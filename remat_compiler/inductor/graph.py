"""One graph Inductor compiled, and the two ways the backend refuses code: what every other part of
:mod:`remat_compiler.inductor` reads."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch._subclasses.fake_tensor import FakeTensor

from remat_compiler.emitted import EmittedPeak

__all__ = ["InductorGraph", "UnreadableCodeError", "CompiledOverBudget"]


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
    buffer_bytes : dict[str, int | sympy.Expr]
        Storage bytes of each buffer Inductor lowered, by its name in ``source`` (0 for a
        multi-output kernel's tuple); an expression in the sizes' symbols where the code was
        compiled over symbolic sizes.
    on_fakes : GraphModule, optional
        The graph compiled, run instead where the inputs are FakeTensors (see
        :class:`~remat_compiler.inductor.compile.InductorCompilers`); cleared once the code is accepted.
    fused_horizontally : bool
        Whether Inductor fused values of which neither reads the other into one kernel (see
        :func:`~remat_compiler.inductor.compile.in_plan_order`).
    """

    fn: Callable
    source: str
    buffer_bytes: dict[str, Any] = field(default_factory=dict)
    fused_horizontally: bool = False
    check: Any = None  # a FirstStepCheck (.first_step) measuring this graph's first run (then cleared)
    on_fakes: Any = None

    def __call__(self, *args):
        if self.on_fakes is not None:
            inputs = args[0] if self._boxed_call else args
            if any(isinstance(t, FakeTensor) for t in inputs):
                return list(self.on_fakes(*inputs))
        if self.check is not None:
            return self.check.run(self, args)
        return self.fn(*args)

    @property
    def _boxed_call(self) -> bool:
        return getattr(self.fn, "_boxed_call", False)
